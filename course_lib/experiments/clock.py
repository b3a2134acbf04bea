"""Clocks for timing work on the CPU or on a GPU (chapters 07-08).

GPU work is asynchronous: a CUDA kernel, and on NCCL a ``recv`` too, returns
to Python before the GPU has done anything, so ``time.perf_counter`` measures
when work was *queued*. ``CudaClock`` records CUDA events on the stream
instead, which the GPU stamps when it reaches them. Both clocks have the same
three calls, so a worker times its steps the same way on either device::

    clock = clock_for(device)
    a = clock.mark(); step(); b = clock.mark()
    seconds = clock.elapsed(a, b)

``pad(began, seconds)`` stretches an op to a fixed duration (chapter 08's
equal stage costs): the CPU clock sleeps, the CUDA clock keeps the stream
busy with a spin kernel that starts with the op, so the op lasts
max(its work, ``seconds``) on the GPU's own timeline, with no synchronisation.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Protocol

import torch

# GPU cycles of the calibration spin: about 25 ms at a 2 GHz SM clock, long next to the event resolution (~0.5 us).
CALIBRATION_CYCLES = 50_000_000


class Clock(Protocol):
    name: str

    def mark(self) -> Any: ...
    def elapsed(self, a: Any, b: Any) -> float: ...
    def start(self) -> Any: ...
    def seconds(self, mark: Any) -> float: ...
    def pad(self, began: Any, seconds: float) -> Any: ...
    def overran(self, token: Any) -> bool: ...


class CpuClock:
    """``time.perf_counter``: one monotonic clock for every process on a machine."""

    name = "perf_counter"

    def mark(self) -> float:
        return time.perf_counter()

    def elapsed(self, a: float, b: float) -> float:
        return b - a

    def start(self) -> float:
        return self.mark()

    def seconds(self, mark: float) -> float:
        """Seconds on the machine's clock, comparable between the ranks of one machine."""
        return mark

    def pad(self, began: float, seconds: float) -> bool:
        """Sleep until ``seconds`` after ``began``; the token says whether the work alone took longer."""
        remaining = began + seconds - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)  # a sleeping rank leaves the core to the others, like a host waiting for its GPU
        return remaining <= 0

    def overran(self, token: bool) -> bool:
        return token


class CudaClock:
    """CUDA events on the current stream of ``device``: a mark is when the GPU gets there."""

    name = "cuda events"

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self._zero: torch.cuda.Event | None = None
        self._side = torch.cuda.Stream(self.device)  # where the padding spins, beside the op's own work
        self.cycles_per_s = self._calibrate()

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def elapsed(self, a: torch.cuda.Event, b: torch.cuda.Event) -> float:
        b.synchronize()  # waits for the GPU to reach b (only when the result is read)
        return a.elapsed_time(b) / 1e3

    def start(self) -> torch.cuda.Event:
        """Mark time zero of ``seconds`` (ranks that call it right after a barrier share it)."""
        self._zero = self.mark()
        return self._zero

    def seconds(self, mark: torch.cuda.Event) -> float:
        if self._zero is None:
            raise RuntimeError("CudaClock.seconds needs a time zero: call start() first")
        return self.elapsed(self._zero, mark)

    def pad(self, began: torch.cuda.Event, seconds: float) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        """Keep the stream busy until ``seconds`` after ``began``; the token resolves to 'the work took longer'."""
        work_end = self.mark()
        self._side.wait_event(began)
        with torch.cuda.stream(self._side):
            # _sleep spins for a number of GPU cycles: the test suite's tool for a kernel of known length
            torch.cuda._sleep(int(seconds * self.cycles_per_s))
            pad_end = torch.cuda.Event(enable_timing=True)
            pad_end.record(self._side)
        torch.cuda.current_stream(self.device).wait_stream(self._side)
        return work_end, pad_end

    def overran(self, token: tuple[torch.cuda.Event, torch.cuda.Event]) -> bool:
        work_end, pad_end = token
        return self.elapsed(pad_end, work_end) > 0  # the work ended after the padding did

    def _calibrate(self) -> float:
        """GPU cycles per second of ``torch.cuda._sleep`` (the SM clock), measured once."""
        with torch.cuda.device(self.device):
            torch.cuda._sleep(1000)  # the first launch pays for loading the kernel
            a = self.mark()
            torch.cuda._sleep(CALIBRATION_CYCLES)
            b = self.mark()
        return CALIBRATION_CYCLES / self.elapsed(a, b)


def clock_for(device: torch.device | str) -> Clock:
    """``CudaClock`` for a CUDA device, ``CpuClock`` otherwise."""
    return CudaClock(device) if torch.device(device).type == "cuda" else CpuClock()


def slowest_rank_s(fn: Callable[[], object], clock: Clock, device: torch.device | str) -> tuple[float, float]:
    """Seconds ``fn()`` takes when every rank starts it together, as slow as the slowest rank; and this rank's
    CPU seconds of it (``time.process_time``). A collective: every rank calls it."""
    import torch.distributed as dist

    from course_lib.experiments.results import max_over_ranks

    dist.barrier()  # start together, so one rank's time does not include waiting for another's
    start, cpu_start = clock.mark(), time.process_time()
    fn()
    seconds = clock.elapsed(start, clock.mark())
    cpu = time.process_time() - cpu_start
    return max_over_ranks(seconds, device), cpu  # a step is as slow as its slowest rank
