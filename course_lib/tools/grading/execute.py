"""Run a notebook's cells in a separate kernel, one at a time, with time limits; never hang.

Learner code never runs in the grader's process: nbclient starts a fresh
IPython kernel inside a ``Sandbox`` (``course_lib.tools.grading.isolation``), killed
at the end with everything it started. Outputs are not kept (a cell that
prints gigabytes cannot fill the grader's memory). Each code cell gets
``timeout`` seconds; the whole notebook gets ``total_timeout``. What happened
to each cell is returned, not raised:

- ``ok`` / ``error`` (with the exception's name and message) from the kernel's reply;
- ``timeout``: the cell ran past its limit. The kernel is interrupted; when it
  answers again the next cells run on, otherwise it is killed;
- ``dead``: the kernel died while running the cell (``os._exit``, a crash, out of memory);
- ``not_run``: an earlier cell killed the kernel, or the overall limit was spent.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import math
import os
import re
import subprocess
import time
from dataclasses import dataclass
from queue import Empty
from typing import Callable

from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
from jupyter_client.manager import AsyncKernelManager
from nbclient import NotebookClient
from nbclient.exceptions import CellTimeoutError, DeadKernelError
from nbclient.util import ensure_async
from nbformat import NotebookNode

from course_lib.tools.grading.exercise import GradingError
from course_lib.tools.grading.isolation import Sandbox

STARTUP_TIMEOUT = 60     # seconds for a kernel to start on a busy laptop
RECOVER_TIMEOUT = 10     # seconds an interrupted kernel gets to answer again before it is killed
GRACE = 15               # slack above nbclient's own timeout before our hard guard cuts in
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


@dataclass
class CellRun:
    """What happened to one cell."""

    status: str = "skipped"   # ok, error, timeout, dead, not_run, skipped (markdown or empty)
    ename: str = ""
    evalue: str = ""
    traceback: str = ""
    seconds: float = 0.0
    cause: int | None = None  # for not_run: the cell whose crash or hang stopped the run
    limit: str = ""           # the sandbox's limit this cell passed, in the grader's words (the kernel was stopped)


class _SandboxSpecs(KernelSpecManager):
    # Always this interpreter, started by the sandbox launcher: a user-wide "python3"
    # kernel could be another Python, and the notebook's own kernelspec is the learner's.
    # Interrupts travel as messages: a signal could not reach a kernel in its own namespace.
    def __init__(self, argv: list[str]) -> None:
        super().__init__()
        self.argv = argv

    def get_kernel_spec(self, kernel_name: str) -> KernelSpec:
        return KernelSpec(argv=self.argv, display_name="Python 3 (course grader)", language="python",
                          interrupt_mode="message")


class _SandboxKernel(AsyncKernelManager):
    """A kernel reached over Unix sockets in its own folder (ZeroMQ ``ipc``), never TCP: in its own network
    namespace it has no other way to talk, and no port on this machine's localhost is opened for it."""

    def __init__(self, sandbox: Sandbox, **kwargs) -> None:
        super().__init__(transport="ipc", ip=str(sandbox.ipc), **kwargs)
        self.sandbox = sandbox

    async def _async_launch_kernel(self, kernel_cmd: list[str], **kw) -> None:
        await super()._async_launch_kernel(kernel_cmd, **kw)
        # the sockets are where the kernel sees them; the grader may reach that folder by another path
        self.ip = self.sandbox.attach(self.provisioner.process.pid)


class _Client(NotebookClient):
    """nbclient without keeping outputs: the grade never looks at them."""

    def output(self, outs, msg, display_id, cell_index):  # type: ignore[override]
        return None

    def handle_comm_msg(self, outs, msg, cell_index):  # type: ignore[override]
        return None


def _quiet_logger() -> logging.Logger:
    # nbclient logs every timeout and dead kernel as an error; the grade report says it better.
    log = logging.getLogger("course_lib.tools.grading.kernel")
    log.setLevel(logging.CRITICAL)
    log.propagate = False
    return log


async def _answers(client: NotebookClient, seconds: float) -> bool:
    """Whether the kernel runs a trivial command within ``seconds`` (after an interrupt)."""
    msg_id = await ensure_async(client.kc.execute("pass", store_history=False))
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if not await ensure_async(client.kc.is_alive()):
            return False
        try:
            wait = min(1.0, max(0.05, end - time.monotonic()))
            msg = await ensure_async(client.kc.shell_channel.get_msg(timeout=wait))
        except Empty:
            continue
        if msg["parent_header"].get("msg_id") == msg_id:
            return True
    return False


async def _interrupt(client: NotebookClient) -> bool:
    """Interrupt a cell that ran too long; kill the kernel unless it answers again. True if it lives on."""
    try:
        await ensure_async(client.km.interrupt_kernel())
        if await _answers(client, RECOVER_TIMEOUT):
            return True
    except Exception:  # it died meanwhile, or the channel broke: same outcome
        pass
    try:
        await asyncio.wait_for(ensure_async(client.km.shutdown_kernel(now=True)), GRACE)
    except Exception:
        pass
    return False


async def _run_cells(nb: NotebookNode, sandbox: Sandbox, timeout: int, total_timeout: float,
                     runs: list[CellRun], after_cell: Callable[[int, CellRun], None] | None) -> None:
    replies: dict[int, dict] = {}

    def on_executed(cell: NotebookNode, cell_index: int, execute_reply: dict) -> None:
        replies[cell_index] = execute_reply.get("content", {}) if execute_reply else {}

    km = _SandboxKernel(sandbox, kernel_name="python3", kernel_spec_manager=_SandboxSpecs(sandbox.argv()),
                        connection_file=str(sandbox.connection_file), log=_quiet_logger())
    client = _Client(
        nb, km=km, timeout=timeout, allow_errors=True, interrupt_on_timeout=False, kernel_name="python3",
        startup_timeout=STARTUP_TIMEOUT, shutdown_kernel="immediate", record_timing=False, log=_quiet_logger(),
        on_cell_executed=on_executed,
    )
    # the launcher's own environment: it builds the kernel's from nothing (isolation.kernel_env)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"}
    log = open(sandbox.log, "wb")
    try:
        setup = client.async_setup_kernel(cleanup_kc=True, cwd=str(sandbox.base), env=env,
                                          stdout=subprocess.DEVNULL, stderr=log)
        await asyncio.wait_for(setup.__aenter__(), STARTUP_TIMEOUT + GRACE)
    except Exception as exc:
        atexit.unregister(client._cleanup_kernel)  # nbclient's exit hook would find no kernel manager
        try:  # a half-started kernel must not outlive us
            await asyncio.wait_for(km.shutdown_kernel(now=True), GRACE)
        except Exception:
            pass
        log.close()
        detail = sandbox.startup_log()
        raise GradingError(
            f"could not start a Python kernel to grade with ({type(exc).__name__}: {exc}; isolation "
            f"{sandbox.mode}){': ' + detail if detail else ''}. Check that ipykernel is installed in this "
            "environment (course doctor); with isolation by user id, the kernel's user must be able to read "
            "the Python installation and this course's folder (or set COURSE_GRADER_ISOLATION=none)") from None
    deadline = time.monotonic() + total_timeout  # counted once the kernel is up: starting it has its own limit
    stopped, cause = "", None  # why the cells after this point do not run, and which cell did it
    try:
        for i, cell in enumerate(nb.cells):
            if cell.cell_type != "code" or not cell.source.strip():
                continue
            run = runs[i]
            remaining = deadline - time.monotonic()
            if not stopped and remaining <= 0:
                stopped = f"grading ran past its overall limit of {total_timeout:.0f} s"
            if stopped:
                run.status, run.evalue, run.cause = "not_run", stopped, cause
                continue
            client.timeout = max(1, math.ceil(min(timeout, remaining)))
            start = time.monotonic()
            try:
                await asyncio.wait_for(client.async_execute_cell(cell, i), client.timeout + GRACE)
                reply = replies.get(i, {})
                if reply.get("status") == "error":
                    run.status, run.ename, run.evalue = "error", reply.get("ename", ""), reply.get("evalue", "")
                    run.traceback = _ANSI.sub("", "\n".join(reply.get("traceback", [])))
                else:
                    run.status = "ok"
            except (CellTimeoutError, asyncio.TimeoutError):
                run.status, run.evalue = "timeout", f"ran past the {client.timeout} s limit"
                if not await _interrupt(client):
                    stopped, cause = "the kernel stopped answering after a timeout", i
            except DeadKernelError:
                run.status, run.evalue = "dead", "the kernel died while running this cell"
                stopped, cause = "the kernel died earlier", i
            except Exception as exc:  # a broken connection to the kernel: stop rather than guess
                run.status, run.evalue = "dead", f"the kernel failed ({type(exc).__name__}: {exc})"
                stopped, cause = "the kernel failed earlier", i
            run.seconds = time.monotonic() - start
            if after_cell is not None and not stopped:
                after_cell(i, run)  # while the kernel lives: its folder goes with it
            over = sandbox.over_limit()
            if over and not stopped:
                run.status, run.ename, run.evalue, run.limit = "error", "", over, over
                stopped, cause = f"the kernel was stopped: {over}", i
                try:
                    await asyncio.wait_for(ensure_async(client.km.shutdown_kernel(now=True)), GRACE)
                except Exception:
                    pass
    finally:
        try:
            await asyncio.wait_for(setup.__aexit__(None, None, None), GRACE)
        except Exception:  # the kernel may be gone already; nothing left to clean
            pass
        log.close()


def notebook_limit(timeout: int, total_timeout: float | None = None) -> float:
    """Seconds for all of a notebook's cells: ``total_timeout``, else ten cells' worth, at least two minutes."""
    return total_timeout if total_timeout is not None else max(120, 10 * timeout)


def longest_run(timeout: int, total_timeout: float | None = None) -> float:
    """The most a ``run_notebook`` can take: its kernel's start, its cells, and the last cell's overrun (the
    guard above nbclient's limit, an interrupt's wait, a shutdown)."""
    return STARTUP_TIMEOUT + GRACE + notebook_limit(timeout, total_timeout) + 2 * GRACE + RECOVER_TIMEOUT + GRACE


def run_notebook(nb: NotebookNode, sandbox: Sandbox, timeout: int = 60, total_timeout: float | None = None,
                 after_cell: Callable[[int, CellRun], None] | None = None) -> list[CellRun]:
    """Execute ``nb`` in a fresh kernel inside ``sandbox``; one ``CellRun`` per cell.

    ``timeout``: seconds per cell. ``total_timeout``: seconds for all cells
    (default: ten cells' worth, at least two minutes), so grading always ends.
    ``after_cell(index, run)`` is called after each cell while the kernel still
    lives (to read what it wrote: in a namespace its folder ends with it). A
    kernel whose folder outgrows the sandbox's limit is stopped there.
    """
    if timeout < 1:
        raise GradingError(f"the time limit per cell must be at least 1 second, got {timeout}")
    total = notebook_limit(timeout, total_timeout)
    runs = [CellRun() for _ in nb.cells]
    try:
        asyncio.run(_run_cells(nb, sandbox, timeout, total, runs, after_cell))
    finally:
        sandbox.kill_leftovers()
    return runs
