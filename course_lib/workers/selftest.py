"""A worker that checks the launcher itself (chapter 06; tests/test_launch.py, tests/test_comm.py).

    torchrun --nproc-per-node 2 -m course_lib.workers.selftest --mode ok

Modes:

- ``ok``: all-reduce every rank's ``rank + 1`` and report the sum, world size, backend.
- ``fail``: rank 1 raises; rank 0 waits for it in a barrier.
- ``hang``: every rank sleeps for ever (rank 1 also starts a child process in a
  session of its own); ``--pid-dir`` receives one file per process so a test
  can check that the launcher left none of them alive.
- ``mismatch``: rank 0 all-reduces, rank 1 never joins: the process group's
  timeout (``--pg-timeout``) turns the wait into an error.
- ``comm``: the counting collectives and the hand-written ring all-reduce,
  checked against ``torch.distributed`` and the 2(N-1)/N formula.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from course_lib.distributed import comm, launch

FOREVER_S = 3600  # longer than any test's timeout


def _write_pid(pid_dir: str | None, name: str, pid: int) -> None:
    if pid_dir:
        Path(pid_dir, f"{name}.pid").write_text(str(pid))


def _comm_checks(rank: int, world: int) -> dict:
    """Counts and results of every counting collective, for numels divisible by N and not."""
    out: dict = {"world": world}
    g = torch.Generator().manual_seed(1234 + rank)
    for numel in (world * 1000, world * 1000 + 1):  # even chunks, then uneven ones
        x = torch.randn(numel, generator=g, dtype=torch.float32)
        expected = x.clone()
        dist.all_reduce(expected)
        c = comm.ByteCounter()
        y = x.clone()
        comm.ring_all_reduce(y, counter=c)
        out[f"ring_{numel}"] = {"max_abs_diff": (y - expected).abs().max().item(),
                                "bytes": c.bytes, "tensor_bytes": comm.nbytes(x)}
    c = comm.ByteCounter()
    x = torch.full((world * 256,), float(rank + 1))
    comm.all_reduce(x, counter=c)
    shard = torch.empty(256)
    comm.reduce_scatter(shard, torch.arange(world * 256, dtype=torch.float32), counter=c)
    full = torch.empty(world * 256)
    comm.all_gather(full, torch.full((256,), float(rank)), counter=c)
    b = torch.full((world * 256,), float(rank))
    comm.broadcast(b, src=0, counter=c)
    expected_shard = torch.arange(rank * 256, (rank + 1) * 256, dtype=torch.float32) * world
    out["wrappers"] = {
        "all_reduce_ok": bool(torch.all(x == world * (world + 1) / 2)),
        "reduce_scatter_ok": bool(torch.equal(shard, expected_shard)),
        "all_gather_ok": bool(torch.equal(full, torch.arange(world).repeat_interleave(256).float())),
        "broadcast_ok": bool(torch.all(b == 0)),
        "by_op": c.by_op, "calls": c.calls, "bytes": c.bytes, "full_bytes": world * 256 * 4,
    }
    try:  # a wrong shard size must be a clear error, before any communication
        comm.reduce_scatter(torch.empty(3), torch.empty(world * 256))
        out["shape_error"] = None
    except ValueError as exc:
        out["shape_error"] = str(exc)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["ok", "fail", "hang", "mismatch", "comm"], default="ok")
    parser.add_argument("--pg-timeout", type=float, default=60.0, help="process-group timeout, seconds")
    parser.add_argument("--pid-dir", default=None, help="hang mode: write one <name>.pid file per process here")
    a = parser.parse_args()

    rank, world, device = launch.init_distributed(timeout_s=a.pg_timeout)
    if a.mode == "ok":
        x = torch.tensor([float(rank + 1)], device=device)
        dist.all_reduce(x)
        launch.report({"sum": x.item(), "world": world, "rank": rank,
                       "backend": dist.get_backend(), "omp_threads": torch.get_num_threads()})
    elif a.mode == "fail":
        if rank == 1:
            raise ValueError("selftest: rank 1 fails on purpose")
        dist.barrier()
    elif a.mode == "hang":
        _write_pid(a.pid_dir, f"rank{rank}", os.getpid())
        if rank == 1:  # a grandchild in its own session: only a careful launcher finds it
            child = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({FOREVER_S})"],
                                     start_new_session=True)
            _write_pid(a.pid_dir, "grandchild", child.pid)
        time.sleep(FOREVER_S)
    elif a.mode == "mismatch":
        if rank == 0:
            dist.all_reduce(torch.ones(4))  # rank 1 never joins this collective
        else:
            time.sleep(a.pg_timeout + 60)  # outlives rank 0's timeout
    elif a.mode == "comm":
        launch.report(_comm_checks(rank, world))
    launch.shutdown()


if __name__ == "__main__":
    main()
