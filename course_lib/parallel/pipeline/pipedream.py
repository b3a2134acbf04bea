"""PipeDream: asynchronous 1F1B with weight stashing (chapter 08; Narayanan et al., SOSP 2019).

PipeDream never flushes the pipe: each stage runs 1F1B over an endless stream of micro-batches and updates its
weights after *every* backward. The flush's bubble is gone (only the first fill and the last drain remain), but
stage ``s`` runs ``F(j + p - s - 1)`` right before ``B(j)``: between a micro-batch's forward and its backward it
applies ``p - s - 1`` updates. Run with the newer weights, the backward would mix them with activations of the older
ones, the gradient of no function (autograd refuses: the saved weights changed in place). **Weight stashing** keeps,
for every micro-batch in flight, the weights its forward used and runs its backward on them: within the stage the
true gradient at that version, ``p - s - 1`` updates stale, applied to the newest weights; stage ``s`` keeps
``p - s`` versions. Across stages it is not one model's gradient (PipeDream's optional vertical sync is left out,
as in the paper's main results).

``versions`` reads the weight versions off a schedule; ``WeightStash`` is what one rank keeps, and ``run_pipedream``
is one rank's loop, 1F1B with a stashed forward and an optimizer step after each backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import nn

from course_lib.parallel.pipeline.executor import LossFn, Mailbox, Shape, Watch
from course_lib.parallel.pipeline.schedules import Op, one_f_one_b_order


@dataclass
class Versions:
    """The weight versions one PipeDream stage uses (version k: after k updates)."""

    forward: dict[int, int]           # micro-batch -> version its forward used
    backward: dict[int, int]          # micro-batch -> version current when its backward ran
    held: list[list[int]]             # after each op: the versions stashed (one per micro-batch in flight)

    @property
    def staleness(self) -> int:
        """Most updates between a micro-batch's forward and the update its gradient makes."""
        return max(self.backward[i] - self.forward[i] for i in self.forward)

    @property
    def peak_stashed(self) -> int:
        return max(len(h) for h in self.held)


def versions(order: Sequence[Op]) -> Versions:
    """Play one stage's order with an update after every ``B``: which version each op uses and keeps."""
    version, fwd, bwd, alive, held = 0, {}, {}, {}, []
    for op, i, *_ in order:
        if op == "F":
            fwd[i] = alive[i] = version          # stash the weights this forward used
        elif op == "B":
            bwd[i] = version
            alive.pop(i)                         # its backward ran on them: drop the copy
            version += 1                         # and its gradient makes the next version
        held.append(sorted(alive.values()))
    return Versions(fwd, bwd, held)


def async_order(num_stages: int, num_microbatches: int, stage: int) -> list[Op]:
    """PipeDream's order on stage ``s``: 1F1B over the whole stream, with no flush between batches."""
    return one_f_one_b_order(num_stages, num_microbatches, stage)


def stash_formula(num_stages: int, stage: int) -> int:
    """Versions stage ``s`` of ``p`` keeps in steady state: ``p - s`` (Narayanan et al. 2019, section 3.3)."""
    return num_stages - stage


@dataclass
class WeightStash:
    """One rank's stash: a copy of the weights for every micro-batch in flight (what it costs: that many copies).

    ``weights(i)`` makes micro-batch ``i``'s copy of the live weights before its forward; ``apply(i)`` moves the
    gradient computed on that copy to the live weights, steps the optimizer and drops the copy. ``stash=False`` runs
    the forward on the live weights themselves (no copy): the next in-place update then breaks ``i``'s backward.
    """

    module: nn.Module
    optimizer: torch.optim.Optimizer
    stash: bool = True
    version: int = 0                                      # updates applied so far
    copies: dict[int, tuple[int, dict[str, torch.Tensor]]] = field(default_factory=dict)  # i -> (version, weights)

    def weights(self, i: int) -> dict[str, torch.Tensor] | None:
        named = self.module.named_parameters() if self.stash else ()
        copy = {n: p.detach().clone().requires_grad_(p.requires_grad) for n, p in named}
        self.copies[i] = (self.version, copy)
        return copy if self.stash else None

    def apply(self, i: int) -> int:
        """Micro-batch ``i``'s update; returns the version its forward used."""
        version, copy = self.copies.pop(i)
        if copy:                    # without one (stash=False) the gradient is on the live weights already
            for name, p in self.module.named_parameters():
                p.grad = copy[name].grad                  # the gradient at the stashed version ...
        self.optimizer.step()                             # ... applied to the newest weights
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        return version


def run_pipedream(stage: nn.Module, stash: WeightStash, rank: int, world: int, n: int, in_shape: Shape,
                  inputs: Sequence[torch.Tensor] | None = None, targets: Sequence[torch.Tensor] | None = None,
                  loss_fn: LossFn | None = None, device: torch.device | str = "cpu",
                  watch: Watch | None = None) -> list[float]:
    """One rank of PipeDream over a stream of ``n`` micro-batches; returns the last stage's losses. The messages are
    ``executor.run_stage``'s (a ``Mailbox`` over ``async_order``); what differs is the forward, on micro-batch ``i``'s
    stashed weights (``torch.func.functional_call``), and the step after each backward."""
    schedule = [async_order(world, n, s) for s in range(world)]
    first, last = rank == 0, rank == world - 1
    if (first and (inputs is None or len(inputs) != n)) or (last and (targets is None or loss_fn is None)):
        raise ValueError(f"the first stage needs {n} inputs, the last loss_fn and {n} targets")
    watch = watch or Watch()
    mail = Mailbox(schedule, rank, watch=watch)
    kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}   # micro-batch -> (input, output) until its backward
    losses: list[torch.Tensor] = []
    outgoing: torch.Tensor | None = None
    watch.begin()
    for k, (op, i) in enumerate(schedule[rank]):
        if op == "F":
            x = None if first else torch.empty(in_shape[0], dtype=in_shape[1], device=device)
            mail.exchange(k, outgoing, into=x)    # wait (idle) for the previous stage
            x = inputs[i].to(device) if first else x.requires_grad_()
            with watch.op(op, i, 0):
                w = stash.weights(i)              # this micro-batch's copy of the live weights
                y = stage(x) if w is None else torch.func.functional_call(stage, w, (x,))
                if last:
                    y = loss_fn(y, targets[i].to(device))   # one step per micro-batch: its own mean loss
                    losses.append(y.detach())
                kept[i] = (x, y)
                watch.kept(i, 0, len(kept))
                outgoing = None if last else y.detach().contiguous()
        else:
            x, y = kept.pop(i)
            grad = None if last else torch.empty_like(y)
            mail.exchange(k, outgoing, into=grad)
            with watch.op(op, i, 0):
                y.backward(grad)                  # on the stashed weights: the gradient at their version
                watch.freed(i, 0)
                stash.apply(i)                    # ... applied to the live weights, one optimizer step
                outgoing = None if first else x.grad.contiguous()
    mail.finish(outgoing)
    return [loss.item() for loss in losses]
