"""Worker processes that grade a class's notebooks in parallel, each one notebook at a time, under a deadline.

``concurrent.futures`` cannot stop one task: a worker stuck past every limit
(in one long call into C, which no signal interrupts) held the whole run, and
a worker that died broke the pool for every notebook the others held. Here
each worker has a pipe of its own, so this process knows which task each one
holds and since when. A worker past its task's deadline is stopped: asked
first (``SIGUSR1``: it unwinds, and the sandbox it is in kills its kernel and
deletes its folders; nbclient takes ``SIGTERM`` and ``SIGINT`` over while a
notebook runs), then, after ``STOP_GRACE`` seconds, killed with every process
below it. A kernel's process that left that tree (possible only without
namespaces) and the sandbox's temporary folder may then stay behind. When the
run is interrupted (Ctrl-C), every worker is stopped the same way. Workers
run in a process group of their own, which a terminal's Ctrl-C does not
reach: this process decides, and stops them.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

import psutil

STOP_GRACE = 10  # seconds a stopped worker gets to unwind (shut its kernel down, delete its folders)


@dataclass
class Outcome:
    """What became of one task: ``done`` (``value``: what the function returned), ``failed`` (``value``: the
    exception as ``Type: first line``), ``died`` (its worker ended while holding it) or ``overtime`` (it ran
    past its deadline and its worker was stopped)."""

    kind: str
    value: Any = None


def _unwind(signum: int, frame: object) -> None:
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)  # the kernel's tasks end cancelled: nothing to report
    raise SystemExit(1)  # every ``with`` and ``finally`` runs: the sandbox kills its kernel and deletes its folders


def _serve(conn: Connection, fn: Callable[[Any, Any], Any], context: Any) -> None:
    """A worker's loop: ``fn(task, context)`` for each task received, and what became of it sent back."""
    os.setpgid(0, 0)  # out of the terminal's foreground group: Ctrl-C reaches only the main process
    signal.signal(signal.SIGUSR1, _unwind)
    while True:
        try:
            item = conn.recv()
        except EOFError:
            return
        if item is None:
            return
        key, task = item
        try:
            outcome = Outcome("done", fn(task, context))
        except Exception as exc:  # the grader's own failure on this task: the worker grades the next one
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            outcome = Outcome("failed", f"{type(exc).__name__}: {first}"[:400])
        conn.send((key, outcome))


@dataclass
class _Worker:
    process: Any
    conn: Connection
    key: int | None = None
    deadline: float = 0.0
    tree: tuple = ()


def _start(ctx: Any, fn: Callable, context: Any) -> _Worker:
    ours, theirs = ctx.Pipe()
    process = ctx.Process(target=_serve, args=(theirs, fn, context), daemon=True)
    process.start()
    theirs.close()
    return _Worker(process, ours)


def _below(worker: _Worker) -> list[psutil.Process]:
    """The worker and every process below it (its kernel's launcher, the kernel, what the kernel started)."""
    try:
        root = psutil.Process(worker.process.pid)
        return [*root.children(recursive=True), root]
    except psutil.Error:
        return []


def _stop(workers: list[_Worker]) -> None:
    """Stop ``workers``: idle ones are told to end, busy ones are asked (``SIGUSR1``), then killed with
    everything below them once ``STOP_GRACE`` has passed. Every process is killed by its ``psutil`` handle,
    which checks that the id still names that process."""
    for w in workers:
        if w.key is None:
            try:
                w.conn.send(None)
            except OSError:
                pass
        else:
            w.tree = tuple(_below(w))  # as it is now: while it unwinds, its kernel may be orphaned
            try:
                os.kill(w.process.pid, signal.SIGUSR1)
            except OSError:
                pass
    end = time.monotonic() + STOP_GRACE
    for w in workers:
        w.process.join(max(0.0, end - time.monotonic()))
    for w in workers:
        for p in {*w.tree, *_below(w)}:
            try:
                p.kill()
            except psutil.Error:
                pass
        w.process.join(5)
        w.conn.close()


def _collect(worker: _Worker) -> Outcome | None:
    """What its task came to, if it has come to anything yet."""
    if worker.conn.poll():
        try:
            return worker.conn.recv()[1]
        except (EOFError, OSError):
            return Outcome("died")
    if not worker.process.is_alive():
        return Outcome("died")
    return None


def run(tasks: list, fn: Callable[[Any, Any], Any], context: Any, jobs: int, seconds: Callable[[Any], float],
        done: Callable[[Any, Outcome], None]) -> None:
    """``fn(task, context)`` for every task, in ``jobs`` worker processes (``fn`` and ``context`` must pickle),
    each task within ``seconds(task)``; ``done(task, outcome)`` is called here as each one ends. If anything
    raises here (Ctrl-C, or ``done``), every worker is stopped before it goes on."""
    ctx = multiprocessing.get_context("spawn")  # a clean interpreter: nothing of this process is shared
    queue = deque(enumerate(tasks))
    idle: list[_Worker] = []
    busy: dict[int, _Worker] = {}
    try:
        while queue or busy:
            while queue and len(busy) < jobs:
                worker = idle.pop() if idle else _start(ctx, fn, context)
                key, task = queue.popleft()
                try:
                    worker.conn.send((key, task))
                except OSError:  # it ended while idle: its task goes to a fresh one
                    queue.appendleft((key, task))
                    _stop([worker])
                    continue
                worker.key, worker.deadline = key, time.monotonic() + seconds(task)
                busy[key] = worker
            soonest = min(w.deadline for w in busy.values())
            wait([c for w in busy.values() for c in (w.conn, w.process.sentinel)],
                 timeout=max(0.0, soonest - time.monotonic()))
            for key, worker in list(busy.items()):
                outcome = _collect(worker)
                if outcome is None and time.monotonic() >= worker.deadline:
                    _stop([worker])
                    outcome = Outcome("overtime")
                if outcome is None:
                    continue
                del busy[key]
                worker.key = None
                if outcome.kind in ("done", "failed"):
                    idle.append(worker)
                elif worker.process.is_alive():
                    _stop([worker])
                done(tasks[key], outcome)
    finally:
        _stop([*idle, *busy.values()])
