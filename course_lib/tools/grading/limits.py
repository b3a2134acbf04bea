"""What a learner's kernel may use, in every isolation mode, and what an error means when it hit a limit.

The sandbox launcher sets ``RLIMIT_NPROC`` (processes and threads of the
kernel's user id), ``RLIMIT_DATA`` (heap and private maps per process: unlike
``RLIMIT_AS`` it does not count the address space PyTorch reserves and never
touches), ``RLIMIT_FSIZE`` (one file) and no core dumps; the work folder is a
tmpfs of ``disk`` bytes in a namespace, measured after each cell otherwise
(``isolation.Sandbox.over_limit``). A kernel that passes a limit gets an error
(``MemoryError``, ``BlockingIOError``, ``OSError``) like any other; the grader
says which limit it was (``limit_reason``).

The grader's own work on a kernel's answers (decoding them, running the
checks) runs in its process, under ``time_limit``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Iterator

from course_lib.tools.grading.exercise import GradingError


@dataclass(frozen=True)
class Limits:
    """What one kernel may use, in every mode (``COURSE_GRADER_PROCESSES``, ``_MEMORY_MB``, ``_FILE_MB`` and
    ``_DISK_MB`` change the defaults)."""

    processes: int = 128          # RLIMIT_NPROC: processes and threads of the kernel's user id
    memory: int = 4 * 2**30       # RLIMIT_DATA: bytes of heap and private maps, per process
    file: int = 256 * 2**20       # RLIMIT_FSIZE: bytes in one file it writes
    disk: int = 512 * 2**20       # its work folder and temporary folders together

    @classmethod
    def from_env(cls) -> "Limits":
        def number(name: str, default: int, unit: int = 1) -> int:
            text = os.environ.get(name)
            if text is None:
                return default
            if not text.isdigit() or int(text) < 1:
                raise GradingError(f"{name}={text!r}: give a whole number above zero")
            return int(text) * unit

        return cls(number("COURSE_GRADER_PROCESSES", cls.processes),
                   number("COURSE_GRADER_MEMORY_MB", cls.memory, 2**20),
                   number("COURSE_GRADER_FILE_MB", cls.file, 2**20), number("COURSE_GRADER_DISK_MB", cls.disk, 2**20))


def limit_reason(ename: str, evalue: str, limits: Limits) -> str:
    """What an error means when a sandbox's limit caused it (or ``""``), in the grader's words only: the
    kernel's own text may be the learner's, and may quote the hidden tests' inputs."""
    text = f"{ename}: {evalue}"
    mib = lambda n: f"{n / 2**20:.0f} MiB"  # noqa: E731
    if "MemoryError" in ename or "can't allocate memory" in text or "Cannot allocate memory" in text:
        return f"ran out of memory: the sandbox gives each process {mib(limits.memory)}"
    if "Resource temporarily unavailable" in text or "can't start new thread" in text:
        return f"hit the sandbox's limit of {limits.processes} processes and threads"
    if "No space left on device" in text or "Disk quota exceeded" in text:
        return f"filled the sandbox's {mib(limits.disk)} work folder"
    if "File too large" in text:
        return f"wrote a file past the sandbox's {mib(limits.file)} per file"
    return ""


class Overtime(BaseException):
    """A ``time_limit`` ran out. Not an ``Exception``: a check's ``except Exception`` must not swallow it."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise ``Overtime`` in the block once ``seconds`` of wall-clock time have passed (``SIGALRM``; in the main
    thread only, elsewhere no limit). It stops Python code; one long call into C ends first, which is why the
    decoder bounds its own work and the class's workers have a deadline. An enclosing limit is put back after."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def stop(signum, frame):
        raise Overtime()

    old = signal.signal(signal.SIGALRM, stop)
    outer, _ = signal.setitimer(signal.ITIMER_REAL, seconds)
    start = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        if outer:
            signal.setitimer(signal.ITIMER_REAL, max(1e-3, outer - (time.monotonic() - start)))
