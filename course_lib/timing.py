"""How the course times a piece of work: warm-up, repeats, the fastest and the median (chapter 02; used everywhere).

One timing of one call lies in four ways. The **first call** pays for what later calls do not (the allocator grows
its pools, a kernel is chosen or compiled, caches are cold): an untimed warm-up takes that out. **Other processes**
share the cores: repeating the call and keeping the **fastest** gives the least disturbed run, the **median** a
typical one, and the spread (slowest over fastest) how noisy the machine was. Two pieces of work timed one after
the other put a busy moment on one of them: ``in_turns`` times them **in turns** (a, b, a, b, ...). On a **GPU**
the host only queues kernels: CUDA events, stamped by the GPU on the stream, time the work (a host clock needs
``torch.cuda.synchronize()`` before and after).

``time_s`` times one call, ``bench`` one piece of work with warm-up and repeats, ``in_turns`` / ``fastest_times``
several pieces compared (``env.time_s`` is ``time_s``). ``experiments.clock`` is something else: time *stamps* of
the ops inside a multi-process run, for Gantt charts.
"""

from __future__ import annotations

import math
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Mapping

if TYPE_CHECKING:
    import torch

# torch is imported inside the functions: env imports this module, and `course --help` should not load torch.

Clock = Callable[[], float]


@dataclass(frozen=True)
class Timing:
    """Seconds of each timed call of one piece of work, after ``warmup`` untimed calls."""

    seconds: tuple[float, ...]
    warmup: int
    clock: str  # what measured them: "perf_counter", "process_time", "cuda events", ...

    def __post_init__(self) -> None:
        if not self.seconds:
            raise ValueError("a Timing needs at least one timed call")

    @property
    def min_s(self) -> float:
        """The fastest call: the one least disturbed by anything else on the machine."""
        return min(self.seconds)

    @property
    def median_s(self) -> float:
        """A typical call."""
        return statistics.median(self.seconds)

    @property
    def max_s(self) -> float:
        return max(self.seconds)

    @property
    def spread(self) -> float:
        """Slowest over fastest call: 1.0 on a quiet machine, several on a busy one."""
        return self.max_s / self.min_s if self.min_s > 0 else math.inf

    def summary(self, unit: str = "ms") -> str:
        """``min 3.1 ms, median 3.4 ms, max 5.0 ms (1.6x) over 5 calls after 1 warm-up, perf_counter``."""
        scale = {"s": 1.0, "ms": 1e3, "us": 1e6}[unit]
        return (f"min {self.min_s * scale:.3g} {unit}, median {self.median_s * scale:.3g} {unit}, "
                f"max {self.max_s * scale:.3g} {unit} ({self.spread:.2f}x) over {len(self.seconds)} calls "
                f"after {self.warmup} warm-up, {self.clock}")


def _is_cuda(device: "torch.device | str | None") -> bool:
    import torch

    return device is not None and torch.device(device).type == "cuda"


def _clock_name(clock: Clock | None, device: "torch.device | str | None") -> str:
    if clock is None:
        return "cuda events" if _is_cuda(device) else "perf_counter"
    return getattr(clock, "__name__", "custom clock")


def time_s(fn: Callable[[], object], device: "torch.device | str | None" = "cpu", clock: Clock | None = None) -> float:
    """Seconds one call of ``fn()`` takes on ``device`` (no warm-up: see ``bench`` for a fair figure).

    On CUDA with no ``clock``: CUDA events recorded on the current stream around the call, the GPU's time
    (``elapsed_time`` waits for the end event, so the call's work is done when this returns). With a host
    ``clock`` on CUDA (``time.process_time``, say): synchronised before and after, so the clock sees the work.
    On the CPU: ``clock``, by default ``time.perf_counter`` (wall time; ``time.process_time`` counts only the
    CPU time of this process, its work and not its waiting for a core).
    """
    if _is_cuda(device):
        import torch

        if clock is None:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3  # elapsed_time is in milliseconds
        torch.cuda.synchronize(device)
        t0 = clock()
        fn()
        torch.cuda.synchronize(device)
        return clock() - t0
    clock = clock or time.perf_counter
    t0 = clock()
    fn()
    return clock() - t0


@contextmanager
def _threads(n: int | None) -> Iterator[None]:
    """PyTorch's intra-op threads set to ``n`` inside the block (``None``: unchanged), restored afterwards."""
    import torch

    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def in_turns(steps: Mapping[str, Callable[[], object]], repeats: int = 5, warmup: int = 1,
             device: "torch.device | str | None" = "cpu", clock: Clock | None = None,
             threads: int | None = None) -> dict[str, Timing]:
    """Each step warmed up ``warmup`` times, then timed ``repeats`` rounds, every step once per round, in turn.

    Taking turns spreads any slowdown from other processes over all the steps, so ratios of their fastest (or
    median) times are steadier than ratios of steps timed one after the other. ``threads`` runs the steps on
    that many intra-op threads: with ``threads=1`` and ``clock=time.process_time`` the time is one core's work,
    without the time several threads spin waiting for each other. Costs ``(warmup + repeats)`` calls of each.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    if warmup < 0:
        raise ValueError(f"warmup must be 0 or more, got {warmup}")
    if clock is not None and not callable(clock):
        raise TypeError(f"clock must be a function returning seconds (time.perf_counter), got {clock!r}")
    times: dict[str, list[float]] = {name: [] for name in steps}
    with _threads(threads):
        for _ in range(warmup):
            for step in steps.values():
                step()  # first-call allocations and kernel selection are not the step's cost
        for _ in range(repeats):
            for name, step in steps.items():
                times[name].append(time_s(step, device, clock))
    name = _clock_name(clock, device)
    return {k: Timing(tuple(v), warmup, name) for k, v in times.items()}


def bench(fn: Callable[[], object], repeats: int = 5, warmup: int = 1, device: "torch.device | str | None" = "cpu",
          clock: Clock | None = None, threads: int | None = None) -> Timing:
    """``fn`` warmed up ``warmup`` times, then timed ``repeats`` times: its ``Timing`` (min, median, spread)."""
    return in_turns({"fn": fn}, repeats, warmup, device, clock, threads)["fn"]


def fastest_times(steps: Mapping[str, Callable[[], object]], repeats: int = 5, clock: Clock | None = None,
                  threads: int | None = None, device: "torch.device | str | None" = "cpu") -> dict[str, float]:
    """Seconds of the fastest of ``repeats`` runs of each step, run in turns after one warm-up (``in_turns``).

    The fastest run is the one least disturbed, the figure to compare between steps on a shared machine.
    ``clock`` defaults to wall time (CUDA events on a GPU ``device``).
    """
    return {k: t.min_s for k, t in in_turns(steps, repeats, 1, device, clock, threads).items()}
