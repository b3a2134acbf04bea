"""``DynamicBucketedDDP``: ``BucketedDDP`` for backwards that differ between steps or ranks, opt-in (chapter 07).

Three things break ``BucketedDDP``'s bets, and this layer handles each:

1. **A parameter accumulates twice per backward** (reentrant checkpoint): the first step only counts each
   parameter's hook calls (or ``hook_calls`` gives them); later steps send a bucket when each count is reached.
2. **A parameter is used on some ranks only**: each bucket carries a 0/1 "has a gradient" flag per parameter,
   so the same message tells which ones no rank used; those keep ``grad = None``.
3. **A gradient comes after its bucket left**: the last bucket waits for the end of backward and carries one
   "late" flag per bucket; every rank re-sends the buckets any rank flagged, in the same order.

torch DDP's ``static_graph=True`` makes bet 1 and ``find_unused_parameters=True`` handles 2. The cost: 4 bytes
of flags per tensor and per bucket, and the copies ``BucketedDDP``'s views save (a late gradient must not land
in a bucket on the wire, so each message is a copy of the gradients, copied back).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from course_lib.parallel.data_parallel.ddp import Bucket, BucketedDDP


class DynamicBucketedDDP(BucketedDDP):
    """``BucketedDDP`` with hook counts learned on the first step, unused-parameter flags and late re-sends."""

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25.0, first_bucket_mb: float | None = 1.0,
                 hook_calls: Sequence[int] | None = None):
        super().__init__(module, bucket_cap_mb, first_bucket_mb)
        if hook_calls is not None and len(hook_calls) != len(self.params):
            raise ValueError(f"hook_calls needs one count per trainable parameter, {len(self.params)}")
        # hook calls per parameter and backward: learned on the first step (None until then)
        self.expected: list[int] | None = None if hook_calls is None else list(hook_calls)
        self.resent = 0                                     # buckets sent twice because a gradient came late

    def _grad_ready(self, i: int) -> None:
        self._count[i] += 1
        if self.expected is None:
            return                                          # first step: only counting
        b = self._bucket_of[i]
        if b.work is not None:
            self._late.add(self.buckets.index(b))           # already sent: this gradient came late
        elif self._count[i] == self.expected[i]:            # its last accumulation of this backward
            b.ready.add(i)
            self._send_ready()

    def _complete(self, b: Bucket) -> bool:
        # The last bucket waits for the end of backward, to carry the late flags. A parameter never used
        # so far (expected 0) does not hold its bucket back.
        return b is not self.buckets[-1] and all(i in b.ready or self.expected[i] == 0 for i in b.index)

    @torch.no_grad()
    def _send(self, b: Bucket) -> None:
        # the gradients (zeros where there is none here), a 0/1 "has a gradient" flag per parameter,
        # and in the last bucket one "late" flag per bucket; .grad stays apart from the message
        grads = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in b.params]
        late = [float(k in self._late) for k in range(len(self.buckets))] if b is self.buckets[-1] else []
        flags = torch.tensor([float(p.grad is not None) for p in b.params] + late, dtype=b.flat.dtype,
                             device=b.flat.device)
        b.flat = torch.cat(grads + [flags])
        b.work = dist.all_reduce(b.flat, async_op=True)  # returns at once

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        """Like ``BucketedDDP``'s, after re-sending the buckets some rank flagged late; update the counts."""
        if self._sync and self.buckets:
            self._send_ready(final=True)
            for b in self.buckets:
                b.work.wait()
            late = self.buckets[-1].flat[-len(self.buckets):]   # summed over ranks: > 0 if late anywhere
            for k in late.nonzero().flatten().tolist():         # the same list, in the same order, everywhere
                self.resent += 1
                self._send(self.buckets[k])
            # learned on the first step, raised if a later step needs more
            self.expected = [max(e, c) for e, c in zip(self.expected or self._count, self._count)]
        super().finish_gradient_synchronization()               # waits (for the re-sent ones too), copies back

    @torch.no_grad()
    def _finish(self, b: Bucket) -> None:
        b.work.wait()
        total = sum(b.sizes)
        used = b.flat[total: total + len(b.params)].tolist()
        for p, g, u in zip(b.params, b.flat[:total].split(b.sizes), used):
            if u:                                           # 0: unused on every rank, grad stays None
                g = g.div_(self.world).view_as(p)           # the sum over ranks, then the mean
                p.grad = g.clone() if p.grad is None else p.grad.copy_(g)

    def _reset(self) -> None:
        super()._reset()
        self._count = [0] * len(self.params)                # hook calls in this backward
        self._late: set[int] = set()                        # buckets that a gradient reached after they left
