"""Run independent training jobs in a few processes at once (chapters 02 and 04).

A chapter that repeats a small run over seeds or settings leaves all but one core idle at the ``cpu`` profile:
``parallel_runs.run_jobs(train_one, [(seed,) for seed in range(9)])`` is ``[train_one(seed) for seed in
range(9)]`` computed two (or ``processes``) jobs at a time in forked copies of this process, in the jobs' order.

Same numbers as one by one: a forked child is an exact copy of the parent (weights, datasets, the job function),
and every job runs on one intra-op thread, so a job that seeds itself computes bit for bit the same wherever it
runs (one thread is also all a forked child can use safely: OpenMP's pool does not survive a fork). Nothing hangs:
a job that raises, a child that dies or a run past ``timeout`` stops the others and raises ``RuntimeError``.
Where fork is missing or unsafe (Windows, macOS, once CUDA is initialised) the jobs run one by one, same results.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import pickle
import queue
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

# Environment variable that sets how many processes run jobs (``course run`` sets it and says so).
PROCESSES_ENV = "COURSE_PROCESSES"
# How often the parent checks that its children are still alive while it waits, in seconds.
POLL_S = 0.5
# The default bound on a whole call: `course run`'s limit for one `cpu` cell (a loaded machine ran chapter 04's
# runs 15x slower than idle cores); a child that dies is noticed within POLL_S whatever this is.
TIMEOUT_S = 3 * 3600.0


def cores() -> int:
    """The CPU cores this process may use (the affinity mask where the OS has one, e.g. in a container)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def can_fork() -> bool:
    """Whether jobs can run in forked children here: Linux, and CUDA not yet initialised."""
    return sys.platform.startswith("linux") and not torch.cuda.is_initialized()


def default_processes() -> int:
    """``$COURSE_PROCESSES`` if set, else the cores available; 1 where the jobs cannot be forked."""
    if not can_fork():
        return 1
    value = os.environ.get(PROCESSES_ENV)
    if value is None:
        return cores()
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{PROCESSES_ENV} must be a positive whole number of processes, got {value!r}")
    return int(value)


def _child(fn: Callable, jobs: Sequence[tuple], tasks: Any, results: Any) -> None:
    """A forked worker: take job indices until the ``None`` sentinel, send back ``(index, ok, value, output)``."""
    torch.set_num_threads(1)
    # The parent may be a Jupyter kernel whose output streams belong to threads that were not forked: the
    # child's prints and warnings go to a buffer instead, returned with a failure's traceback.
    captured = io.StringIO()
    sys.stdout = sys.stderr = captured
    while (index := tasks.get()) is not None:
        try:
            # pickled here, not in the queue's thread, so that a result that cannot be pickled is this job's error
            results.put((index, True, pickle.dumps(fn(*jobs[index])), ""))
        except BaseException:  # noqa: BLE001 -- every failure goes back to the parent, which raises it
            results.put((index, False, traceback.format_exc(), captured.getvalue()[-2000:]))
            return


def run_jobs(fn: Callable[..., Any], jobs: Sequence[tuple], processes: int | None = None,
             timeout: float = TIMEOUT_S) -> list[Any]:
    """``[fn(*job) for job in jobs]``, run ``processes`` jobs at a time (default: ``default_processes()``),
    each on one intra-op thread.

    ``fn`` should seed what it draws (``env.seed_everything``) so that a job's
    result does not depend on which process ran it or when. ``timeout`` bounds
    the whole call, in seconds.
    """
    if processes is not None and (not isinstance(processes, int) or processes < 1):
        raise ValueError(f"processes must be a whole number >= 1, got {processes!r}")
    jobs = [tuple(job) if isinstance(job, (tuple, list)) else (job,) for job in jobs]
    n = min(len(jobs), processes or default_processes())
    if n <= 1 or not can_fork():
        before = torch.get_num_threads()
        torch.set_num_threads(1)  # as in a child: the same numbers either way
        try:
            return [fn(*job) for job in jobs]
        finally:
            torch.set_num_threads(before)
    ctx = mp.get_context("fork")
    tasks, results = ctx.Queue(), ctx.Queue()
    for index in range(len(jobs)):
        tasks.put(index)
    for _ in range(n):
        tasks.put(None)  # one stop sign per child
    children = [ctx.Process(target=_child, args=(fn, jobs, tasks, results),
                            name=f"job-runner-{i}") for i in range(n)]
    with warnings.catch_warnings():
        # Python 3.12+ warns on fork in a process with threads (a kernel's): the child touches none of their locks.
        warnings.filterwarnings("ignore", message=".*fork.*", category=DeprecationWarning)
        for child in children:
            child.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < len(jobs):
            try:
                index, ok, value, output = results.get(timeout=POLL_S)
            except queue.Empty:
                dead = [c for c in children if c.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(
                        f"a process running {fn.__name__} jobs died (exit code {dead[0].exitcode}; negative: killed "
                        f"by that signal, -9 often means out of memory) with {len(jobs) - len(out)} job(s) left; "
                        f"run them one by one with processes=1 to see where") from None
                if all(c.exitcode == 0 for c in children) and results.empty():  # all stopped, results missing
                    raise RuntimeError(f"the processes running {fn.__name__} stopped with "
                                       f"{len(jobs) - len(out)} job(s) unfinished") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{fn.__name__}: {len(jobs) - len(out)} of {len(jobs)} job(s) unfinished "
                                       f"after {timeout:.0f} s; stopped the processes running them") from None
                continue
            if not ok:
                raise RuntimeError(f"job {index} of {len(jobs)}, {fn.__name__}{jobs[index]!r}, failed in a worker "
                                   f"process:\n{value}" + (f"\nits output:\n{output}" if output.strip() else ""))
            out[index] = pickle.loads(value)
    finally:
        for child in children:  # after a failure the others are still working: stop them
            if child.is_alive() and len(out) < len(jobs):
                child.terminate()
            child.join(timeout=10)
            if child.is_alive():
                child.kill()
                child.join()
        tasks.close()
        results.close()
    return [out[i] for i in range(len(jobs))]
