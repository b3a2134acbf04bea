"""A hand-written pipeline executor: one process per stage runs a schedule with send/recv (chapter 08).

``run_stage`` is what one rank does: it walks its stage's op list from
``pipeline.make_schedule`` and, for each op,

- ``("F", i)``: receives micro-batch ``i``'s activation from the previous rank
  (the first stage reads the input instead), runs its layers, keeps the
  autograd graph for the backward, and sends the output to the next rank (the
  last stage computes the loss instead);
- ``("B", i)``: receives the gradient of that output from the next rank (the
  last stage starts from its loss), back-propagates through its layers, which
  adds to the parameters' ``.grad``, and sends the input's gradient back;
- ``("W", i)`` (zero-bubble schedules): the backward is split
  (``pipeline_split``): ``B`` computes only the activations' gradients, down
  to the input's, which the previous rank waits for, and keeps the gradient
  at each op that uses a weight; ``W`` later computes from those only the
  weights' gradients, which nobody waits for. No op runs in both;
- ``("F", i, c)`` (interleaved schedules): the same on the rank's model chunk
  ``c``; chunk ``c`` of rank ``d`` is virtual stage ``c p + d``, so messages
  go round the ranks ``v`` times (rank ``p - 1`` sends on to rank 0).

Between two ops a rank posts one batch of messages (``message_batches``,
``comm.exchange``): the send of the op just finished and the receive of the
next one. It waits only for the receive: a rank only ever waits for data it
needs, and its sends complete in the background, so a schedule that the
simulator can play cannot deadlock here. Batching matters on NCCL, where a
send waits for its receiver: in 1F1B two neighbours each send to the other
and then receive from it, which hangs as separate calls and runs as one
group. Activations flow only forward and gradients only backward between two
neighbours, and both run their micro-batches in the same order, so messages
pair up in order (all NCCL looks at); the tag (micro-batch, direction, chunk)
makes the pairing explicit for gloo.

A sent tensor must stay alive until its message has left, and a gloo send
only completes once the peer has posted its receive. The rank frees it as
soon as it *knows* that: when a message arrives from that peer which the peer
sent after taking ours (``pipeline_messages.send_releases``). Kept until the end of the step,
the sends of a 1F1B stage would hold all ``m`` boundary tensors; released,
they hold at most ``min(p - s + 1, m)`` on stage ``s`` (stage 0: ``min(p, m)``).

The execution and its instruments are apart: the loop runs the ops on
``MicroBatch`` records (one per micro-batch in flight) and calls a ``Meter``
around each op, which times it, pads it and counts the memory kept. For the
bubble measurement each op can be padded to a fixed duration
(``op_seconds``): the real work runs, then the rank waits until the op's time
is up. On the CPU it sleeps, leaving the core to the others like a host that
waits for its GPU, so ``p`` ranks on two shared cores still see equal stage
costs; on a GPU a spin kernel keeps the stream busy (``clock.CudaClock``),
and CUDA events time the ops, since a NCCL receive returns to Python before
its data has arrived. The idle time left is the schedule's bubble plus
messaging delays. Without ``op_seconds`` the ops take what their work takes.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator, Sequence, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from course_lib.parallel import collectives as comm
from course_lib.experiments.clock import Clock, clock_for
from course_lib.parallel.pipeline.schedules import Schedule, check_schedule, frozen_prefix, num_chunks
from course_lib.parallel.pipeline.messages import (message_batches, op_links,  # noqa: F401 (re-exported)
                                                      peak_sends_held, send_releases)
from course_lib.parallel.pipeline.split_backward import (OpCounter, WeightGrads, backward_input, backward_weight,
                                                   recording_activations)
from course_lib.experiments.results import gather_on_first
from course_lib.memory import saved_activation_bytes

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Shape = tuple[tuple[int, ...], torch.dtype]
T = TypeVar("T")


def split_sequential(model: nn.Sequential, num_stages: int) -> list[nn.Sequential]:
    """Cut ``model`` into ``num_stages`` consecutive pieces with as equal numbers of modules as possible.

    The pieces share the model's modules (no copy). Real systems balance by
    measured time or memory per layer; equal counts suit a stack of equal blocks.
    """
    layers = list(model)
    if not 1 <= num_stages <= len(layers):
        raise ValueError(f"cannot cut {len(layers)} modules into {num_stages} stages: "
                         f"choose 1 <= num_stages <= {len(layers)} (or give the model more layers)")
    base, extra = divmod(len(layers), num_stages)
    pieces, start = [], 0
    for s in range(num_stages):
        size = base + (1 if s < extra else 0)          # the first stages take one more
        pieces.append(nn.Sequential(*layers[start:start + size]))
        start += size
    return pieces


def micro_batches(x: torch.Tensor, m: int) -> list[torch.Tensor]:
    """``x`` cut into ``m`` micro-batches, separate tensors as a data loader hands them out (not views of ``x``)."""
    return [c.clone() for c in x.chunk(m)]


@torch.no_grad()
def boundary_shapes(stages: Sequence[nn.Module], sample: torch.Tensor) -> list[Shape]:
    """Shape and dtype of the tensor that enters each stage, for one micro-batch ``sample``.

    A rank must allocate its receive buffer before the data arrives, so every
    rank computes these once from the whole model (cheap next to a training step).
    """
    shapes, x = [], sample
    for stage in stages:
        shapes.append((tuple(x.shape), x.dtype))
        x = stage(x)
    return shapes


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


@dataclass
class MicroBatch:
    """One micro-batch on one model chunk, from its forward until its backward has freed its graph."""

    x: torch.Tensor                                # what entered the chunk (its gradient goes back)
    out: torch.Tensor                              # what left it; on the last virtual stage its loss / m
    nbytes: int                                    # the activation bytes its forward saved
    activations: set = field(default_factory=set)  # split backward: the forward's activation nodes, for B
    weight_grads: WeightGrads | None = None        # split backward: what B left for W


class Meter:
    """The instruments of one rank: op times (padded to ``op_seconds``), memory kept, messages sent.

    The execution calls it and reads nothing back from it. ``count_ops``
    counts the ATen ops of every op (``pipeline_split.OpCounter``), which slows
    them: for counting runs, not for timed ones.
    """

    def __init__(self, clock: Clock, op_seconds: dict[str, float] | None = None, count_ops: bool = False):
        self.clock, self.op_seconds, self.count_ops = clock, op_seconds, count_ops
        self.marks: list[tuple[str, int, object, object, int]] = []   # (op, mb, began, ended, chunk), clock marks
        self.pads: list[object] = []                # resolved into overruns at the end (on CUDA that syncs)
        self.op_counts: list[dict[str, int]] = []
        self.alive_bytes = self.peak_bytes = self.peak_inflight = 0
        self.peak_held = self.messages = self.bytes_sent = 0

    @contextlib.contextmanager
    def op(self, kind: str, i: int, c: int) -> Iterator[None]:
        """Time the block as op ``kind`` of micro-batch ``i`` on chunk ``c``; pad it before its result leaves."""
        began = self.clock.mark()
        counter = OpCounter() if self.count_ops else None
        with counter if counter is not None else contextlib.nullcontext():
            yield
        if counter is not None:
            self.op_counts.append(dict(counter.counts))
        if self.op_seconds is not None:
            self.pads.append(self.clock.pad(began, self.op_seconds[kind]))
        self.marks.append((kind, i, began, self.clock.mark(), c))

    def kept(self, nbytes: int, inflight: int) -> None:
        """A forward kept a graph of ``nbytes`` saved activations; ``inflight`` graphs are kept now."""
        self.alive_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.alive_bytes)
        self.peak_inflight = max(self.peak_inflight, inflight)

    def freed(self, nbytes: int) -> None:
        self.alive_bytes -= nbytes

    def sent(self, nbytes: int, held: int) -> None:
        """A message of ``nbytes`` left; ``held`` sent tensors are kept alive now."""
        self.messages, self.bytes_sent = self.messages + 1, self.bytes_sent + nbytes
        self.peak_held = max(self.peak_held, held)

    def result(self, rank: int, start: object, end: object, outputs: list[torch.Tensor],
               losses: list[float]) -> StageRun:
        sec = self.clock.seconds
        return StageRun(rank, sec(start), sec(end), busy=[(op, i, sec(b), sec(e)) for op, i, b, e, _ in self.marks],
                        busy_chunks=[c for *_, c in self.marks], peak_inflight=self.peak_inflight,
                        peak_activation_bytes=self.peak_bytes, peak_sends_held=self.peak_held,
                        sent_messages=self.messages, sent_bytes=self.bytes_sent,
                        overruns=sum(self.clock.overran(t) for t in self.pads), outputs=outputs, losses=losses,
                        clock=self.clock.name, op_counts=self.op_counts)


class Mailbox:
    """One rank's messages: batch ``k`` (op ``k - 1``'s send, op ``k``'s receive) posted between two ops.

    It keeps each sent tensor until a later receive proves that the peer has
    it (``send_releases``), and reports what it sends to the meter.
    """

    def __init__(self, schedule: Schedule, rank: int, meter: Meter, ranks: Sequence[int] | None = None):
        world, v = len(schedule), num_chunks(schedule)
        self.batches = message_batches([tuple(o) for o in schedule[rank]], rank, world, v, frozen_prefix(schedule))
        self.ranks = list(ranks) if ranks is not None else list(range(world))   # stage -> process rank
        self.releases = send_releases(schedule, rank)
        self.held: dict[int, tuple[comm.Exchange, torch.Tensor]] = {}   # op -> its send, tensor kept until done
        self.meter = meter

    def exchange(self, k: int, outgoing: torch.Tensor | None, into: torch.Tensor | None = None) -> None:
        """Post batch ``k``: ``outgoing`` (op ``k - 1``'s result) and op ``k``'s receive into ``into``.

        Waits for the receive only (the rank idles here); the send completes in the background.
        """
        sends, recvs = self.batches[k]
        ex = comm.exchange([comm.Message(outgoing, self.ranks[q], tag) for q, tag in sends],
                           [comm.Message(into, self.ranks[q], tag) for q, tag in recvs])
        if sends:
            self.held[k - 1] = (ex, outgoing)
            self.meter.sent(outgoing.nbytes, len(self.held))
        if recvs:
            ex.wait_received()
            for j in [j for j in self.held if self.releases[j] is not None and self.releases[j] <= k]:
                self.held.pop(j)[0].wait()        # returns at once: the peer has the message

    def finish(self) -> None:
        """Wait until every send still held has left."""
        for ex, _ in self.held.values():
            ex.wait()


def run_stage(stage: nn.Module | Sequence[nn.Module], schedule: Schedule, rank: int, in_shape: Shape | Sequence[Shape],
              inputs: Sequence[torch.Tensor] | None = None, targets: Sequence[torch.Tensor] | None = None,
              loss_fn: LossFn | None = None, op_seconds: dict[str, float] | None = None,
              device: torch.device | str = "cpu", clock: Clock | None = None,
              weights: Callable[[int], dict[str, torch.Tensor]] | None = None,
              after_backward: Callable[[int], None] | None = None, count_ops: bool = False,
              ranks: Sequence[int] | None = None) -> StageRun:
    """Run ``schedule[rank]``, this rank's ops; gradients accumulate in ``stage`` (chapter 08).

    ``stage`` is this rank's module, or its ``v`` chunks for an interleaved
    schedule (``in_shape`` then one per chunk). ``inputs`` (rank 0) and
    ``targets`` with ``loss_fn`` (rank ``p - 1``) hold one tensor per
    micro-batch. Each micro-batch's loss is divided by their number, so the
    summed gradients equal those of the mean loss over the whole batch (not
    with ``after_backward``, where each micro-batch makes a step of its own).
    ``op_seconds`` pads each op to a fixed time. ``clock`` times the ops
    (default ``clock_for(device)``: CUDA events on a GPU); make it before the
    barrier that starts the ranks together. PipeDream (``pipedream``) hooks in
    with ``weights(i)`` (the parameters micro-batch ``i``'s forward runs on:
    a stashed copy) and ``after_backward(i)`` (apply its gradient, step).
    ``count_ops`` records each op's ATen ops in ``StageRun.op_counts``.
    A frozen prefix (``pipeline.frozen_prefix``: its stages' orders hold
    forwards only, ``pipeline_freeze``) runs its forwards without a graph and
    keeps nothing; the first trainable stage asks no gradient of its input and
    sends none back. ``ranks`` names the process rank of each stage (default
    ``0..p-1``): several pipelines, data-parallel replicas, can share one group.
    """
    world, num_mb, split = check_schedule(schedule)
    v, frozen = num_chunks(schedule), frozen_prefix(schedule)
    if ranks is not None and len(ranks) != world:
        raise ValueError(f"ranks names the process of each of the {world} stages; got {list(ranks)}")
    chunks = list(stage) if isinstance(stage, (list, tuple)) else [stage]
    shapes = list(in_shape) if v > 1 else [in_shape]
    if len(chunks) != v or len(shapes) != v:
        raise ValueError(f"the schedule has {v} model chunks per rank: pass {v} modules and {v} input shapes")
    if v > 1 and world < 2:
        raise ValueError("interleaving needs at least 2 ranks (a micro-batch goes round them v times)")
    if (weights or after_backward) and (v > 1 or split):
        raise ValueError("weight stashing and per-micro-batch updates run on plain 1F1B orders (one chunk, no W)")
    first, last = rank == 0, rank == world - 1
    # one step per micro-batch (PipeDream): its own mean loss; else the batch's mean over micro-batches
    div = 1 if after_backward else num_mb
    if first and (inputs is None or len(inputs) != num_mb):
        raise ValueError(f"the first stage needs one input per micro-batch ({num_mb})")
    if last and (targets is None or loss_fn is None or len(targets) != num_mb):
        raise ValueError(f"the last stage needs loss_fn and one target per micro-batch ({num_mb})")
    clock = clock or clock_for(device)
    params = [list(ch.parameters()) for ch in chunks]
    meter = Meter(clock, op_seconds, count_ops)
    mail = Mailbox(schedule, rank, meter, ranks)
    inflight: dict[tuple[int, int], MicroBatch] = {}   # (micro-batch, chunk) -> its record until freed
    outputs: list[torch.Tensor] = []
    losses: list[torch.Tensor] = []
    outgoing: torch.Tensor | None = None              # what the op just run sends
    start = clock.start()

    def forward(i: int, c: int, x: torch.Tensor, at_end: bool) -> MicroBatch:
        """Run chunk ``c`` on ``x``, keeping its graph; the last virtual stage turns the output into the loss."""
        held: list[torch.Tensor] = []
        w = weights(i) if weights else None           # PipeDream: this micro-batch's stashed copy
        run = (lambda: held.append(torch.func.functional_call(chunks[c], w, (x,)))) if w is not None \
            else (lambda: held.append(chunks[c](x)))
        with recording_activations(chunks[c]) if split else contextlib.nullcontext(set()) as activations:
            nbytes = saved_activation_bytes(run, exclude=params[c] + list((w or {}).values()))
        y = held[0]
        if not at_end:
            return MicroBatch(x, y, nbytes, activations)
        loss = loss_fn(y, targets[i].to(device)) / div
        outputs.append(y.detach())
        losses.append(loss.detach())
        return MicroBatch(x, loss, nbytes, activations)

    for k, op in enumerate(schedule[rank]):
        kind, i, c = op[0], op[1], (op[2] if len(op) == 3 else 0)
        vs = c * world + rank
        at_start, at_end = vs == 0, vs == world * v - 1
        if kind == "F":
            if at_start:
                mail.exchange(k, outgoing)
                x = inputs[i].to(device)
            else:                                     # wait (idle) for the previous stage
                shape, dtype = shapes[c]
                x = torch.empty(shape, dtype=dtype, device=device)
                mail.exchange(k, outgoing, into=x)
                x.requires_grad_(vs > frozen)         # we will send its gradient back (not to a frozen stage)
            if rank < frozen:                         # frozen: no graph, nothing kept, nothing comes back
                with meter.op(kind, i, c), torch.no_grad():
                    outgoing = chunks[c](x).contiguous()
                continue
            with meter.op(kind, i, c):
                mb = inflight[(i, c)] = forward(i, c, x, at_end)
                meter.kept(mb.nbytes, len(inflight))
                outgoing = None if at_end else mb.out.detach().contiguous()
        elif kind == "B":
            mb = inflight[(i, c)]
            grad = None if at_end else torch.empty_like(mb.out)   # None: the loss starts the backward
            mail.exchange(k, outgoing, into=grad)     # wait (idle) for the next stage's gradient
            with meter.op(kind, i, c):
                if split:                             # activations' gradients only; the graph stays for W
                    dx, mb.weight_grads = backward_input(mb.out, grad, mb.x, mb.activations, params[c])
                    mb.activations = set()
                else:                                 # input and weight gradients in one pass
                    mb.out.backward(grad)
                    dx = mb.x.grad
                    del inflight[(i, c)]              # the graph of micro-batch i is freed here
                    meter.freed(mb.nbytes)
                    if after_backward:
                        after_backward(i)
                outgoing = None if vs <= frozen else dx.contiguous()
        else:                                         # W: the weights' gradients, from what B kept
            mail.exchange(k, outgoing)
            mb = inflight.pop((i, c))
            with meter.op(kind, i, c):
                backward_weight(mb.weight_grads)
                meter.freed(mb.nbytes)
            outgoing = None
    mail.exchange(len(schedule[rank]), outgoing)
    mail.finish()
    end = clock.mark()
    return meter.result(rank, start, end, [o.cpu() for o in outputs], [loss.item() * div for loss in losses])


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
