"""ZeRO stage 1's gradients: the full gradient on every rank, reduce-scattered once per step (chapter 09).

Stage 1 shards only the optimizer state. The backward runs as without ZeRO:
autograd accumulates every parameter's gradient into one flat gradient buffer
laid out as the parameters are (as DDP's ``gradient_as_bucket_view``). In
``step`` each bucket of it is reduce-scattered: rank r receives slice r of the
sum, divides it by N and writes it over its own slice, which is the ``.grad``
of its piece. The inner optimizer updates that piece; ``ZeroOptimizer``
all-gathers the updated pieces.

What it costs: the full gradient, P elements, lives from ``zero_grad`` to the
end of ``step`` on every rank (stage 2 removes it); the traffic is DDP's,
(N-1)/N x P for the reduce-scatters and as much for the all-gathers, and it all
waits for the end of the backward (under accumulation: the last micro-batch's).
"""

from __future__ import annotations

import torch

from course_lib import memory
from course_lib.parallel import collectives as comm
from course_lib.parallel.sharding.agreement import GradVersion
from course_lib.parallel.sharding.zero_buckets import FlatLayout


class Stage1Gradients:
    """The flat gradient buffer of ``layout``'s parameters, and its reduce-scatter into every bucket's piece.

    The model's ``.grad`` tensors are views of the buffer, so code that reads
    or changes them (``torch.nn.utils.clip_grad_norm_`` on the model) works on
    the wrong gradient: before ``step`` each rank's own, unaveraged one; after
    it, a buffer that holds the mean only in this rank's slice. ``sync`` raises
    if they were changed in place after the backward, ``zero_grad`` if after
    ``step`` (``zero_agreement.GradVersion``).
    """

    def __init__(self, layout: FlatLayout, flat_params: torch.Tensor, rank: int, world: int,
                 counter: comm.ByteCounter):
        self.layout, self.flat_params, self.rank, self.world, self.counter = layout, flat_params, rank, world, counter
        self.flat_grads: torch.Tensor | None = None  # the full gradient buffer
        self._reduced = False    # the gradient is already reduced this step (by clip_grad_norm_)
        self._version = GradVersion()  # the buffer's version after the last accumulation, or after step()
        self._hooks = [p.register_post_accumulate_grad_hook(self._seen(i)) for i, p in enumerate(layout.params)]

    def _seen(self, i: int):
        def on_grad(p: torch.Tensor) -> None:  # autograd accumulated into the buffer: note its version
            if self.flat_grads is not None and p.grad is not None and p.grad.data_ptr() == self.layout.view(
                    self.flat_grads, i).data_ptr():
                self._version.note(self.flat_grads)
        return on_grad

    def zero_grad(self) -> None:
        """Every parameter gets a zeroed ``.grad`` that is a view into the flat buffer, for autograd to add into."""
        if self.flat_grads is not None:
            self._version.check(self.flat_grads, "after step()")
        # a new step: nothing reduced yet (clip_grad_norm_ may have reduced the last one, whose step() was skipped)
        self._reduced = False
        self._version.forget()
        if self.flat_grads is None:
            self.flat_grads = torch.zeros_like(self.flat_params)
        else:
            self.flat_grads.zero_()
        for i, p in enumerate(self.layout.params):
            p.grad = self.layout.view(self.flat_grads, i).view_as(p)

    def _collect(self) -> torch.Tensor:
        """The flat gradient buffer, copying in any ``.grad`` that is not already a view of it."""
        if self.flat_grads is None:
            self.flat_grads = torch.zeros_like(self.flat_params)
        for i, p in enumerate(self.layout.params):
            slot = self.layout.view(self.flat_grads, i)
            if p.grad is None:
                slot.zero_()  # unused this step (or zero_grad was skipped): contributes nothing
            elif p.grad.data_ptr() != slot.data_ptr():
                slot.copy_(p.grad.reshape(-1))
                p.grad = slot.view_as(p)
        return self.flat_grads

    @torch.no_grad()
    def sync(self) -> None:
        """Reduce-scatter the full gradient, bucket by bucket: each piece's ``.grad`` becomes its slice of the mean.

        Once per step: a second call (``step`` after ``clip_grad_norm_``) does nothing.
        """
        if self._reduced:
            return
        if self.flat_grads is not None:
            self._version.check(self.flat_grads, "after the backward")
        grads = self._collect()
        for b in self.layout.buckets:
            out = torch.empty(b.slots, dtype=grads.dtype, device=grads.device)
            comm.reduce_scatter(out, b.region(grads), counter=self.counter)
            # keep the full buffer (stage 1 does not shard it); this rank's slice becomes the mean
            b.piece.grad = b.shard(grads, self.rank).copy_(out.div_(self.world))
        self._reduced = True

    def before_step(self) -> None:
        """``sync``; the step then consumes the reduced gradient."""
        self.sync()
        self._reduced = False
        self._version.forget()

    def after_step(self) -> None:
        """Note the buffer's version: the next ``zero_grad`` checks that nobody changed it since."""
        if self.flat_grads is not None:
            self._version.note(self.flat_grads)

    def held_bytes(self) -> int:
        """Bytes of gradient this rank holds: the whole flat buffer (the pieces' ``.grad`` are views of it)."""
        return memory.tensor_bytes(self.flat_grads) if self.flat_grads is not None else 0
