"""The instruments of chapter 08's pipeline runs, plugged into ``pipeline.executor.run_stage`` through its ``Watch``.

``Meter`` times every op with a clock (``clock``: CUDA events on a GPU, since a NCCL receive returns to Python before
its data has arrived), pads it to a fixed duration (``op_seconds``: the rank sleeps on the CPU, a spin kernel keeps
the stream busy on a GPU, so ``p`` ranks on shared cores still see equal stage costs), counts the activation bytes
each kept graph saved, the sent messages and, with ``count_ops``, every op's ATen ops (``OpCounter``).
``metered_stage`` runs one rank's schedule with a ``Meter`` and returns a ``StageRun``; ``gather_step`` puts every
rank's run together on rank 0 (``Step``: makespan, bubble, per-rank figures), and ``fastest_of`` keeps the least
disturbed of a few tries.
"""

from __future__ import annotations

import collections
import contextlib
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator, Sequence, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode  # no public API counts ATen ops by dispatch

from course_lib.experiments.clock import Clock, clock_for
from course_lib.experiments.results import gather_on_first
from course_lib.memory import _storage_key
from course_lib.parallel.pipeline.executor import LossFn, Shape, Watch, run_stage
from course_lib.parallel.pipeline.schedules import Schedule

T = TypeVar("T")


class OpCounter(TorchDispatchMode):
    """Counts the tensors each ATen op computes while active (``with OpCounter() as c: ...; c.counts``).

    An op that returns several tensors counts once per tensor it computed: a
    layer norm's backward asked for its input gradient only counts 1, asked
    for everything 3, so two calls that split the work add up to one. Views
    (``detach``, ``view``, ``t``, ...: a new header onto the same memory, no
    arithmetic) count only with ``views=True``: autograd takes one each time it
    unpacks a saved tensor through a hook (``Meter`` sets one), so a node that
    runs twice, once in ``B`` and once in ``W``, takes its views twice.
    """

    def __init__(self, views: bool = False) -> None:
        super().__init__()
        self.views = views
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        result = func(*args, **(kwargs or {}))
        if self.views or not func.is_view:
            outs = result if isinstance(result, (tuple, list)) else (result,)
            self.counts[func.overloadpacket.__name__] += sum(isinstance(o, torch.Tensor) for o in outs)
        return result


@dataclass
class StageRun:
    """What one rank measured while running its order of ops (times in seconds of its clock)."""

    rank: int
    start: float                                   # when the rank began (after a barrier)
    end: float                                     # when its last op finished and its last message left
    busy: list[tuple[str, int, float, float]] = field(default_factory=list)  # (op, mb, start, end)
    busy_chunks: list[int] = field(default_factory=list)         # the model chunk of each busy op
    peak_inflight: int = 0                         # most micro-batch graphs kept at once
    peak_activation_bytes: int = 0                 # most saved-activation bytes alive at once
    peak_sends_held: int = 0                       # most sent tensors kept alive at once
    sent_messages: int = 0                         # point-to-point messages this rank sent
    sent_bytes: int = 0                            # and their bytes
    overruns: int = 0                              # ops whose real work took longer than op_seconds
    outputs: list[torch.Tensor] = field(default_factory=list)   # last stage: each micro-batch's output
    losses: list[float] = field(default_factory=list)           # last stage: each micro-batch's loss
    clock: str = "perf_counter"                    # what measured the times
    op_counts: list[dict[str, int]] = field(default_factory=list)  # with count_ops: each busy op's ATen ops


class Meter(Watch):
    """One rank's instruments: op times (padded to ``op_seconds``), activation bytes kept, messages sent.

    A forward's bytes are the storages autograd saves while the stage's ``modules`` run, less their weights:
    chapter 01's ``memory.saved_activation_bytes`` (the last stage's loss left out, as the chapter's prediction
    does). ``count_ops`` slows the ops: for counting runs.
    """

    def __init__(self, clock: Clock, op_seconds: dict[str, float] | None = None, count_ops: bool = False,
                 modules: Sequence[nn.Module] = ()):
        self.clock, self.op_seconds, self.count_ops = clock, op_seconds, count_ops
        self.modules, self.handles, self.counting = list(modules), [], False
        self.excluded = {_storage_key(p) for mod in self.modules for p in mod.parameters()}
        self.marks: list[tuple[str, int, object, object, int]] = []   # (op, mb, began, ended, chunk), clock marks
        self.pads: list[object] = []                # resolved into overruns at the end (on CUDA that syncs)
        self.op_counts: list[dict[str, int]] = []
        self.start = self.end = None
        self.saved: dict[int, int] = {}             # the op running now: storage -> bytes autograd saved
        self.graph_bytes: dict[tuple[int, int], int] = {}
        self.alive_bytes = self.peak_bytes = self.peak_inflight = 0
        self.peak_held = self.messages = self.bytes_sent = 0

    def begin(self) -> None:
        for mod in self.modules:                    # count only while a stage module runs
            self.handles += [mod.register_forward_pre_hook(lambda *_: setattr(self, "counting", True)),
                             mod.register_forward_hook(lambda *_: setattr(self, "counting", False))]
        self.start = self.clock.start()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if self.counting and key not in self.excluded:
            self.saved[key] = t.untyped_storage().nbytes()
        return t

    @contextlib.contextmanager
    def op(self, kind: str, i: int, c: int) -> Iterator[None]:
        """Time the block as op ``kind`` of micro-batch ``i`` on chunk ``c``; pad it before its result leaves."""
        began = self.clock.mark()
        self.saved = {}
        counter = OpCounter() if self.count_ops else None
        with counter if counter is not None else contextlib.nullcontext(), \
                torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            yield
        if counter is not None:
            self.op_counts.append(dict(counter.counts))
        if self.op_seconds is not None:
            self.pads.append(self.clock.pad(began, self.op_seconds[kind]))
        self.marks.append((kind, i, began, self.clock.mark(), c))

    def kept(self, i: int, c: int, inflight: int) -> None:
        self.graph_bytes[(i, c)] = nbytes = sum(self.saved.values())
        self.alive_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.alive_bytes)
        self.peak_inflight = max(self.peak_inflight, inflight)

    def freed(self, i: int, c: int) -> None:
        self.alive_bytes -= self.graph_bytes.pop((i, c))

    def sent(self, nbytes: int, held: int) -> None:
        self.messages, self.bytes_sent = self.messages + 1, self.bytes_sent + nbytes
        self.peak_held = max(self.peak_held, held)

    def finish(self) -> None:
        self.end = self.clock.mark()
        for h in self.handles:
            h.remove()

    def result(self, rank: int, outputs: list[torch.Tensor], losses: list[float]) -> StageRun:
        sec = self.clock.seconds
        return StageRun(rank, sec(self.start), sec(self.end),
                        busy=[(op, i, sec(b), sec(e)) for op, i, b, e, _ in self.marks],
                        busy_chunks=[c for *_, c in self.marks], peak_inflight=self.peak_inflight,
                        peak_activation_bytes=self.peak_bytes, peak_sends_held=self.peak_held,
                        sent_messages=self.messages, sent_bytes=self.bytes_sent,
                        overruns=sum(self.clock.overran(t) for t in self.pads), outputs=outputs, losses=losses,
                        clock=self.clock.name, op_counts=self.op_counts)


def metered_stage(stage: nn.Module | Sequence[nn.Module], schedule: Schedule, rank: int,
                  in_shape: Shape | Sequence[Shape], inputs: Sequence[torch.Tensor] | None = None,
                  targets: Sequence[torch.Tensor] | None = None, loss_fn: LossFn | None = None,
                  op_seconds: dict[str, float] | None = None, device: torch.device | str = "cpu",
                  clock: Clock | None = None, count_ops: bool = False,
                  ranks: Sequence[int] | None = None) -> StageRun:
    """``executor.run_stage`` with a ``Meter``: its ops timed with ``clock`` (default ``clock_for(device)``; make it
    before the barrier that starts the ranks together), padded to ``op_seconds``, their ATen ops counted
    (``count_ops``)."""
    meter = Meter(clock or clock_for(device), op_seconds, count_ops,
                  modules=list(stage) if isinstance(stage, (list, tuple)) else [stage])
    outputs, losses = run_stage(stage, schedule, rank, in_shape, inputs, targets, loss_fn, device, ranks, meter)
    return meter.result(rank, outputs, losses)


def grad_diff(mods: list[nn.Module], refs: list[nn.Module]) -> float:
    """The largest gradient difference of pipeline stages ``mods`` from the sequential model's ``refs`` (frozen
    parameters, with no reference gradient, left out)."""
    return max([(p.grad.cpu() - r.grad).abs().max().item() for mod, ref in zip(mods, refs)
                for p, r in zip(mod.parameters(), ref.parameters()) if r.grad is not None], default=0.0)


def measured_bubble(runs: Sequence[StageRun]) -> dict[str, float]:
    """Makespan and idle share of a real run, from every rank's busy intervals.

    The ranks' times must be comparable: on the CPU, ranks on one machine read
    one system-wide monotonic clock; on GPUs, each rank's CUDA events count
    from its own start, taken right after a common barrier. (Across machines
    CPU clocks differ; each rank would have to measure its own idle share.)
    """
    start = min(r.start for r in runs)
    makespan = max(r.end for r in runs) - start
    busy = [sum(t[3] - t[2] for t in r.busy) for r in runs]
    return {"makespan": makespan, "bubble_fraction": 1.0 - sum(busy) / (len(runs) * makespan),
            "busy": busy}


@dataclass
class Step:
    """One step of every rank, seen from rank 0 (``gather_step``); times in seconds from the common start."""

    runs: list[StageRun]                           # per rank, in rank order (outputs left on their rank)
    checks: list[dict]                             # per rank: what it measured beside its run
    makespan_s: float
    bubble: float                                  # idle share of the ranks' time (``measured_bubble``)
    busy_s: list[float]                            # per rank
    timings: list[tuple[int, str, int, float, float]]  # every busy op: (stage, op, micro-batch, start, end)

    def each(self, name: str) -> list:
        """Per rank: a check gathered with the run, or else a ``StageRun`` field."""
        return [c[name] if name in c else getattr(r, name) for r, c in zip(self.runs, self.checks)]

    def total(self, name: str) -> float:
        return sum(self.each(name))


def gather_step(run: StageRun, **checks: object) -> Step | None:
    """Every rank's ``run`` and ``checks`` (small values) on rank 0, as one ``Step``; ``None`` on the others."""
    got = gather_on_first((replace(run, outputs=[]), checks))
    if got is None:
        return None
    runs = [r for r, _ in got]
    meas, t0 = measured_bubble(runs), min(r.start for r in runs)
    return Step(runs, [c for _, c in got], meas["makespan"], meas["bubble_fraction"], meas["busy"],
                [(r.rank, op, i, b - t0, e - t0) for r in runs for op, i, b, e in r.busy])


def fastest_of(repeats: int, attempt: Callable[[], tuple[dict[str, float], Callable[[], T]]], device: torch.device,
               end: str = "end") -> T:
    """Run ``attempt`` ``repeats`` times on every rank and keep the fastest step: what its ``keep`` returned.

    ``attempt()`` runs one step and returns this rank's ``{"start": s, end: e}`` seconds and ``keep``, called
    only when the step is the fastest so far (it reads what the next attempt overwrites, the gradients).
    Rank 0 measures the span (the last ``end`` minus the first start) and broadcasts it, so that every rank
    keeps the same attempt.
    """
    best: tuple[float, T] | None = None
    for _ in range(repeats):
        times, keep = attempt()
        runs = gather_on_first(times)
        span = torch.tensor([0.0 if runs is None else max(r[end] for r in runs) - min(r["start"] for r in runs)],
                            device=device)  # on the group's device: NCCL broadcasts CUDA tensors only
        dist.broadcast(span, 0)
        if best is None or span.item() < best[0]:
            best = (span.item(), keep())
    assert best is not None, "repeats must be at least 1"
    return best[1]
