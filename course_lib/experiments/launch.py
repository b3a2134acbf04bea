"""Start distributed workers from a notebook or a test, and the worker's side of it (chapters 07-13).

Parent side: ``run("course_lib.experiments.workers.selftest", nproc=2)`` runs

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m course_lib.experiments.workers.selftest ...

in a subprocess, waits at most ``timeout`` seconds and returns the dict that
rank 0 passed to ``report``. A failing rank raises ``RuntimeError`` with the
tail of its log; a run past its timeout stops torchrun *and* every worker
(torchrun starts each worker in a session of its own, so stopping torchrun's
process group is not enough) and raises ``TimeoutError``.

Worker side, in ``course_lib/experiments/workers/<name>.py``::

    rank, world, device = init_distributed()
    ...
    report(MyResult(loss=0.1))    # a results.WorkerResult dataclass (or a plain dict)
    shutdown()

or, the same in one call, ``serve(parser, work)`` with ``work(args, rank, world, device) -> MyResult``.

and the parent reads it back typed: ``MyResult.from_dict(run(...))``.

The same worker modules run across machines with torchrun's ``--nnodes`` and a
rendezvous endpoint (``docs/multinode.md``).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from course_lib.experiments.results import WorkerResult

ROOT = Path(__file__).resolve().parents[2]
RESULT_ENV = "COURSE_RESULT_FILE"
# Every process a launch starts inherits this tag, so the launcher can find
# stragglers even after torchrun is gone and they were re-parented to init.
TAG_ENV = "COURSE_LAUNCH_TAG"
# Seconds torchrun gets to stop its workers after SIGTERM before we SIGKILL
# them ourselves (torchrun's own grace period is 30 s; a notebook should not wait that long).
STOP_GRACE_S = 5.0
TAIL_LINES = 40


# --------------------------------------------------------------------------- parent side

def run(module: str, nproc: int, args: list[str] | None = None, timeout: float = 120.0,
        env: dict[str, str] | None = None, log_dir: str | Path | None = None, echo: bool = False) -> dict:
    """Run ``module`` on ``nproc`` local ranks under torchrun; return the dict rank 0 reported.

    ``env`` adds environment variables for the workers (``OMP_NUM_THREADS``
    defaults to 1: one core per rank). Logs go to one folder per rank under
    ``log_dir``; without ``log_dir`` they go to a temporary folder that is
    deleted after a successful run and kept (and named in the error) after a
    failure. ``echo`` prints rank 0's output after the run.
    """
    if not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc must be a positive int, got {nproc!r}")
    if timeout <= 0:
        raise ValueError(f"timeout must be positive seconds, got {timeout!r}")
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a missing parent package, or an empty/relative name
        found = False
    if not found:
        raise ValueError(f"no module named {module!r}; workers live under course_lib/experiments/workers/ "
                         "(pass e.g. 'course_lib.experiments.workers.selftest')")
    keep = log_dir is not None
    logs = Path(log_dir) if keep else Path(tempfile.mkdtemp(prefix=f"course-{module.rsplit('.', 1)[-1]}-"))
    logs.mkdir(parents=True, exist_ok=True)
    result_file = logs / "result.json"
    result_file.unlink(missing_ok=True)
    tag = uuid.uuid4().hex
    child_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {}),
                 RESULT_ENV: str(result_file), TAG_ENV: tag,
                 "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           f"--log-dir={logs}", "--redirects=3", "-m", module, *(args or [])]
    launcher_log = logs / "torchrun.log"
    with open(launcher_log, "wb") as out:
        # A session of its own: Ctrl-C in the notebook does not reach the workers
        # half-way; we stop them ourselves below.
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=child_env, cwd=str(ROOT), start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except BaseException as exc:  # TimeoutExpired, or KeyboardInterrupt in a notebook
            _stop(proc, tag)
            if isinstance(exc, subprocess.TimeoutExpired):
                raise TimeoutError(
                    f"{module} on {nproc} ranks did not finish within {timeout:.0f} s; stopped torchrun "
                    f"and its workers. Logs: {logs}\n{_tails(logs, launcher_log)}") from None
            raise
        finally:
            _kill_tagged(tag)  # whatever a worker left behind (e.g. its own children)
    if code != 0:
        raise RuntimeError(_failure_message(module, nproc, code, logs, launcher_log))
    if not result_file.exists():
        raise RuntimeError(f"{module} finished but rank 0 never called launch.report(); logs: {logs}\n"
                           f"{_tails(logs, launcher_log)}")
    result = json.loads(result_file.read_text())
    if echo:
        print(_rank_log(logs, 0, "stdout").strip())
    if not keep:
        shutil.rmtree(logs, ignore_errors=True)
    return result


def _stop(proc: subprocess.Popen, tag: str) -> None:
    """SIGTERM torchrun and every descendant, wait a little, then SIGKILL what is left."""
    import psutil  # a dependency of ipykernel, so always installed with the course

    try:
        family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        family = []
    for p in family:  # the workers are in sessions of their own: signal each one
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(family, timeout=STOP_GRACE_S)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=STOP_GRACE_S)
    try:
        proc.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    _kill_tagged(tag)


def _kill_tagged(tag: str) -> None:
    """SIGKILL any process still carrying this launch's tag (workers re-parented after torchrun died)."""
    import psutil

    victims = []
    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and p.environ().get(TAG_ENV) == tag:
                victims.append(p)
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess, OSError):
            continue  # other users' processes, or one that just exited
    for p in victims:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(victims, timeout=STOP_GRACE_S)


def _rank_log(logs: Path, rank: int, stream: str) -> str:
    """The text of one rank's ``stdout``/``stderr`` log (torchrun writes ``<run>/attempt_<k>/<rank>/``)."""
    files = sorted(logs.glob(f"*/attempt_*/{rank}/{stream}.log"))
    return files[-1].read_text(errors="replace") if files else ""


def _tail(text: str, n: int = TAIL_LINES) -> str:
    return "\n".join(text.rstrip().splitlines()[-n:])


def _tails(logs: Path, launcher_log: Path) -> str:
    """The last lines of every rank's log (for a timeout, when no rank failed by itself)."""
    parts = []
    for rank_dir in sorted({p.name for p in logs.glob("*/attempt_*/*") if p.is_dir()}, key=int):
        text = _rank_log(logs, int(rank_dir), "stdout") + _rank_log(logs, int(rank_dir), "stderr")
        parts.append(f"--- rank {rank_dir} ---\n{_tail(text, 12)}")
    if not parts:
        parts.append(f"--- torchrun ---\n{_tail(launcher_log.read_text(errors='replace'))}")
    return "\n".join(parts)


def _failure_message(module: str, nproc: int, code: int, logs: Path, launcher_log: Path) -> str:
    """Name the failing rank (torchrun's "Root Cause" summary) and show the tail of its log."""
    summary = launcher_log.read_text(errors="replace")
    root = summary.split("Root Cause", 1)[-1]
    m = re.search(r"rank\s*:\s*(\d+)", root)
    if m is None:
        return (f"{module} on {nproc} ranks failed (torchrun exit code {code}); logs: {logs}\n"
                f"{_tail(summary)}\n{_tails(logs, launcher_log)}")
    rank = int(m.group(1))
    text = _rank_log(logs, rank, "stderr").strip() or _rank_log(logs, rank, "stdout")
    return (f"{module} failed on rank {rank} of {nproc} (torchrun exit code {code}); logs: {logs}\n"
            f"last lines of rank {rank}'s log:\n{_tail(text)}")


# --------------------------------------------------------------------------- worker side

# Seconds a rank waits in a collective before the process group gives up. The longest a course worker keeps
# its partners waiting is rank 0 training a single-process reference before its first collective: chapter 09's
# at the gpu profile takes 2.0 s of CPU time on one core (measured: tiny transformer d=192, 4 layers, 10 Adam
# steps, float32 and float64). 600 s covers that a hundred times over on a slow or crowded machine, plus the
# first use of CUDA and NCCL, which can take tens of seconds on a large node; it is also torch's NCCL default.
# A test that provokes a mismatch passes a short timeout (--pg-timeout) instead.
PG_TIMEOUT_S = 600.0
BACKENDS = ("gloo", "nccl")
# NCCL moves CUDA tensors only; with this mixed backend a CPU tensor (a flag, an object gather) goes through
# gloo instead of failing, so the same worker runs on CPU ranks and on GPU ranks.
NCCL_WITH_CPU = "cpu:gloo,cuda:nccl"


def pick_backend(local_world_size: int, warn: bool = True) -> str:
    """NCCL when this node has a GPU per rank, else gloo on the CPU; ``$COURSE_DIST_BACKEND`` decides first.

    A CPU profile (``$COURSE_PROFILE`` smoke or cpu) keeps the ranks on the CPU,
    like ``env.pick_device``, so a notebook's numbers match CI's; when GPUs are
    there all the same, it says so (a warning naming both ways to use them).
    """
    forced = os.environ.get("COURSE_DIST_BACKEND")
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"COURSE_DIST_BACKEND must be 'gloo' or 'nccl', got {forced!r}")
        return forced
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < local_world_size:
        return "gloo"
    profile = os.environ.get("COURSE_PROFILE")
    if profile in ("smoke", "cpu"):
        if warn:
            warnings.warn(f"COURSE_PROFILE={profile} keeps the {local_world_size} local ranks on the CPU (gloo) "
                          f"although this node has {gpus} GPUs; set COURSE_DIST_BACKEND=nccl, or unset "
                          "COURSE_PROFILE, to run them on the GPUs", stacklevel=2)
        return "gloo"
    return "nccl"


def init_distributed(timeout_s: float = PG_TIMEOUT_S) -> tuple[int, int, torch.device]:
    """Join the process group torchrun set up; return ``(rank, world_size, device)``.

    ``timeout_s`` bounds every collective: a rank waiting for a partner that
    never comes (a mismatched collective) raises after it instead of hanging.
    On GPU ranks the group is NCCL for CUDA tensors and gloo for CPU ones.
    """
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise RuntimeError("init_distributed() runs inside a torchrun worker: start it with "
                           "course_lib.experiments.launch.run(module, nproc) or `torchrun -m module`")
    if not timeout_s > 0:
        raise ValueError(f"the process-group timeout must be positive seconds, got {timeout_s!r}")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    backend = pick_backend(int(os.environ.get("LOCAL_WORLD_SIZE", world)), warn=local_rank == 0)
    timeout = timedelta(seconds=timeout_s)
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group(NCCL_WITH_CPU, timeout=timeout, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    return rank, world, device


def add_timeout_arg(parser: argparse.ArgumentParser) -> None:
    """A worker's ``--pg-timeout`` option (seconds), for ``init_distributed(timeout_s=...)``."""
    parser.add_argument("--pg-timeout", type=float, default=PG_TIMEOUT_S,
                        help=f"process-group timeout in seconds (default {PG_TIMEOUT_S:.0f})")


def report(result: dict | WorkerResult) -> None:
    """Rank 0 writes ``result`` (a dataclass, see ``results``, or a dict of JSON values) for ``run`` to return.

    Other ranks do nothing.
    Run by hand under torchrun (no ``$COURSE_RESULT_FILE``), rank 0 prints it instead.
    """
    if int(os.environ.get("RANK", "0")) != 0:
        return
    if dataclasses.is_dataclass(result):
        result = dataclasses.asdict(result)
    text = json.dumps(result)  # fails here, on the worker, if a value is not JSON
    path = os.environ.get(RESULT_ENV)
    if not path:
        print("RESULT " + text, flush=True)
        return
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)  # atomic: the parent never reads half a file


def shutdown() -> None:
    """Leave the process group (no barrier, so a rank that finishes early does not wait on the others).

    Wrappers such as DDP keep the process group and finished work objects alive
    through reference cycles; collecting them first, while the group still
    exists, avoids an occasional abort ("terminate called without an active
    exception") when the interpreter tears them down after the group is gone.
    """
    gc.collect()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


def pick(text: str, choices: tuple[str, ...] | list[str], what: str = "task") -> list[str]:
    """The comma-separated names in ``text``, each checked against ``choices`` (a worker's ``--tasks`` and the like)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in choices]
    if unknown:
        raise ValueError(f"unknown {what}(s) {unknown}; choose from {', '.join(choices)}")
    return names


def serve(parser: argparse.ArgumentParser, work: Callable[[argparse.Namespace, int, int, torch.device], object],
          check: Callable[[argparse.Namespace], None] | None = None) -> None:
    """A worker's main: parse its options (with ``--pg-timeout``), join the group, report ``work``'s result, leave.

    ``work(args, rank, world, device)`` runs on every rank and rank 0's result
    is reported (``None``: nothing). ``check(args)`` runs first, before any
    rank waits for another.
    """
    add_timeout_arg(parser)
    args = parser.parse_args()
    if check is not None:
        check(args)
    rank, world, device = init_distributed(args.pg_timeout)
    result = work(args, rank, world, device)
    if result is not None:
        report(result)
    if dist.get_backend() == "gloo":
        # Every rank waits here for the others before any closes its connections: a rank that left at once could
        # close a pair a slower peer still reads from, and gloo's I/O thread then aborts that peer ("terminate
        # called without an active exception", seen once in chapter 08's PipeDream run). A rank that failed never
        # gets here: torchrun stops the others, so this cannot hang a failed run.
        dist.barrier()
    shutdown()


def layouts(text: str, world: int) -> list[tuple[int, int]]:
    """The comma-separated ``a x b`` layouts of ``text`` (a worker's ``--layouts 4x1,2x2``), each checked to cover the
    ``world`` ranks; none: ``world x 1``."""
    found = [tuple(int(v) for v in s.split("x")) for s in text.split(",") if s] or [(world, 1)]
    for a, b in found:
        if a * b != world:
            raise ValueError(f"layout {a}x{b} needs {a * b} ranks, the launch has {world}")
    return found
