"""ZeRO stages 1 and 2 by hand (``ZeroOptimizer``), ZeRO-3 as FSDP2, and their formulas (chapter 09).

Data parallelism keeps the parameters, gradients and optimizer state whole on every rank. ZeRO (Rajbhandari et
al. 2020) splits them over the N ranks: each rank keeps the optimizer state for its own 1/N slice of one flat
parameter buffer (stage 1) and, at stage 2, only that slice of the gradient. One step, on every rank:

1. backward, then **reduce-scatter** the gradient: rank r receives slice r of the sum. Stage 1 does it in
   ``step``; stage 2 bucket by bucket from the gradient hooks (``_on_grad``, ``_reduce``), during the backward;
2. the inner optimizer (Adam, ...) updates slice r only: its state exists for 1/N of the model;
3. **all-gather** the updated slices (``step``): every rank has the new weights.

For Ψ parameters each collective sends (N-1)/N x Ψ elements per rank: 2(N-1)/N x Ψ, DDP's all-reduce. Stage 3
(FSDP2, ``shard_fsdp2``) gathers the weights again for the backward: 1.5x. ``zero_buckets`` holds the flat
layout; ``agreement`` the opt-in layer for ranks that do not all run the same backward.
"""

from __future__ import annotations

import collections
import functools
import math

import torch
import torch.distributed as dist
from torch import nn

from course_lib import memory
from course_lib.models import TinyTransformer
from course_lib.parallel import collectives as comm
from course_lib.parallel.sharding.zero_buckets import DEFAULT_BUCKET_MB, FlatLayout

# Reduce-scatters left running while the backward goes on (0: wait for each at once). Each holds its bucket's full
# gradient (and, on gloo, a copy of it) until it is done: the peak grows by that per one in flight.
MAX_IN_FLIGHT = 1

# Optimizers whose update of one element depends only on that element (plus shared scalars such as the step count):
# a flat slice's update is bit for bit the whole tensor's. Those that look at a whole tensor (LAMB's trust ratio,
# Adafactor's factored moments, LBFGS's line search) would change meaning.
ELEMENTWISE_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
                          torch.optim.RAdam, torch.optim.Adagrad, torch.optim.RMSprop, torch.optim.Rprop)


class ZeroOptimizer:
    """ZeRO stage 1 or 2 around an element-wise optimizer, on every rank: ``zero_grad(); loss.backward(); step()``.
    The trainable parameters become views of one flat buffer cut into buckets (``zero_buckets``), synchronised
    from rank 0 here; buffers (BatchNorm's statistics) are not. The inner optimizer sees this rank's slice of
    each bucket, ``bucket.piece``. Every rank must run the same backwards: ``agreement.GuardedZeroOptimizer`` lets
    them differ.
    """

    def __init__(self, model: nn.Module, optimizer_cls: type[torch.optim.Optimizer], stage: int,
                 bucket_cap_mb: float = DEFAULT_BUCKET_MB, max_in_flight: int = MAX_IN_FLIGHT, **optimizer_kwargs):
        self.params = _check_arguments(model, optimizer_cls, stage, max_in_flight)
        self.stage, self.max_in_flight = stage, max_in_flight
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.layout = FlatLayout(self.params, self.world, bucket_cap_mb)
        self.buckets = self.layout.buckets
        self.flat_params = self.layout.flatten()  # the model's parameters are views of it now
        dist.broadcast(self.flat_params, src=0)  # rank 0's weights everywhere, as DDP (once per run)
        # the inner optimizer updates this rank's pieces in place, which writes straight into the weights
        self.optimizer = optimizer_cls(self.layout.cut_pieces(self.flat_params, self.rank), **optimizer_kwargs)
        self.flat_grads: torch.Tensor | None = None  # stage 1's full gradient buffer
        self._reduced = False  # stage 1: this step's gradient is reduced already (by clip_grad_norm_)
        self._pending: collections.deque = collections.deque()  # stage 2's reduce-scatters in flight, oldest first
        self._new_backward()
        if stage == 2:  # runs right after autograd has written the parameter's gradient
            for i, p in enumerate(self.params):
                p.register_post_accumulate_grad_hook(functools.partial(self._on_grad, i))

    # ----- what the training loop calls --------------------------------------------------------------------------

    def zero_grad(self) -> None:
        """Start a step's gradients. Stage 1: every ``.grad`` a zeroed view of one flat buffer that autograd adds into
        (as DDP's ``gradient_as_bucket_view``): the full gradient, held to the end of ``step``. Stage 2: no parameter
        ``.grad`` at all, only this rank's slices (zeroed, 1/N of the gradient); the hooks fill one bucket at a time.
        """
        self._reduced = False
        self._new_backward()
        if self.stage == 1:
            self._collect().zero_()
            return
        for p in self.params:
            p.grad = None
        self.optimizer.zero_grad(set_to_none=False)  # this rank's slices, kept (a sum over micro-batches)

    @torch.no_grad()
    def step(self) -> None:
        """Stage 1: reduce-scatter the gradient. Both: update this rank's slices, all-gather the parameters."""
        self._reduce_gradients()
        self.optimizer.step()  # this rank's slices only
        # all-gather, bucket by bucket: every rank receives every updated slice, (N-1)/N x the bucket's bytes.
        # The input is a copy of our slice because the output region contains it.
        for b in self.buckets:
            comm.all_gather(b.region(self.flat_params), b.piece.detach().clone())
        self._reduced = False

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale the averaged gradient to a global L2 norm of at most ``max_norm``; return the norm before. Call it
        between the backward(s) and ``step``: only the optimizer sees the averaged gradient (stage 1 reduce-scatters
        here; torch's ``clip_grad_norm_`` on the model would clip each rank's own). Every element lies in one rank's
        slice (the padding is zero): the squared norm is the sum over ranks of the slices', one all-reduce."""
        if not max_norm > 0:
            raise ValueError(f"max_norm must be positive, got {max_norm!r}")
        self._reduce_gradients()
        grads = [b.piece.grad for b in self.buckets if b.piece.grad is not None]
        sq = torch.zeros(1, dtype=torch.float64, device=self.flat_params.device) + sum(g.double().pow(2).sum()
                                                                                        for g in grads)
        dist.all_reduce(sq)  # the sum of every rank's slices
        norm = sq.sqrt().to(self.flat_params.dtype)
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)  # as torch.nn.utils.clip_grad_norm_
        for g in grads:
            g.mul_(coef)
        return norm[0]

    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds now: ``params``, ``grads``, ``optimizer`` (after ``step``: the ZeRO picture)."""
        grads = ([self.flat_grads] if self.stage == 1 and self.flat_grads is not None
                 else [b.piece.grad for b in self.buckets if b.piece.grad is not None])
        return {"params": memory.tensor_bytes(self.flat_params), "grads": sum(memory.tensor_bytes(g) for g in grads),
                "optimizer": memory.optimizer_state_bytes(self.optimizer)}

    # ----- stage 2: each bucket reduce-scattered as soon as the backward has filled it --------------------------

    def _on_grad(self, i: int, p: torch.Tensor) -> None:
        """Move parameter ``i``'s new gradient into its bucket's buffer and free it; send every bucket now full."""
        if not self._in_backward:  # the first gradient of this backward
            self._begin_backward()
        if i in self._done:
            return self._arrived_twice(i, p)
        k, offset = self.layout.bucket_of[i]
        if self._grads[k] is None:  # a bucket's full gradient exists only while the backward fills it
            self._grads[k] = self.buckets[k].zeros()
        self._grads[k][offset:offset + p.numel()].add_(p.grad.reshape(-1))
        p.grad = None  # it is in the bucket now: no rank ever holds the whole gradient
        self._mark(i)

    def _mark(self, i: int) -> None:
        """Parameter ``i`` is done in this backward; send every complete bucket, in order (the same on all ranks)."""
        self._done.add(i)
        self._arrived[self.layout.bucket_of[i][0]] += 1
        while self._next < len(self.buckets) and self._arrived[self._next] == len(self.buckets[self._next].params):
            self._reduce(self._next)

    @torch.no_grad()
    def _reduce(self, k: int) -> None:
        """Start bucket ``k``'s reduce-scatter without waiting; wait only for those beyond ``max_in_flight``."""
        full = self._grads[k] if self._grads[k] is not None else self.buckets[k].zeros()  # none arrived here
        self._grads[k] = None
        out = torch.empty(self.buckets[k].slots, dtype=full.dtype, device=full.device)
        work = comm.reduce_scatter(out, full, async_op=True)  # (N-1)/N x the bucket's bytes
        self._pending.append((self.buckets[k], out, full, work))  # ``full`` must live until the collective is done
        self._next += 1
        while len(self._pending) > self.max_in_flight:  # the backward computes on while the newest travel
            self._finish()

    @torch.no_grad()
    def _finish(self) -> None:
        """Wait for the oldest reduce-scatter; add this rank's averaged slice to its piece's ``.grad``."""
        bucket, out, _, work = self._pending.popleft()
        work.wait()
        out.div_(self.world)  # the mean over ranks, as DDP: the gradient of the whole batch's mean loss
        bucket.piece.grad = out if bucket.piece.grad is None else bucket.piece.grad.add_(out)  # a sum of means

    def _begin_backward(self) -> None:  # have ``_end_backward`` run when this backward ends
        self._in_backward = True
        # No public API runs code at the end of a backward; DDP and FSDP2 queue their own callbacks this same way.
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _end_backward(self) -> None:
        """Send the buckets still incomplete (a parameter unused here: zeros for it), wait for all of them."""
        while self._next < len(self.buckets):
            self._reduce(self._next)
        while self._pending:
            self._finish()
        self._new_backward()

    def _arrived_twice(self, i: int, p: torch.Tensor) -> None:
        raise RuntimeError(f"a gradient of parameter {i} arrived twice in one backward: it takes part in the backward "
                           "twice (reentrant checkpointing?); use torch.utils.checkpoint with use_reentrant=False")

    def _new_backward(self) -> None:  # forget the last backward: no bucket filled, none sent, none in flight
        self._grads: list[torch.Tensor | None] = [None] * len(self.buckets)  # each bucket's while it fills
        self._arrived = [0] * len(self.buckets)  # per bucket: its parameters done in this backward
        self._done: set[int] = set()             # the parameters done in this backward
        self._next = 0                           # the next bucket to send
        self._in_backward = False
        self._pending.clear()

    # ----- stage 1: the whole gradient, reduce-scattered in step ------------------------------------------------

    def _collect(self) -> torch.Tensor:
        """The flat gradient buffer, every ``.grad`` a view of it (one made elsewhere copied in, ``None``: zeros)."""
        if self.flat_grads is None:
            self.flat_grads = torch.zeros_like(self.flat_params)
        for i, p in enumerate(self.params):
            slot = self.layout.view(self.flat_grads, i)
            if p.grad is None or p.grad.data_ptr() != slot.data_ptr():  # zero_grad skipped, or unused: zeros
                slot.copy_(p.grad.reshape(-1)) if p.grad is not None else slot.zero_()
                p.grad = slot.view_as(p)
        return self.flat_grads

    @torch.no_grad()
    def _reduce_gradients(self) -> None:
        """Stage 1, once per step: reduce-scatter the full gradient into each piece's ``.grad``, its slice of the mean
        (stage 2 did it during the backward)."""
        if self.stage == 2 or self._reduced:
            return
        grads = self._collect()
        for b in self.buckets:
            out = torch.empty(b.slots, dtype=grads.dtype, device=grads.device)
            comm.reduce_scatter(out, b.region(grads))  # (N-1)/N x the bucket's bytes
            # the full buffer stays (stage 1 does not shard it); this rank's slice becomes the mean
            b.piece.grad = b.shard(grads, self.rank).copy_(out.div_(self.world))
        self._reduced = True


def shard_bounds(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    """``[start, end)`` of rank ``rank``'s slice of a flat vector of ``numel`` elements. Every rank gets
    ``ceil(numel / world_size)`` slots (equal slots: what reduce-scatter and all-gather need); the vector is padded
    to ``world_size`` times that, so the last ranks' slices may hold fewer real elements (or none)."""
    if numel < 0 or world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need numel >= 0 and 0 <= rank < world_size: got {numel=}, {world_size=}, {rank=}")
    size = math.ceil(numel / world_size)
    start = min(rank * size, numel)
    return start, min(start + size, numel)


def zero_bytes_per_rank(num_params: float, world_size: int, stage: int, param_bytes: float = 4,
                        grad_bytes: float = 4, optimizer_bytes: float = 8) -> dict[str, float]:
    """Bytes of ``params``, ``grads`` and ``optimizer`` state one rank holds under ZeRO ``stage`` (0 = DDP).

    ``memory.zero_memory`` for each part alone. The defaults are fp32 Adam as trained on the CPU here, 4 + 4 + 8
    (two fp32 moments) bytes per parameter; the paper's mixed-precision Adam is ``2, 2, 12``.
    """
    def part(p: float, g: float, o: float) -> float:
        return memory.zero_memory(num_params, world_size, stage, o, param_bytes=p, grad_bytes=g)
    return {"params": part(param_bytes, 0, 0), "grads": part(0, grad_bytes, 0),
            "optimizer": part(0, 0, optimizer_bytes)}


def shard_fsdp2(model: TinyTransformer, reshard_after_forward: bool = True,
                mp_policy: object | None = None, offload_policy: object | None = None) -> TinyTransformer:
    """ZeRO-3 with FSDP2: one ``fully_shard`` per block, for the embedding and the head, then the root.

    Inner modules first, so each gets its own all-gather group and the root only collects what is left (here
    nothing). Passing ``reshard_after_forward`` to the root as well overrides FSDP2's heuristic of keeping the
    root's parameters between forward and backward, so every parameter is gathered twice per step, as in the
    paper's stage 3. ``mp_policy``: a ``MixedPrecisionPolicy``; ``offload_policy``: an ``OffloadPolicy``
    (``CPUOffloadPolicy()`` keeps the shards on the host, chapter 11), the same for every part.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard

    kwargs = {"reshard_after_forward": reshard_after_forward, "mp_policy": mp_policy or MixedPrecisionPolicy(),
              "offload_policy": offload_policy or OffloadPolicy()}  # fully_shard's own defaults
    for part in [model.embed, *model.blocks, model.head]:
        fully_shard(part, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _check_arguments(model: nn.Module, optimizer_cls: type, stage: int, max_in_flight: int) -> list[nn.Parameter]:
    """``ZeroOptimizer``'s arguments, checked; returns the model's trainable parameters."""
    if stage not in (1, 2):
        raise ValueError(f"ZeroOptimizer has stages 1 and 2, got {stage}; for stage 3 use fsdp.fully_shard")
    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, ELEMENTWISE_OPTIMIZERS)):
        raise ValueError(f"{optimizer_cls!r} is not an element-wise optimizer: flat slices would change its meaning")
    if not (isinstance(max_in_flight, int) and max_in_flight >= 0):
        raise ValueError(f"max_in_flight must be an int >= 0, got {max_in_flight!r}")
    if not dist.is_initialized():
        raise RuntimeError("ZeroOptimizer needs a process group: call torch.distributed.init_process_group first")
    params = [p for p in model.parameters() if p.requires_grad]
    if not params or len({(p.dtype, p.device) for p in params}) > 1:
        raise ValueError("the flat buffer needs trainable parameters, all of one dtype and device")
    return params
