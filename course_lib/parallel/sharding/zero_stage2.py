"""ZeRO stage 2's gradients: each bucket reduce-scattered as soon as the backward has filled it (chapter 09).

No rank ever holds the full gradient. A post-accumulate-grad hook on every
parameter (it runs right after autograd has written the gradient) adds the
gradient into its bucket's buffer and frees it. A complete bucket starts its
reduce-scatter without waiting for it (``async_op=True``), in bucket order on
every rank, so the backward computes on while the bucket travels. Only when more
than ``max_in_flight`` are running does a hook wait, for the oldest; then this
rank's averaged slice is added to its piece's ``.grad`` and the bucket's buffer
is freed (DeepSpeed's and FSDP's way; Rajbhandari et al. 2020, section 5.2).

What it costs: the bucket being filled and those in flight exist in full (on
gloo each with a copy), besides this rank's slices. The traffic is one
reduce-scatter per bucket per *backward*: under gradient accumulation the rest
of a micro-batch's gradient must leave before the next backward makes a full
one again, so A micro-batches send (A+1)/2 x what DDP sends. After the backward
the parameters' ``.grad`` are ``None``: the gradient exists only as the pieces'.

Unused parameters (DDP's ``find_unused_parameters``): a parameter that this
backward will not reach counts as arrived, with zeros, as soon as the backward
starts, so its bucket does not wait for the end. A bucket no rank got a gradient
for keeps ``piece.grad = None``, so Adam skips it; a parameter unused everywhere
but sharing a bucket with used ones gets a zero gradient, which Adam's momentum
still turns into a step. How the ranks stay in step is ``zero_agreement``'s.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import torch
import torch.distributed as dist

from course_lib import memory
from course_lib.parallel import collectives as comm
from course_lib.parallel.sharding.agreement import Flags, raise_together
from course_lib.parallel.sharding.zero_buckets import Bucket, FlatLayout

# Reduce-scatters left running while the backward goes on (0: wait for each at once). Each holds its bucket's full
# gradient (and, on gloo, a copy of it) until it is done: the peak grows by that per one in flight.
MAX_IN_FLIGHT = 1


@dataclass(eq=False)
class _Filling:
    """Bucket ``bucket`` during one backward: its gradient while the hooks fill it, and what this rank saw."""

    bucket: Bucket
    grad: torch.Tensor | None = None  # the region's gradient: from its first gradient until its reduce-scatter
    arrived: int = 0      # parameters done in this backward (their gradient in ``grad``, or unused)
    used: bool = False    # a gradient of one of them arrived on this rank in this backward
    fresh: bool = False   # ``piece.grad`` was None before this backward's reduction

    @property
    def complete(self) -> bool:
        return self.arrived == len(self.bucket.params)


class Stage2Gradients:
    """The hooks that fill ``layout``'s buckets and reduce-scatter each one as soon as it is complete."""

    def __init__(self, layout: FlatLayout, world: int, counter: comm.ByteCounter, flags: Flags,
                 max_in_flight: int = MAX_IN_FLIGHT):
        self.layout, self.world, self.counter, self.flags = layout, world, counter, flags
        self.max_in_flight = max_in_flight
        # (bucket, output, input, work) of each reduce-scatter in flight, oldest first
        self._pending: collections.deque[tuple[_Filling, torch.Tensor, torch.Tensor, dist.Work]] = \
            collections.deque()
        self._reset_round()
        with torch.enable_grad():  # each parameter's AccumulateGrad node: does this backward reach it?
            self._grad_accs = [p.view_as(p).grad_fn.next_functions[0][0] for p in layout.params]
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(layout.params)]

    def _reset_round(self) -> None:
        """Forget the last backward: no bucket filled, nothing arrived, nothing in flight, no error."""
        self._filling = [_Filling(b) for b in self.layout.buckets]
        self._arrived = [False] * len(self.layout.params)  # done in this backward (arrived, or unused)
        self._pending.clear()
        self._next = 0                   # the next bucket to reduce (in order: every rank the same)
        self._in_backward = False
        self._error: str | None = None   # what went wrong on this rank in this backward

    def zero_grad(self) -> None:
        """No parameter ``.grad`` at all, only this rank's slices (zeroed, 1/N of the gradient)."""
        for p in self.layout.params:
            p.grad = None
        for b in self.layout.buckets:
            if b.piece.grad is not None:
                b.piece.grad.zero_()
        self._reset_round()

    def _hook(self, i: int):
        def on_grad(p: torch.Tensor) -> None:  # runs right after autograd accumulated p.grad
            k, o = self.layout.bucket_of[i]
            if not self._in_backward:  # first gradient of this backward
                self._begin_backward()
            if self._arrived[i]:  # noted here, raised on every rank together at the end of the backward
                self._error = self._error or (
                    f"a gradient of parameter {i} arrived twice in one backward (or after the backward had "
                    "counted it unused): it takes part in the backward twice (reentrant checkpointing?); use "
                    "torch.utils.checkpoint with use_reentrant=False")
                p.grad = None
                return
            f = self._filling[k]
            if f.grad is None:  # the bucket's buffer exists only while the backward fills it
                f.grad = f.bucket.zeros()
            f.grad[o:o + p.numel()].add_(p.grad.reshape(-1))
            p.grad = None  # its full gradient is in the bucket now: free it
            f.used = True
            self._mark(i)
        return on_grad

    def _mark(self, i: int) -> None:
        """Parameter ``i`` is done in this backward; start every bucket that is complete now, in order."""
        self._arrived[i] = True
        self._filling[self.layout.bucket_of[i][0]].arrived += 1
        while self._next < len(self._filling) and self._filling[self._next].complete:
            self._reduce(self._filling[self._next])

    @torch.no_grad()
    def _reduce(self, f: _Filling) -> None:
        """Start bucket ``f``'s reduce-scatter; wait only for those beyond ``max_in_flight``, oldest first."""
        full = f.grad if f.grad is not None else f.bucket.zeros()  # no gradient of it arrived on this rank
        out = torch.empty(f.bucket.slots, dtype=full.dtype, device=full.device)
        work = comm.reduce_scatter(out, full, counter=self.counter, async_op=True)  # (N-1)/N x the bucket's bytes
        self._pending.append((f, out, full, work))  # ``full`` must live until the collective is done
        f.grad = None
        self._next += 1
        while len(self._pending) > self.max_in_flight:
            self._finish()

    @torch.no_grad()
    def _finish(self) -> None:
        """Wait for the oldest reduce-scatter; add this rank's averaged slice to its ``piece.grad``; free the rest."""
        f, out, _, work = self._pending.popleft()
        work.wait()
        out.div_(self.world)  # the mean over ranks, as DDP: the gradient of the whole batch's mean loss
        piece = f.bucket.piece
        f.fresh = piece.grad is None
        piece.grad = out if piece.grad is None else piece.grad.add_(out)  # accumulation: a sum of means

    def _begin_backward(self) -> None:
        """Agree with the other ranks that a backward runs; count the parameters it will not reach as done."""
        self._in_backward = True
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        self.flags.backward_starts()  # ranks that skipped their backward answer from step() and join with zeros
        for i, acc in enumerate(self._grad_accs):
            if not self._arrived[i] and not torch._C._will_engine_execute_node(acc):
                self._mark(i)  # unused here: zeros, and its bucket need not wait for the end

    def _end_of_backward(self) -> None:
        """Start what is left (buckets with a parameter unused here: zeros), finish all, agree on errors."""
        for i in range(len(self.layout.params)):
            if not self._arrived[i]:
                self._mark(i)
        while self._pending:
            self._finish()
        failed, used = self.flags.backward_ends([f.used for f in self._filling], failed=bool(self._error))
        for f, u in zip(self._filling, used):
            if u == 0 and f.fresh:  # no rank had a gradient for it: no gradient at all, so Adam skips it
                f.bucket.piece.grad = None
        mine = self._error
        self._reset_round()
        raise_together(failed, mine)

    def sync(self) -> None:
        """Take part, with zero gradients, in every backward another rank is still running.

        Afterwards each piece's ``.grad`` is its slice of the mean, as the backward left it.
        """
        while self.flags.others_in_backward():  # some rank is in a backward this one skipped
            self._in_backward = True
            self._end_of_backward()  # every parameter unused here: zeros for every bucket

    def before_step(self) -> None:
        """``sync``: the slices were reduced during the backward."""
        self.sync()

    def after_step(self) -> None:
        """Nothing to note: stage 2 holds no full gradient to guard."""

    def held_bytes(self) -> int:
        """Bytes of gradient this rank holds: its slices."""
        return sum(memory.tensor_bytes(b.piece.grad) for b in self.layout.buckets if b.piece.grad is not None)
