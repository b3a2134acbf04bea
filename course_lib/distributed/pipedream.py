"""PipeDream: asynchronous 1F1B with weight stashing (chapter 08; Narayanan et al., SOSP 2019).

PipeDream never flushes the pipe: each stage runs 1F1B over an endless stream
of micro-batches and updates its weights after *every* backward. The bubble of
a flush is gone (only the first fill and the last drain remain), but a
micro-batch's forward and backward now happen at different weight versions:
stage ``s`` runs ``F(j + p - s - 1)`` right before ``B(j)``, so between a
micro-batch's forward and its backward it applies ``p - s - 1`` updates.

- Without stashing the backward would use the newer weights with activations
  computed by the older ones: a gradient of no function at all (autograd
  refuses: the saved weights were changed in place).
- **Weight stashing** keeps, for every micro-batch in flight, the weights its
  forward used, and runs its backward on them; *within the stage* the
  gradient is then the true gradient at that version, applied to the newest
  weights. It is ``p - s - 1`` updates stale on stage ``s``, and stage ``s``
  keeps ``p - s`` versions (one per micro-batch in flight). Across stages it
  is not one model's gradient: the incoming ``dY`` was computed downstream at
  those stages' own versions for the micro-batch (one more update per stage
  further down). PipeDream's optional vertical sync, which makes every stage
  use one version per micro-batch, is left out here, as in the paper's main
  results.

``versions`` reads the weight versions off a schedule; ``WeightStash`` is what
one rank keeps (``pipeline_exec.run_stage`` calls it); the worker
``course_lib.workers.pipedream_run`` trains with it on gloo ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import nn

from course_lib.distributed.pipeline import Op, one_f_one_b_order


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

    ``weights(i)`` makes micro-batch ``i``'s copy of the live weights before its
    forward; ``apply(i)`` moves the gradient computed on that copy to the live
    weights, steps the optimizer and drops the copy. ``stash=False`` runs the
    forward on the live weights themselves (no copy): the next in-place update
    then breaks micro-batch ``i``'s backward.
    """

    module: nn.Module
    optimizer: torch.optim.Optimizer
    stash: bool = True
    version: int = 0
    copies: dict[int, tuple[int, dict[str, torch.Tensor]]] = field(default_factory=dict)
    peak_copies: int = 0
    peak_bytes: int = 0
    used: list[tuple[int, int, int]] = field(default_factory=list)  # (micro-batch, forward version, update version)

    def weights(self, i: int) -> dict[str, torch.Tensor] | None:
        if not self.stash:
            self.copies[i] = (self.version, {})
            return None
        copy = {n: p.detach().clone().requires_grad_(p.requires_grad) for n, p in self.module.named_parameters()}
        self.copies[i] = (self.version, copy)
        self.peak_copies = max(self.peak_copies, len(self.copies))
        self.peak_bytes = max(self.peak_bytes, sum(t.nbytes for _, c in self.copies.values() for t in c.values()))
        return copy

    def apply(self, i: int) -> None:
        version, copy = self.copies.pop(i)
        for name, p in self.module.named_parameters():
            if copy:
                p.grad = copy[name].grad                  # the gradient at the stashed version ...
        self.optimizer.step()                             # ... applied to the newest weights
        self.optimizer.zero_grad(set_to_none=True)
        self.used.append((i, version, self.version))
        self.version += 1
