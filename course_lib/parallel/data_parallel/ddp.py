"""Data parallelism by hand: ``NaiveDDP`` and ``BucketedDDP`` (chapter 07).

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
``BucketedDDP`` groups gradients into 25 MiB buckets (PyTorch DDP's default
``bucket_cap_mb``) in reverse parameter order, the order backward produces
them, and starts each bucket's all-reduce asynchronously from a
post-accumulate-grad hook as soon as its gradients are final, so
communication overlaps the rest of the backward pass (Li et al. 2020,
"PyTorch Distributed: Experiences on Accelerating Data Parallel Training").
It assumes that every parameter gets its gradient once per backward;
``ddp_dynamic.DynamicBucketedDDP`` extends it to models where that is not so.
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


def _set_grad(p: nn.Parameter, g: torch.Tensor) -> None:
    """Write the averaged gradient ``g`` (flat, or any shape with p's numel) into ``p.grad``."""
    if p.grad is None:
        p.grad = g.view_as(p).clone()
    else:
        p.grad.copy_(g.view_as(p))


class _Replicated(nn.Module):
    """What every DDP wrapper does: check the process group, start all replicas equal, ``no_sync``."""

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
        """Accumulate gradients locally (gradient accumulation): no all-reduce inside this block."""
        self._sync, before = False, self._sync
        try:
            yield
        finally:
            self._sync = before


class NaiveDDP(_Replicated):
    """Broadcast the parameters once; after backward, all-reduce every gradient, one tensor at a time, and average."""

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


@dataclass(eq=False)
class Bucket:
    """Parameters whose gradients travel as one flat tensor."""

    params: list[int]                                    # indices into BucketedDDP.params
    sizes: list[int]                                     # their numels
    ready: set[int] = field(default_factory=set)         # those whose gradient is final in this backward
    flat: torch.Tensor | None = None                     # the message: the gradients, concatenated
    work: dist.Work | None = None                        # its all-reduce, once sent


class BucketedDDP(_Replicated):
    """All-reduce gradients in buckets, each sent from a backward hook as soon as its gradients are final.

    A parameter's post-accumulate-grad hook fires when autograd has added its
    gradient into ``.grad``. This version takes the first call as "final",
    which holds when every trainable parameter is used, and accumulated once,
    in every backward: true of most models. ``DynamicBucketedDDP``
    (``ddp_dynamic``) drops that assumption for reentrant checkpoints and for
    graphs that change from step to step.
    """

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25.0, counter: comm.ByteCounter | None = None,
                 first_bucket_mb: float | None = 1.0):
        if bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
        super().__init__(module, counter)
        self.params = [p for p in module.parameters() if p.requires_grad]  # frozen ones need no bucket
        sizes = [comm.nbytes(p) for p in self.params]
        keys = [(p.dtype, p.device) for p in self.params]                 # a bucket is one flat tensor
        # bucket 0 (the last layers) small, as torch DDP's 1 MiB first bucket: communication starts early
        first = None if first_bucket_mb is None else min(first_bucket_mb, bucket_cap_mb) * MiB
        self.buckets = [Bucket(idx, [self.params[i].numel() for i in idx])
                        for idx in assign_buckets(sizes, bucket_cap_mb * MiB, keys, first)]
        self._bucket_of = {i: b for b in self.buckets for i in b.params}
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
        return len(b.ready) == len(b.params)

    def _send_ready(self, final: bool = False) -> None:
        # In index order only: every rank must issue the same collectives in the same sequence, or
        # they pair up the wrong messages. ``final``: backward is over, whatever is missing is not coming.
        while self._next < len(self.buckets) and (final or self._complete(self.buckets[self._next])):
            self._send(self.buckets[self._next])
            self._next += 1

    @torch.no_grad()
    def _send(self, b: Bucket) -> None:
        # One copy of the bucket's gradients into a flat tensor; torch DDP saves it with
        # gradient_as_bucket_view=True, where .grad is a view into the bucket.
        b.flat = torch.cat(self._payload(b))
        b.work = comm.all_reduce(b.flat, counter=self.counter, async_op=True)  # returns at once: backward goes on

    def _payload(self, b: Bucket) -> list[torch.Tensor]:
        params = [self.params[i] for i in b.params]
        return [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        """Send the buckets still waiting, wait for every all-reduce, and write the averaged gradients back."""
        if not self._sync or not self.buckets:  # no_sync, or nothing trainable
            return
        self._send_ready(final=True)
        for b in self.buckets:
            b.work.wait()
        for b in self.buckets:
            self._unpack(b)
        self._reset()

    def _unpack(self, b: Bucket) -> None:
        for i, g in zip(b.params, b.flat.split(b.sizes)):
            _set_grad(self.params[i], g.div_(self.world))   # the sum over ranks, then the mean

    def _reset(self) -> None:
        self._next = 0                                      # the next bucket to send
        for b in self.buckets:
            b.ready, b.work = set(), None

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
