"""A worker that checks the launcher itself (chapter 07; tests/test_launch.py, tests/test_comm.py).

    torchrun --nproc-per-node 2 -m course_lib.experiments.workers.selftest --mode ok

Modes:

- ``ok``: all-reduce every rank's ``rank + 1`` and report the sum, world size, backend.
- ``fail``: rank 1 raises; rank 0 waits for it in a barrier.
- ``hang``: every rank sleeps for ever (rank 1 also starts a child process in a
  session of its own); ``--pid-dir`` receives one file per process so a test
  can check that the launcher left none of them alive.
- ``mismatch``: rank 0 all-reduces, rank 1 never joins: the process group's
  timeout (``--pg-timeout``) turns the wait into an error.
- ``comm``: the collectives as ``counting.counted`` counts them and the
  hand-written ring all-reduce, checked against ``torch.distributed`` and the
  2(N-1)/N formula, with the point-to-point batches the ring posted.

Every tensor lives on the rank's device (a GPU under NCCL). Rank 0 reports an
``OkResult`` or ``CommChecks``; the parent reads it with ``from_dict``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from course_lib.parallel import collectives as comm
from course_lib.experiments import launch
from course_lib.experiments.comm_spies import calls_to
from course_lib.experiments.counting import ByteCounter, counted
from course_lib.experiments.results import WorkerResult

FOREVER_S = 3600  # longer than any test's timeout


@dataclass
class OkResult(WorkerResult):
    sum: float          # the all-reduce of every rank's rank + 1
    world: int
    rank: int
    backend: str
    device: str
    omp_threads: int


@dataclass
class RingCheck(WorkerResult):
    max_abs_diff: float     # against dist.all_reduce
    bytes: float            # what the ring's sends carried, on this rank
    tensor_bytes: int
    batches: list[list[str]]  # the ops of each dist.batch_isend_irecv call, e.g. ["isend", "irecv"]


@dataclass
class WrapperCheck(WorkerResult):
    all_reduce_ok: bool
    reduce_scatter_ok: bool
    all_gather_ok: bool
    broadcast_ok: bool
    by_op: dict[str, float]
    calls: dict[str, int]
    bytes: float
    full_bytes: int


@dataclass
class CommChecks(WorkerResult):
    world: int
    device: str
    ring: dict[str, RingCheck]      # by numel
    wrappers: WrapperCheck
    shape_error: str | None         # the message of a wrong shard size


def _write_pid(pid_dir: str | None, name: str, pid: int) -> None:
    if pid_dir:
        Path(pid_dir, f"{name}.pid").write_text(str(pid))


def _comm_checks(rank: int, world: int, device: torch.device) -> CommChecks:
    """Counts (``counted``'s) and results of every collective, for numels divisible by N and not."""
    ring = {}
    g = torch.Generator().manual_seed(1234 + rank)
    for numel in (world * 1000, world * 1000 + 1):  # even chunks, then uneven ones
        x = torch.randn(numel, generator=g, dtype=torch.float32).to(device)
        expected = x.clone()
        dist.all_reduce(expected)
        c = ByteCounter()
        y = x.clone()
        # the ops of every dist.batch_isend_irecv call: a ring step posts its send and receive together
        with calls_to("batch_isend_irecv", lambda ops: [op.op.__name__ for op in ops]) as batches, \
                counted(c, p2p="ring_all_reduce"):
            comm.ring_all_reduce(y)
        ring[str(numel)] = RingCheck((y - expected).abs().max().item(), c.bytes, comm.nbytes(x), batches)
    c = ByteCounter()
    x = torch.full((world * 256,), float(rank + 1), device=device)
    shard = torch.empty(256, device=device)
    full = torch.empty(world * 256, device=device)
    b = torch.full((world * 256,), float(rank), device=device)
    with counted(c):  # the harness's count of each collective
        dist.all_reduce(x)
        comm.reduce_scatter(shard, torch.arange(world * 256, dtype=torch.float32, device=device))
        comm.all_gather(full, torch.full((256,), float(rank), device=device))
        dist.broadcast(b, src=0)
    expected_shard = torch.arange(rank * 256, (rank + 1) * 256, dtype=torch.float32, device=device) * world
    wrappers = WrapperCheck(
        all_reduce_ok=bool(torch.all(x == world * (world + 1) / 2)),
        reduce_scatter_ok=bool(torch.equal(shard, expected_shard)),
        all_gather_ok=bool(torch.equal(full, torch.arange(world, device=device).repeat_interleave(256).float())),
        broadcast_ok=bool(torch.all(b == 0)),
        by_op=c.by_op, calls=c.calls, bytes=c.bytes, full_bytes=world * 256 * 4)
    try:  # a wrong shard size must be a clear error, before any communication
        comm.reduce_scatter(torch.empty(3, device=device), torch.empty(world * 256, device=device))
        shape_error = None
    except ValueError as exc:
        shape_error = str(exc)
    return CommChecks(world, str(device), ring, wrappers, shape_error)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["ok", "fail", "hang", "mismatch", "comm"], default="ok")
    parser.add_argument("--pid-dir", default=None, help="hang mode: write one <name>.pid file per process here")
    launch.serve(parser, run_mode)


def run_mode(a: argparse.Namespace, rank: int, world: int, device: torch.device) -> WorkerResult | None:
    """What ``a.mode`` does on this rank; rank 0's result (``ok``, ``comm``) is reported."""
    if a.mode == "ok":
        x = torch.tensor([float(rank + 1)], device=device)
        dist.all_reduce(x)
        return OkResult(x.item(), world, rank, dist.get_backend(), str(device), torch.get_num_threads())
    if a.mode == "comm":
        return _comm_checks(rank, world, device)
    if a.mode == "fail":
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
            dist.all_reduce(torch.ones(4, device=device))  # rank 1 never joins this collective
        else:
            time.sleep(a.pg_timeout + 60)  # outlives rank 0's timeout
    return None


if __name__ == "__main__":
    main()
