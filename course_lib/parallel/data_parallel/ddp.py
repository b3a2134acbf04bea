"""Data parallelism by hand: ``NaiveDDP`` and ``BucketedDDP`` (chapter 07).

Every rank holds the same model and takes its own slice of the batch. Averaging the gradients over
the N ranks gives the gradient of the whole batch (for a mean loss over equal slices), so every rank
takes the same step and the replicas stay equal. Both wrappers, on every rank::

    model = BucketedDDP(net)             # broadcasts rank 0's parameters
    loss_fn(model(x), y).backward()      # BucketedDDP's buckets leave while backward runs
    model.finish_gradient_synchronization()
    optimizer.step()

``NaiveDDP`` all-reduces one gradient at a time after backward. ``BucketedDDP`` keeps the gradients in
flat 25 MiB buckets (each ``.grad`` a view into one) and all-reduces a bucket from a hook as soon as
backward has filled it (Li et al. 2020). Both bet, as torch DDP does by default, that every rank uses the
same parameters in a backward; ``ddp_dynamic.DynamicBucketedDDP`` is the opt-in layer for the rest.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from course_lib.parallel import collectives as comm

MiB = 2**20  # torch DDP's bucket_cap_mb counts in units of 2**20 bytes


@dataclass(eq=False)
class Bucket:
    """Gradients that travel as one all-reduce: ``flat`` holds them back to back, each ``.grad`` a view into it.

    Against a bucket that is a message of its own (``torch.cat`` of the gradients, the result copied back
    into each ``.grad``), the views save per step a second copy of every gradient in memory (the gradients'
    bytes, as torch's ``gradient_as_bucket_view=True`` says), the copy back after the all-reduce, and, while
    ``.grad`` is kept between steps (``zero_grad(set_to_none=False)``), the copy in: autograd adds into the
    bucket. After ``set_to_none=True`` autograd makes a fresh ``.grad`` and ``send`` copies it in once, as torch does.
    """

    index: list[int]                                    # the parameters' positions in the wrapper's list
    params: list[nn.Parameter]
    ready: set[int] = field(default_factory=set)        # parameters whose gradient is final in this backward
    work: dist.Work | None = None                       # its all-reduce, once sent
    sizes: list[int] = field(init=False)                # the parameters' numels
    flat: torch.Tensor = field(init=False)              # the message
    views: list[torch.Tensor] = field(init=False)       # one per parameter, shaped like it

    def __post_init__(self) -> None:
        self.sizes = [p.numel() for p in self.params]
        self.flat = torch.zeros(sum(self.sizes), dtype=self.params[0].dtype, device=self.params[0].device)
        self.views = [v.view_as(p) for v, p in zip(self.flat.split(self.sizes), self.params)]

    @torch.no_grad()
    def send(self) -> None:
        """Start the bucket's all-reduce; it returns at once and runs while backward goes on."""
        for p, view in zip(self.params, self.views):
            if p.grad is None:
                view.zero_()            # no gradient here: adds nothing to the sum, and p.grad stays None
            elif p.grad is not view:
                view.copy_(p.grad)      # a .grad autograd made afresh: the one copy in
        self.work = dist.all_reduce(self.flat, async_op=True)

    @torch.no_grad()
    def finish(self, world: int) -> None:
        """Wait for the all-reduce, turn the sum into the mean (one kernel per bucket), point each ``.grad`` in."""
        self.work.wait()
        self.flat.div_(world)
        for p, view in zip(self.params, self.views):
            if p.grad is not None:      # None: unused on every rank (the bet), as in one process: AdamW skips it
                p.grad = view           # here, not in send: after set_to_none=True a gradient that comes after
                                        # its bucket left (unsupported: ddp_dynamic) lands in the old .grad,
                                        # not in a message on the wire


def _require_process_group() -> int:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("a DDP wrapper needs a process group: call launch.init_distributed() in a worker first")
    return dist.get_world_size()


@torch.no_grad()
def broadcast_module(module: nn.Module, src: int = 0) -> None:
    """Copy rank ``src``'s parameters and buffers to every rank, so all replicas start equal."""
    for t in [*module.parameters(), *module.buffers()]:
        dist.broadcast(t.data, src)


class _Replicated(nn.Module):
    """What every DDP wrapper does: check the process group, start all replicas equal, ``no_sync``."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.world = _require_process_group()
        self.module = module
        self._sync = True
        broadcast_module(module)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (gradient accumulation): no all-reduce inside this block."""
        self._sync, before = False, self._sync
        try:
            yield
        finally:
            self._sync = before


class NaiveDDP(_Replicated):
    """After backward, all-reduce every gradient, one tensor at a time, and divide by the world size."""

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        """Average every gradient over the ranks (blocking)."""
        if not self._sync:
            return
        for p in self.module.parameters():
            # None: frozen, or unused on every rank (the bet: every rank then skips it alike), as in one process
            if p.grad is not None:
                dist.all_reduce(p.grad)   # sum over ranks ...
                p.grad.div_(self.world)   # ... then the mean


class BucketedDDP(_Replicated):
    """Gradients in flat buckets, each all-reduced from a backward hook as soon as backward has filled it.

    A parameter's post-accumulate-grad hook fires when autograd has added its gradient into ``.grad``.
    This version takes the first call as "final": true when each parameter accumulates at most once per
    backward. ``DynamicBucketedDDP`` (``ddp_dynamic``) drops that bet for reentrant checkpoints, and the
    bet that every rank uses the same parameters, for graphs that differ from rank to rank.
    """

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25.0, first_bucket_mb: float | None = 1.0):
        if bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
        super().__init__(module)
        self.params = [p for p in module.parameters() if p.requires_grad]  # frozen ones need no bucket
        sizes = [comm.nbytes(p) for p in self.params]
        keys = [(p.dtype, p.device) for p in self.params]                 # a bucket is one flat tensor
        # bucket 0 (the last layers) small, as torch DDP's 1 MiB first bucket: communication starts early
        first = None if first_bucket_mb is None else min(first_bucket_mb, bucket_cap_mb) * MiB
        self.buckets = [Bucket(idx, [self.params[i] for i in idx])
                        for idx in assign_buckets(sizes, bucket_cap_mb * MiB, keys, first)]
        self._bucket_of = {i: b for b in self.buckets for i in b.index}
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(self.params)]
        self._reset()

    def _hook(self, i: int) -> Callable[[torch.Tensor], None]:
        def on_grad_ready(param: torch.Tensor) -> None:
            if self._sync:  # inside no_sync(): accumulate only
                self._grad_ready(i)
        return on_grad_ready

    def _grad_ready(self, i: int) -> None:
        self._bucket_of[i].ready.add(i)
        self._send_ready()

    def _complete(self, b: Bucket) -> bool:
        return len(b.ready) == len(b.index)

    def _send_ready(self, final: bool = False) -> None:
        # In index order only: every rank must issue the same collectives in the same sequence, or
        # they pair up the wrong messages. ``final``: backward is over, whatever is missing is not coming.
        while self._next < len(self.buckets) and (final or self._complete(self.buckets[self._next])):
            self._send(self.buckets[self._next])
            self._next += 1

    def _send(self, b: Bucket) -> None:
        b.send()

    def _finish(self, b: Bucket) -> None:
        b.finish(self.world)

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        """Send the buckets still waiting, wait for every all-reduce, and average."""
        if not self._sync or not self.buckets:  # no_sync, or nothing trainable
            return
        self._send_ready(final=True)
        for b in self.buckets:
            self._finish(b)
        self._reset()

    def _reset(self) -> None:
        self._next = 0                                      # the next bucket to send
        for b in self.buckets:
            b.ready, b.work = set(), None

    def remove_hooks(self) -> None:
        """Detach the gradient hooks from the wrapped module's parameters."""
        for h in self._hooks:
            h.remove()
        self._hooks = []


def assign_buckets(sizes: Sequence[int], cap_bytes: float, keys: Sequence[Hashable] | None = None,
                   first_cap_bytes: float | None = None) -> list[list[int]]:
    """Group parameter indices into buckets of at most ``cap_bytes``, walking the parameters in reverse.

    Reverse, because backward produces the last layer's gradient first: bucket
    0 is ready first. A parameter larger than the cap gets a bucket of its own;
    parameters with different ``keys`` (dtype, device) never share a bucket,
    since a bucket is one flat tensor. ``first_cap_bytes`` caps bucket 0
    alone: PyTorch DDP makes it 1 MiB so that communication starts early.
    """
    if cap_bytes <= 0 or (first_cap_bytes is not None and first_cap_bytes <= 0):
        raise ValueError(f"bucket caps must be positive, got {cap_bytes} and {first_cap_bytes} bytes")
    if keys is not None and len(keys) != len(sizes):
        raise ValueError(f"got {len(sizes)} sizes but {len(keys)} keys")
    buckets: list[list[int]] = []
    current: list[int] = []
    filled, key = 0, None
    for i in reversed(range(len(sizes))):
        k = keys[i] if keys is not None else None
        cap = first_cap_bytes if (first_cap_bytes is not None and not buckets) else cap_bytes
        if current and (filled + sizes[i] > cap or k != key):
            buckets.append(current)
            current, filled = [], 0
        current.append(i)
        filled += sizes[i]
        key = k
    if current:
        buckets.append(current)
    return buckets
