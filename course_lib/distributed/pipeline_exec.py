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

Sends are non-blocking (``isend``) and receives blocking: a rank only ever
waits for data it needs, never for its partner to be ready to receive, so a
schedule that the simulator can play cannot deadlock here. Activations flow
only forward and gradients only backward between two neighbours, and both
run their micro-batches in the same order, so messages never cross; the tag
(micro-batch, direction) makes the pairing explicit anyway.

For the bubble measurement each op can be padded to a fixed duration
(``op_seconds``): the real work runs, then the rank sleeps until the op's
time is up. A sleeping rank leaves the CPU to the others, like a host that
waits for its GPU, so ``p`` ranks on two shared cores still see equal stage
costs, and the idle time left is the schedule's bubble plus messaging delays.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

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


@dataclass
class StageRun:
    """What one rank measured while running its order of ops."""

    rank: int
    start: float                                   # perf_counter when the rank began (after a barrier)
    end: float                                     # when its last op finished
    busy: list[tuple[str, int, float, float]] = field(default_factory=list)  # (op, mb, start, end)
    peak_inflight: int = 0                         # most micro-batches whose graph was kept at once
    peak_activation_bytes: int = 0                 # most saved-activation bytes alive at once
    overruns: int = 0                              # ops whose real work took longer than op_seconds
    outputs: list[torch.Tensor] = field(default_factory=list)   # last stage: each micro-batch's output
    losses: list[float] = field(default_factory=list)           # last stage: each micro-batch's loss


def run_stage(stage: nn.Module, order: Sequence[tuple[str, int]], rank: int, world: int,
              in_shape: tuple[tuple[int, ...], torch.dtype], inputs: Sequence[torch.Tensor] | None = None,
              targets: Sequence[torch.Tensor] | None = None, loss_fn: LossFn | None = None,
              op_seconds: dict[str, float] | None = None, device: torch.device | str = "cpu") -> StageRun:
    """Run one stage's ``order`` of ``("F" | "B", micro-batch)`` ops; gradients accumulate in ``stage``.

    ``inputs`` (first stage) and ``targets`` with ``loss_fn`` (last stage) are
    lists with one tensor per micro-batch. The loss of each micro-batch is
    divided by their number, so the summed gradients equal those of the mean
    loss over the whole batch. ``op_seconds`` pads each op to a fixed time.
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
    params = list(stage.parameters())
    pending_sends: list[tuple[dist.Work, torch.Tensor]] = []   # keep each sent tensor alive until done
    stash: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}  # mb -> (input, output or loss, bytes)
    run = StageRun(rank, time.perf_counter(), 0.0)
    alive_bytes = 0
    on_gpu = torch.device(device).type == "cuda"

    def finish(op: str, i: int, began: float) -> None:
        """Pad the op to its fixed duration (if any) and record it as busy time; then its result may leave."""
        if on_gpu:
            torch.cuda.synchronize(device)                # GPU work is asynchronous: wait for it
        if op_seconds is not None:
            remaining = began + op_seconds[op] - time.perf_counter()
            if remaining > 0:
                time.sleep(remaining)
            else:
                run.overruns += 1
        run.busy.append((op, i, began, time.perf_counter()))

    for op, i in order:
        if op == "F":
            if first:
                x = inputs[i].to(device)
            else:                                         # wait (idle) for the previous stage
                shape, dtype = in_shape
                x = torch.empty(shape, dtype=dtype, device=device)
                dist.recv(x, src=rank - 1, tag=_tag(i, False))
                x.requires_grad_(True)                    # we will send its gradient back
            began = time.perf_counter()
            holder: list[torch.Tensor] = []
            nbytes = saved_activation_bytes(lambda: holder.append(stage(x)), exclude=params)
            y = holder[0]
            if last:
                loss = loss_fn(y, targets[i].to(device)) / num_mb
                run.outputs.append(y.detach().cpu())
                run.losses.append(loss.item() * num_mb)
            stash[i] = (x, loss if last else y, nbytes)
            alive_bytes += nbytes
            run.peak_inflight = max(run.peak_inflight, len(stash))
            run.peak_activation_bytes = max(run.peak_activation_bytes, alive_bytes)
            finish("F", i, began)                         # the op's time is up before its result leaves
            if not last:
                out = y.detach().contiguous()
                pending_sends.append((dist.isend(out, dst=rank + 1, tag=_tag(i, False)), out))
        elif op == "B":
            x, y, nbytes = stash.pop(i)
            if last:
                began = time.perf_counter()
                y.backward()                              # y is this micro-batch's loss / m
            else:                                         # wait (idle) for the next stage's gradient
                grad = torch.empty_like(y)
                dist.recv(grad, src=rank + 1, tag=_tag(i, True))
                began = time.perf_counter()
                y.backward(grad)
            alive_bytes -= nbytes                         # the graph of micro-batch i is freed here
            finish("B", i, began)
            if not first:
                g = x.grad.contiguous()
                pending_sends.append((dist.isend(g, dst=rank - 1, tag=_tag(i, True)), g))
        else:
            raise ValueError(f"this executor runs F and B ops; got {op!r} (split backwards are not implemented)")
    for work, _ in pending_sends:
        work.wait()
    run.end = time.perf_counter()
    return run


def measured_bubble(runs: Sequence[StageRun]) -> dict[str, float]:
    """Makespan and idle share of a real run, from every rank's busy intervals.

    All ranks must run on one machine, where ``time.perf_counter`` reads one
    system-wide monotonic clock, so their times are comparable (across
    machines the clocks differ; each rank would have to measure its own idle share).
    """
    start = min(r.start for r in runs)
    makespan = max(r.end for r in runs) - start
    busy = [sum(e - b for _, _, b, e in r.busy) for r in runs]
    return {"makespan": makespan, "bubble_fraction": 1.0 - sum(busy) / (len(runs) * makespan),
            "busy": busy}
