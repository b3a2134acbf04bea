"""A hand-written pipeline executor: one process per stage runs a schedule with send/recv (chapter 07).

``run_stage`` is what one rank does: it walks its stage's op list from
``pipeline.make_schedule`` and, for each op,

- ``("F", i)``: receives micro-batch ``i``'s activation from the previous rank
  (the first stage reads the input instead), runs its layers, keeps the
  autograd graph for the backward, and sends the output to the next rank (the
  last stage computes the loss instead);
- ``("B", i)``: receives the gradient of that output from the next rank (the
  last stage starts from its loss), back-propagates through its layers, which
  adds to the parameters' ``.grad``, and sends the input's gradient back;
- ``("W", i)`` (zero-bubble schedules): the backward is split, ``B`` computes
  only the input's gradient, which the previous rank waits for, and ``W`` the
  weights' gradients later, which nobody waits for;
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
they hold about as many as the stage has micro-batches in flight.

For the bubble measurement each op can be padded to a fixed duration
(``op_seconds``): the real work runs, then the rank waits until the op's time
is up. On the CPU it sleeps, leaving the core to the others like a host that
waits for its GPU, so ``p`` ranks on two shared cores still see equal stage
costs; on a GPU a spin kernel keeps the stream busy (``clock.CudaClock``),
and CUDA events time the ops, since a NCCL receive returns to Python before
its data has arrived. The idle time left is the schedule's bubble plus
messaging delays.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import nn

from course_lib.distributed import comm
from course_lib.distributed.clock import Clock, clock_for
from course_lib.distributed.pipeline import Schedule, check_schedule, num_chunks
from course_lib.distributed.pipeline_messages import (message_batches, op_links,  # noqa: F401 (re-exported)
                                                      peak_sends_held, send_releases)
from course_lib.memory import saved_activation_bytes

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Shape = tuple[tuple[int, ...], torch.dtype]


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


def run_stage(stage: nn.Module | Sequence[nn.Module], schedule: Schedule, rank: int, in_shape: Shape | Sequence[Shape],
              inputs: Sequence[torch.Tensor] | None = None, targets: Sequence[torch.Tensor] | None = None,
              loss_fn: LossFn | None = None, op_seconds: dict[str, float] | None = None,
              device: torch.device | str = "cpu", clock: Clock | None = None,
              weights: Callable[[int], dict[str, torch.Tensor]] | None = None,
              after_backward: Callable[[int], None] | None = None) -> StageRun:
    """Run ``schedule[rank]``, this rank's ops; gradients accumulate in ``stage`` (chapter 07).

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
    """
    world, num_mb, split = check_schedule(schedule)
    order = [tuple(o) for o in schedule[rank]]
    v = num_chunks(schedule)
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
    batches = message_batches(order, rank, world, v)
    releases = send_releases(schedule, rank)
    held: dict[int, tuple[comm.Exchange, torch.Tensor]] = {}   # op k -> its send, tensor kept until it is done
    graphs: dict[tuple[int, int], list] = {}        # (mb, chunk) -> [input, output or loss, bytes, grad]
    marks, pads, outputs, losses = [], [], [], []   # resolved into seconds at the end (on CUDA that syncs)
    alive_bytes = peak_inflight = peak_bytes = peak_held = 0
    outgoing: torch.Tensor | None = None            # what the previous op sends
    traffic = [0, 0]                                # messages and bytes sent
    start = clock.start()

    def post(k: int, buf: torch.Tensor | None) -> comm.Exchange:
        """Batch k: the previous op's send and this op's receive into ``buf``, posted together."""
        nonlocal peak_held
        sends, recvs = batches[k]
        ex = comm.exchange([comm.Message(outgoing, *s) for s in sends], [comm.Message(buf, *r) for r in recvs])
        if sends:
            traffic[0], traffic[1] = traffic[0] + 1, traffic[1] + outgoing.nbytes
            held[k - 1] = (ex, outgoing)
            peak_held = max(peak_held, len(held))
        return ex

    def release(k: int) -> None:
        """Op k's receive is in: free every send that it proves delivered."""
        for j in [j for j in held if releases[j] is not None and releases[j] <= k]:
            held.pop(j)[0].wait()                 # returns at once: the peer has the message

    for k, (op, i, *rest) in enumerate(order):
        c = rest[0] if rest else 0
        vs = c * world + rank
        at_start, at_end = vs == 0, vs == world * v - 1
        if op == "F":
            if at_start:
                post(k, None)
                x = inputs[i].to(device)
            else:                                         # wait (idle) for the previous stage
                shape, dtype = shapes[c]
                x = torch.empty(shape, dtype=dtype, device=device)
                post(k, x).wait_received()
                release(k)
                x.requires_grad_(True)                    # we will send its gradient back
            began = clock.mark()
            holder: list[torch.Tensor] = []
            w = weights(i) if weights else None           # PipeDream: this micro-batch's stashed copy
            run = (lambda: holder.append(torch.func.functional_call(chunks[c], w, (x,)))) if w is not None \
                else (lambda: holder.append(chunks[c](x)))
            nbytes = saved_activation_bytes(run, exclude=params[c] + list((w or {}).values()))
            y = holder[0]
            if at_end:
                loss = loss_fn(y, targets[i].to(device)) / div
                outputs.append(y.detach())
                losses.append(loss.detach())
            graphs[(i, c)] = [x, loss if at_end else y, nbytes, None]
            alive_bytes += nbytes
            peak_inflight, peak_bytes = max(peak_inflight, len(graphs)), max(peak_bytes, alive_bytes)
            outgoing = None if at_end else y.detach().contiguous()
        elif op == "B":
            x, y, nbytes, _ = graphs[(i, c)]
            if at_end:
                post(k, None)
                grad = None                               # y is this micro-batch's loss / m
            else:                                         # wait (idle) for the next stage's gradient
                grad = torch.empty_like(y)
                post(k, grad).wait_received()
                release(k)
            began = clock.mark()
            if not split:                                 # input and weight gradients in one pass
                y.backward(grad)
                graphs.pop((i, c))
                alive_bytes -= nbytes                     # the graph of micro-batch i is freed here
                if after_backward:
                    after_backward(i)
            else:                                         # the input gradient only; keep the graph for W
                graphs[(i, c)][3] = grad
                if not at_start:
                    x.grad, = torch.autograd.grad(y, x, grad, retain_graph=True)
            outgoing = None if at_start else x.grad.contiguous()
        else:                                             # W: the weight gradient, deferred
            post(k, None)
            x, y, nbytes, grad = graphs.pop((i, c))
            began = clock.mark()
            # autograd walks the stage's graph again to reach the weights (the input-gradient chain
            # inside the stage is recomputed; torch's pipelining keeps those intermediate gradients).
            y.backward(grad, inputs=params[c])
            alive_bytes -= nbytes
            outgoing = None
        if op_seconds is not None:                    # the op's time is up before its result leaves
            pads.append(clock.pad(began, op_seconds[op]))
        marks.append((op, i, began, clock.mark(), c))
    post(len(order), None)
    for ex, _ in held.values():
        ex.wait()
    end = clock.mark()
    return StageRun(rank, clock.seconds(start), clock.seconds(end),
                    busy=[(op, i, clock.seconds(b), clock.seconds(e)) for op, i, b, e, _ in marks],
                    busy_chunks=[c for *_, c in marks], peak_inflight=peak_inflight,
                    peak_activation_bytes=peak_bytes, peak_sends_held=peak_held,
                    sent_messages=traffic[0], sent_bytes=traffic[1],
                    overruns=sum(clock.overran(t) for t in pads), outputs=[o.cpu() for o in outputs],
                    losses=[loss.item() * div for loss in losses], clock=clock.name)


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
