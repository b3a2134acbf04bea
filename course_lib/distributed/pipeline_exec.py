"""A hand-written pipeline executor: one process per stage runs a schedule with send/recv (chapter 07).

``run_stage`` is what one rank does: it walks its stage's op list from
``pipeline.make_schedule`` and, for each op,

- ``("F", i)``: receives micro-batch ``i``'s activation from the previous rank
  (the first stage reads the input instead), runs its layers, keeps the
  autograd graph for the backward, and sends the output to the next rank (the
  last stage computes the loss instead);
- ``("B", i)``: receives the gradient of that output from the next rank (the
  last stage starts from its loss), back-propagates through its layers, which
  adds to the parameters' ``.grad``, and sends the input's gradient back.

Between two ops a rank posts one batch of messages (``message_batches``,
``comm.exchange``): the send of the op just finished and the receive of the
next one. It waits only for the receive: a rank only ever waits for data it
needs, and its sends complete in the background, so a schedule that the
simulator can play cannot deadlock here. Batching matters on NCCL, where a
send waits for its receiver: in 1F1B two neighbours each send to the other
and then receive from it, which hangs as separate calls and runs as one
group. Activations flow only forward and gradients only backward between two
neighbours, and both run their micro-batches in the same order, so messages
pair up in order (all NCCL looks at); the tag (micro-batch, direction) makes
the pairing explicit for gloo.

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
from course_lib.memory import saved_activation_bytes

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


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
def boundary_shapes(stages: Sequence[nn.Module], sample: torch.Tensor) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of the tensor that enters each stage, for one micro-batch ``sample``.

    A rank must allocate its receive buffer before the data arrives, so every
    rank computes these once from the whole model (cheap next to a training step).
    """
    shapes, x = [], sample
    for stage in stages:
        shapes.append((tuple(x.shape), x.dtype))
        x = stage(x)
    return shapes


def _tag(microbatch: int, backward: bool) -> int:
    return 2 * microbatch + int(backward)


Link = tuple[int, int]  # (peer rank, tag) of one message


def op_links(op: tuple[str, int], rank: int, world: int) -> tuple[Link | None, Link | None]:
    """What one op receives before it runs and sends after: ``(recv, send)``, ``None`` where it has none."""
    kind, i = op
    prev, nxt = (rank - 1, _tag(i, kind == "B")), (rank + 1, _tag(i, kind == "B"))
    if kind == "F":                     # activations flow forward
        return (None if rank == 0 else prev), (None if rank == world - 1 else nxt)
    return (None if rank == world - 1 else nxt), (None if rank == 0 else prev)   # gradients flow back


def message_batches(order: Sequence[tuple[str, int]], rank: int, world: int) -> list[tuple[list[Link], list[Link]]]:
    """The ``(sends, recvs)`` a rank posts together between ops: batch ``k`` runs before op ``k``.

    Batch ``k`` holds op ``k-1``'s send and op ``k``'s receive; the last one
    (``k = len(order)``) only the last op's send. One batch is one
    ``dist.batch_isend_irecv``: in 1F1B's steady state a rank sends an
    activation to the next rank and receives a gradient from it, and NCCL
    runs such a pair only as one group (posted one by one, both ranks would
    sit in their send). The sends leave exactly when they did one by one.
    """
    links = [op_links(op, rank, world) for op in order]
    batches = []
    for k in range(len(order) + 1):
        send = links[k - 1][1] if k > 0 else None
        recv = links[k][0] if k < len(order) else None
        batches.append(([send] if send else [], [recv] if recv else []))
    return batches


@dataclass
class StageRun:
    """What one rank measured while running its order of ops (times in seconds of its clock)."""

    rank: int
    start: float                                   # when the rank began (after a barrier)
    end: float                                     # when its last op finished and its last message left
    busy: list[tuple[str, int, float, float]] = field(default_factory=list)  # (op, mb, start, end)
    peak_inflight: int = 0                         # most micro-batches whose graph was kept at once
    peak_activation_bytes: int = 0                 # most saved-activation bytes alive at once
    overruns: int = 0                              # ops whose real work took longer than op_seconds
    outputs: list[torch.Tensor] = field(default_factory=list)   # last stage: each micro-batch's output
    losses: list[float] = field(default_factory=list)           # last stage: each micro-batch's loss
    clock: str = "perf_counter"                    # what measured the times


def run_stage(stage: nn.Module, order: Sequence[tuple[str, int]], rank: int, world: int,
              in_shape: tuple[tuple[int, ...], torch.dtype], inputs: Sequence[torch.Tensor] | None = None,
              targets: Sequence[torch.Tensor] | None = None, loss_fn: LossFn | None = None,
              op_seconds: dict[str, float] | None = None, device: torch.device | str = "cpu",
              clock: Clock | None = None) -> StageRun:
    """Run one stage's ``order`` of ``("F" | "B", micro-batch)`` ops; gradients accumulate in ``stage``.

    ``inputs`` (first stage) and ``targets`` with ``loss_fn`` (last stage) are
    lists with one tensor per micro-batch. The loss of each micro-batch is
    divided by their number, so the summed gradients equal those of the mean
    loss over the whole batch. ``op_seconds`` pads each op to a fixed time.
    ``clock`` times the ops (default ``clock_for(device)``: CUDA events on a
    GPU); make it before the barrier that starts the ranks together.
    """
    if any(len(o) != 2 or o[0] not in ("F", "B") for o in order):
        raise ValueError("this executor runs GPipe and 1F1B orders, one model chunk per device: (op, micro-batch) "
                         "pairs with op 'F' or 'B'. Interleaved and zero-bubble schedules are simulated only "
                         "(pipeline.simulate); torch.distributed.pipelining runs them (ScheduleInterleaved1F1B).")
    first, last = rank == 0, rank == world - 1
    num_mb = len({i for _, i in order})
    if first and (inputs is None or len(inputs) != num_mb):
        raise ValueError(f"the first stage needs one input per micro-batch ({num_mb})")
    if last and (targets is None or loss_fn is None or len(targets) != num_mb):
        raise ValueError(f"the last stage needs loss_fn and one target per micro-batch ({num_mb})")
    clock = clock or clock_for(device)
    params = list(stage.parameters())
    batches = message_batches(order, rank, world)
    in_flight: list[tuple[comm.Exchange, torch.Tensor]] = []  # sends, with their tensors kept alive until done
    stash: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}  # mb -> (input, output or loss, bytes)
    marks, pads, outputs, losses = [], [], [], []   # resolved into seconds at the end (on CUDA that syncs)
    alive_bytes = peak_inflight = peak_bytes = 0
    outgoing: torch.Tensor | None = None            # what the previous op sends
    start = clock.start()

    def post(k: int, buf: torch.Tensor | None) -> comm.Exchange:
        """Batch k: the previous op's send and this op's receive into ``buf``, posted together."""
        sends, recvs = batches[k]
        ex = comm.exchange([comm.Message(outgoing, *s) for s in sends], [comm.Message(buf, *r) for r in recvs])
        if sends:
            in_flight.append((ex, outgoing))
        return ex

    for k, (op, i) in enumerate(order):
        if op == "F":
            if first:
                post(k, None)
                x = inputs[i].to(device)
            else:                                         # wait (idle) for the previous stage
                shape, dtype = in_shape
                x = torch.empty(shape, dtype=dtype, device=device)
                post(k, x).wait_received()
                x.requires_grad_(True)                    # we will send its gradient back
            began = clock.mark()
            holder: list[torch.Tensor] = []
            nbytes = saved_activation_bytes(lambda: holder.append(stage(x)), exclude=params)
            y = holder[0]
            if last:
                loss = loss_fn(y, targets[i].to(device)) / num_mb
                outputs.append(y.detach())
                losses.append(loss.detach())
            stash[i] = (x, loss if last else y, nbytes)
            alive_bytes += nbytes
            peak_inflight, peak_bytes = max(peak_inflight, len(stash)), max(peak_bytes, alive_bytes)
            outgoing = None if last else y.detach().contiguous()
        else:
            x, y, nbytes = stash.pop(i)
            if last:
                post(k, None)
                began = clock.mark()
                y.backward()                              # y is this micro-batch's loss / m
            else:                                         # wait (idle) for the next stage's gradient
                grad = torch.empty_like(y)
                post(k, grad).wait_received()
                began = clock.mark()
                y.backward(grad)
            alive_bytes -= nbytes                         # the graph of micro-batch i is freed here
            outgoing = None if first else x.grad.contiguous()
        if op_seconds is not None:                    # the op's time is up before its result leaves
            pads.append(clock.pad(began, op_seconds[op]))
        marks.append((op, i, began, clock.mark()))
    post(len(order), None)
    for ex, _ in in_flight:
        ex.wait()
    end = clock.mark()
    return StageRun(rank, clock.seconds(start), clock.seconds(end),
                    busy=[(op, i, clock.seconds(b), clock.seconds(e)) for op, i, b, e in marks],
                    peak_inflight=peak_inflight, peak_activation_bytes=peak_bytes,
                    overruns=sum(clock.overran(t) for t in pads), outputs=[o.cpu() for o in outputs],
                    losses=[loss.item() * num_mb for loss in losses], clock=clock.name)


def measured_bubble(runs: Sequence[StageRun]) -> dict[str, float]:
    """Makespan and idle share of a real run, from every rank's busy intervals.

    The ranks' times must be comparable: on the CPU, ranks on one machine read
    one system-wide monotonic clock; on GPUs, each rank's CUDA events count
    from its own start, taken right after a common barrier. (Across machines
    CPU clocks differ; each rank would have to measure its own idle share.)
    """
    start = min(r.start for r in runs)
    makespan = max(r.end for r in runs) - start
    busy = [sum(e - b for _, _, b, e in r.busy) for r in runs]
    return {"makespan": makespan, "bubble_fraction": 1.0 - sum(busy) / (len(runs) * makespan),
            "busy": busy}
