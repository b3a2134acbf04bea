"""Data parallelism by hand: ``NaiveDDP`` and ``BucketedDDP`` (chapter 06).

Every rank holds the same model and takes a different slice of the batch.
After ``loss.backward()`` each rank has the gradient of *its* slice; averaging
the gradients over the N ranks gives the gradient of the whole batch (for a
mean loss over equal slices), so every rank takes the same optimizer step and
the replicas stay identical. Usage, for both wrappers and on every rank::

    model = BucketedDDP(net)             # broadcasts rank 0's parameters
    loss_fn(model(x), y).backward()
    model.finish_gradient_synchronization()
    optimizer.step()

``NaiveDDP`` all-reduces one gradient at a time after the backward pass: one
message per tensor, and the network idles while the backward runs.
``BucketedDDP`` groups gradients into ~25 MB buckets (PyTorch DDP's default,
``bucket_cap_mb``) in reverse parameter order, the order backward produces
them, and starts each bucket's all-reduce asynchronously from a
post-accumulate-grad hook as soon as its last gradient is final, so
communication overlaps the rest of the backward pass (Li et al. 2020,
"PyTorch Distributed: Experiences on Accelerating Data Parallel Training").
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from course_lib.distributed import comm

MB = 2**20


def _require_process_group() -> int:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("a DDP wrapper needs a process group: call launch.init_distributed() in a worker first")
    return dist.get_world_size()


@torch.no_grad()
def broadcast_module(module: nn.Module, src: int = 0, counter: comm.ByteCounter | None = None) -> None:
    """Copy rank ``src``'s parameters and buffers to every rank, so all replicas start equal."""
    for t in [*module.parameters(), *module.buffers()]:
        comm.broadcast(t.data, src, counter=counter)


def _used_anywhere(params: Sequence[nn.Parameter]) -> list[bool]:
    """Which parameters have a gradient on at least one rank (one small all-reduce of 0/1 flags).

    A parameter unused on every rank keeps ``grad = None``, exactly as in a single process;
    one unused only here contributes zeros. The flags are bookkeeping (4 bytes per
    tensor), so they are left out of the byte counts.
    """
    flags = torch.tensor([float(p.grad is not None) for p in params], device=params[0].device)
    dist.all_reduce(flags)
    return [f > 0 for f in flags.tolist()]


class NaiveDDP(nn.Module):
    """Broadcast the parameters once; after backward, all-reduce every gradient, one tensor at a time, and average."""

    def __init__(self, module: nn.Module, counter: comm.ByteCounter | None = None):
        super().__init__()
        self.world = _require_process_group()
        self.module = module
        self.counter = counter
        self._sync = True
        broadcast_module(module)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (gradient accumulation): skip the all-reduces inside this block."""
        self._sync, before = False, self._sync
        try:
            yield
        finally:
            self._sync = before

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        """Average every trainable parameter's gradient over the ranks (blocking)."""
        if not self._sync:
            return
        params = [p for p in self.module.parameters() if p.requires_grad]  # frozen ones need nothing
        if not params:
            return
        for p, used in zip(params, _used_anywhere(params)):
            if not used:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            comm.all_reduce(p.grad, counter=self.counter)  # sum over ranks ...
            p.grad.div_(self.world)                          # ... then the mean


def assign_buckets(sizes: Sequence[int], cap_bytes: float, keys: Sequence[Hashable] | None = None,
                   first_cap_bytes: float | None = None) -> list[list[int]]:
    """Group parameter indices into buckets of at most ``cap_bytes``, walking the parameters in reverse.

    Reverse, because backward produces the last layer's gradient first: bucket
    0 is ready first. A parameter larger than the cap gets a bucket of its own;
    parameters with different ``keys`` (dtype, device) never share a bucket,
    since a bucket is one flat tensor. ``first_cap_bytes`` caps bucket 0
    alone: PyTorch DDP makes it 1 MB so that communication starts early.
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


@dataclass(eq=False)
class _Bucket:
    params: list[int]                # indices into BucketedDDP.params
    waiting: int = 0                 # parameters whose gradient is not final yet in this step
    flat: torch.Tensor | None = None
    work: dist.Work | None = None
    launched: bool = False
    sizes: list[int] = field(default_factory=list)


class BucketedDDP(nn.Module):
    """All-reduce gradients in buckets, each started from a backward hook as soon as it is complete.

    A parameter's post-accumulate-grad hook fires once per accumulation into
    ``.grad``: once per backward for most parameters, but twice when a module
    sits both inside and outside a reentrant activation checkpoint, and never
    for a parameter unused in this step. A bucket may only leave after its
    *last* accumulation, so the first step counts the hook calls per parameter
    and launches every bucket in ``finish_gradient_synchronization``; later
    steps launch a bucket as soon as every parameter in it reached its count.
    If a later step uses a parameter more often than any step before (the
    graph changed), its bucket is sent again at the end: correct, only slower.
    The last bucket always waits for the end of backward and carries one
    "left too early" flag per bucket, so the ranks agree on what to re-send
    without an extra message. Buckets always leave in index order, so every rank issues the same
    collectives in the same order (a mismatch would wait for the timeout).
    Bucket 0 is capped at ``first_bucket_mb`` (1 MB, as in PyTorch DDP) so the
    first all-reduce starts early in the backward pass; ``None`` disables that.
    """

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25.0, counter: comm.ByteCounter | None = None,
                 first_bucket_mb: float | None = 1.0):
        super().__init__()
        if bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
        self.world = _require_process_group()
        self.module = module
        self.counter = counter
        broadcast_module(module)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]  # frozen: no bucket
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        sizes = [p.numel() * p.element_size() for p in self.params]
        keys = [(p.dtype, p.device) for p in self.params]
        self.buckets = [_Bucket(idx, sizes=[self.params[i].numel() for i in idx])
                        for idx in assign_buckets(sizes, bucket_cap_mb * MB, keys,
                                                  None if first_bucket_mb is None
                                                  else min(first_bucket_mb, bucket_cap_mb) * MB)]
        self._bucket_of = {i: k for k, b in enumerate(self.buckets) for i in b.params}  # param -> bucket
        self._expected: list[int] | None = None   # hook calls per parameter, learned on the first step
        self._count = [0] * len(self.params)
        self._next = 0                            # the next bucket to launch
        self._sync = True
        self.resent = 0                           # buckets sent twice because a gradient came late
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(self.params)]
        self._reset()

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: hooks launch nothing inside this block."""
        self._sync, before = False, self._sync
        try:
            yield
        finally:
            self._sync = before

    def _hook(self, i: int) -> Callable[[torch.Tensor], None]:
        def on_grad_ready(param: torch.Tensor) -> None:
            if not self._sync:
                return
            self._count[i] += 1
            if self._expected is None:
                return  # first step: only counting
            bucket = self.buckets[self._bucket_of[i]]
            if bucket.launched:
                # used more often than ever before (the graph changed): this bucket left too
                # early and is sent again, in finish_gradient_synchronization
                self._late.add(self._bucket_of[i])
            elif self._count[i] == self._expected[i]:
                bucket.waiting -= 1
                self._launch_ready()
        return on_grad_ready

    def _reset(self) -> None:
        self._count = [0] * len(self.params)
        self._late: set[int] = set()
        self._next = 0
        for b in self.buckets:
            b.work, b.launched = None, False
            b.waiting = sum(1 for i in b.params if self._expected is None or self._expected[i] > 0)

    def _launch_ready(self, final: bool = False) -> None:
        # In order: bucket k leaves only after bucket k-1, the same sequence on every rank. The last
        # bucket (the first layers, whose gradients come last anyway) waits for the end of backward,
        # so that it can also carry the "late" flags below.
        stop = len(self.buckets) if final else len(self.buckets) - 1
        while self._next < stop and self.buckets[self._next].waiting == 0:
            self._launch(self.buckets[self._next])
            self._next += 1

    @torch.no_grad()
    def _launch(self, b: _Bucket) -> None:
        params = [self.params[i] for i in b.params]
        dtype, device = params[0].dtype, params[0].device
        # One flat tensor: the gradients (zeros for a missing one), then a 0/1 "has a gradient"
        # flag per parameter, so the same message tells which parameters are unused on every rank.
        # The copy costs one bucket of memory traffic; torch DDP avoids it by making .grad a view
        # into the bucket (gradient_as_bucket_view=True).
        parts = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
        tail = [torch.tensor([float(p.grad is not None) for p in params], dtype=dtype, device=device)]
        if b is self.buckets[-1]:
            # The last bucket leaves after every hook has run: it also carries one flag per bucket that
            # some gradient reached after the bucket had left, so all ranks agree on what to re-send.
            late = torch.zeros(len(self.buckets), dtype=dtype, device=device)
            late[sorted(self._late)] = 1.0
            tail.append(late)
        if b.flat is None:  # allocated once, reused every step (the previous all-reduce is finished by now)
            b.flat = torch.empty(sum(b.sizes) + sum(len(t) for t in tail), dtype=dtype, device=device)
        torch.cat([*parts, *tail], out=b.flat)
        b.work = comm.all_reduce(b.flat, counter=self.counter, async_op=True)
        b.launched = True

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        """Launch the buckets still waiting, wait for all, and write the averaged gradients back."""
        if not self._sync or not self.buckets:  # no_sync, or nothing trainable
            return
        for b in self.buckets[self._next:]:
            b.waiting = 0  # whatever did not arrive is not coming in this step
        self._launch_ready(final=True)
        for b in self.buckets:
            b.work.wait()
        late = self.buckets[-1].flat[-len(self.buckets):]
        for k in late.nonzero().flatten().tolist():  # left too early on some rank: send again, everywhere
            self.resent += 1
            self._launch(self.buckets[k])
            self.buckets[k].work.wait()
        for b in self.buckets:
            self._unpack(b)
        # hook calls per parameter: learned on the first step, raised if a later step needs more
        first_step = self._expected is None
        self._expected = list(self._count) if first_step else [max(e, c) for e, c in zip(self._expected, self._count)]
        self._reset()

    def _unpack(self, b: _Bucket) -> None:
        """Average a bucket's sums and write them into ``.grad`` (flag 0: unused on every rank, keep None)."""
        total = sum(b.sizes)
        flags = b.flat[total: total + len(b.params)].tolist()
        for i, g, used in zip(b.params, b.flat[:total].split(b.sizes), flags):
            p = self.params[i]
            if used == 0:
                continue  # unused on every rank: keep grad None, as a single process would
            g = g.view_as(p).div_(self.world)
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)

    def remove_hooks(self) -> None:
        """Detach the gradient hooks from the wrapped module's parameters."""
        for h in self._hooks:
            h.remove()
        self._hooks = []


def counting_allreduce_hook(counter: comm.ByteCounter) -> Callable:
    """A DDP communication hook: torch DDP's default all-reduce (average), counted in ``counter``.

    ``torch_ddp.register_comm_hook(None, counting_allreduce_hook(counter))``;
    ``counter.calls["all_reduce"]`` then counts the buckets torch DDP sends.
    """
    # no annotations on purpose: torch DDP checks them, and `from __future__ import annotations` makes them strings
    def hook(state, bucket):  # (None, dist.GradBucket) -> torch.futures.Future[torch.Tensor]
        t = bucket.buffer()
        t.div_(dist.get_world_size())  # torch DDP's default hook divides before summing, too
        work = comm.all_reduce(t, counter=counter, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])
    return hook
