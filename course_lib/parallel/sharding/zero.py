"""ZeRO stages 1 and 2 written by hand, ZeRO-3 as FSDP2, and their meters (chapter 09).

Data parallelism keeps a full copy of the parameters, the gradients and the
optimizer state on every rank. ZeRO (Rajbhandari et al. 2020, "ZeRO: Memory
Optimizations Toward Training Trillion Parameter Models") removes the copies:

- stage 1 shards the optimizer state: rank r keeps the state, and does the
  update, for its own 1/N slice of the parameters;
- stage 2 shards the gradients too: each rank keeps only its slice of the
  averaged gradient;
- stage 3 shards the parameters too (here: PyTorch's FSDP2, ``fully_shard``).

Communication per step, per rank, for P bytes of parameters on N ranks (ring
algorithm): DDP all-reduces the gradients, 2(N-1)/N x P. Stages 1 and 2
reduce-scatter the gradients and all-gather the updated parameters:
(N-1)/N x P twice, the same 1x. Stage 3 all-gathers the parameters for the
forward and again for the backward, plus the reduce-scatter: 1.5x.

``ZeroOptimizer`` is the teaching version, in four pieces that each read alone:

- ``zero_buckets``: the flat layout, which parameters share which bucket and
  each rank's slice of every bucket;
- ``zero_stage1``: the full gradient, reduce-scattered in ``step``;
- ``zero_stage2``: each bucket reduce-scattered from the gradient hooks as soon
  as the backward has filled it, this rank keeping only its slice;
- ``zero_agreement``: what every rank agrees on, so that none is left waiting
  in a collective (a skipped backward, an error on one rank, clipping's norm).

This module puts them together (the update of this rank's slices, then the
all-gather of the parameters) and holds the chapter's formulas
(``shard_bounds``, ``zero_bytes_per_rank``), a meter of when its buckets leave (``bucket_timeline``),
ZeRO-3 as FSDP2 (``shard_fsdp2``) and the meters for torch's wrappers.
"""

from __future__ import annotations

import collections
import contextlib
import math
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from course_lib import memory
from course_lib.parallel import collectives as comm
from course_lib.parallel.sharding.agreement import Flags, global_norm
from course_lib.parallel.sharding.agreement import MISUSE, flag_group  # noqa: F401 (importable from here, as before)
from course_lib.parallel.sharding.zero_buckets import DEFAULT_BUCKET_MB, FlatLayout
from course_lib.parallel.sharding.zero_buckets import bucket_sizes  # noqa: F401 (the planner and the tests import it here)
from course_lib.parallel.sharding.zero_stage1 import Stage1Gradients
from course_lib.parallel.sharding.zero_stage2 import MAX_IN_FLIGHT, Stage2Gradients
from course_lib.models import TinyTransformer

# Optimizers whose update of one element depends only on that element's
# parameter, gradient and state (plus shared scalars such as the step count).
# For these, updating a flat slice gives bit-for-bit the update of the whole
# tensor. Optimizers that look at a whole tensor (LAMB's trust ratio,
# Adafactor's factored moments, LBFGS's line search) would change meaning.
ELEMENTWISE_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
    torch.optim.RAdam, torch.optim.Adagrad, torch.optim.RMSprop, torch.optim.Rprop,
)


def shard_bounds(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    """``[start, end)`` of rank ``rank``'s slice of a flat vector of ``numel`` elements.

    Every rank gets ``ceil(numel / world_size)`` slots; the vector is padded to
    ``world_size`` times that, so the last ranks' slices may hold fewer real
    elements (or none). Equal slots are what reduce-scatter and all-gather need.
    """
    if numel < 0 or world_size < 1:
        raise ValueError(f"need numel >= 0 and world_size >= 1, got numel={numel}, world_size={world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    size = math.ceil(numel / world_size)
    start = min(rank * size, numel)
    return start, min(start + size, numel)


def zero_bytes_per_rank(num_params: float, world_size: int, stage: int, param_bytes: float = 4,
                        grad_bytes: float = 4, optimizer_bytes: float = 8) -> dict[str, float]:
    """Bytes of ``params``, ``grads`` and ``optimizer`` state one rank holds under ZeRO ``stage`` (0 = DDP).

    ``memory.zero_memory`` for each part alone (the other parts' bytes set to 0).
    The defaults are fp32 Adam as trained on the CPU here: 4 + 4 + 8 (two fp32
    moments) bytes per parameter; mixed-precision Adam is ``2, 2, 12``.
    """
    def part(p: float, g: float, o: float) -> float:
        return memory.zero_memory(num_params, world_size, stage, o, param_bytes=p, grad_bytes=g)
    return {"params": part(param_bytes, 0, 0), "grads": part(0, grad_bytes, 0),
            "optimizer": part(0, 0, optimizer_bytes)}


class ZeroOptimizer:
    """ZeRO stage 1 or 2 around any element-wise optimizer: ``zero_grad(); loss.backward(); step()``.

    Every rank runs the same model on its own part of the batch. The model's
    parameters become views into one flat buffer (``zero_buckets``); the inner
    optimizer sees only this rank's slice of each bucket, so the optimizer
    state exists for 1/N of the model. ``grads`` is stage 1's or stage 2's
    gradient handling (``zero_stage1.Stage1Gradients``,
    ``zero_stage2.Stage2Gradients``). ``counter`` counts the bytes this rank
    sends (``comm`` ring formulas): a reduce-scatter per bucket per backward
    (stage 2) or per step (stage 1), an all-gather per bucket per step. The
    flag all-reduces that keep the ranks in step (a few bytes each) are
    counted in ``control_calls`` only.

    Only trainable parameters are sharded and synchronised (from rank 0, at
    construction); buffers such as BatchNorm's running statistics are not.
    """

    def __init__(self, model: nn.Module, optimizer_cls: type[torch.optim.Optimizer], stage: int,
                 bucket_cap_mb: float = DEFAULT_BUCKET_MB, max_in_flight: int = MAX_IN_FLIGHT, **optimizer_kwargs):
        if stage not in (1, 2):
            raise ValueError(f"ZeroOptimizer implements stages 1 and 2, got {stage}; stage 3 shards the "
                             "parameters as well: use torch.distributed.fsdp.fully_shard (chapter 09)")
        if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, ELEMENTWISE_OPTIMIZERS)):
            names = ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)
            raise ValueError(f"optimizer_cls must be an element-wise torch optimizer class ({names}); got "
                             f"{optimizer_cls!r}. Flat shards would change the meaning of per-tensor optimizers.")
        if not (isinstance(max_in_flight, int) and max_in_flight >= 0):
            raise ValueError(f"max_in_flight must be an int >= 0 (0: wait for each reduce-scatter at once), "
                             f"got {max_in_flight!r}")
        if not dist.is_initialized():
            raise RuntimeError("ZeroOptimizer needs a process group: call launch.init_distributed() first "
                               "(or torch.distributed.init_process_group)")
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the model has no trainable parameters")
        dtypes, devices = {p.dtype for p in self.params}, {p.device for p in self.params}
        if len(dtypes) > 1 or len(devices) > 1:
            raise ValueError(f"all parameters must share one dtype and device for the flat buffer; got "
                             f"dtypes {dtypes} and devices {devices}")
        self.stage, self.max_in_flight = stage, max_in_flight
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.layout = FlatLayout(self.params, self.world, bucket_cap_mb)
        self.buckets = self.layout.buckets
        self.flat_params = self.layout.flatten()  # the model's parameters are views of it now
        # Start from rank 0's weights everywhere, as DDP does (not counted: once per run, not per step).
        comm.broadcast(self.flat_params, src=0)
        # the inner optimizer updates this rank's pieces in place, which writes straight into the weights
        self.optimizer = optimizer_cls(self.layout.cut_pieces(self.flat_params, self.rank), **optimizer_kwargs)
        self.counter = comm.ByteCounter()
        self.flags = Flags()  # the small all-reduces that keep the ranks in step
        self.grads: Stage1Gradients | Stage2Gradients = (
            Stage1Gradients(self.layout, self.flat_params, self.rank, self.world, self.counter) if stage == 1
            else Stage2Gradients(self.layout, self.world, self.counter, self.flags, max_in_flight))

    @property
    def param_groups(self) -> list[dict]:
        """The inner optimizer's parameter groups (to change the learning rate)."""
        return self.optimizer.param_groups

    @property
    def control_calls(self) -> int:
        """The flag all-reduces so far (``zero_agreement.Flags``; their bytes are not in ``counter``)."""
        return self.flags.calls

    @property
    def flat_grads(self) -> torch.Tensor | None:
        """Stage 1's full gradient buffer (``None`` until the first ``zero_grad`` or ``step``; always under stage 2)."""
        return self.grads.flat_grads if isinstance(self.grads, Stage1Gradients) else None

    @property
    def _pending(self) -> collections.deque:
        """Stage 2's reduce-scatters in flight, oldest first (stage 1 never has any)."""
        return self.grads._pending if isinstance(self.grads, Stage2Gradients) else collections.deque()

    @property
    def _flag_group(self) -> dist.ProcessGroup | None:
        """The group the flags travel on (``zero_agreement.flag_group``)."""
        return self.flags.group

    def zero_grad(self) -> None:
        """Start a new step's gradients.

        Stage 1: every parameter gets a zeroed ``.grad`` that is a view into one
        flat gradient buffer, which autograd accumulates into (as DDP's
        ``gradient_as_bucket_view``): the full gradient, held to the end of ``step``.
        Stage 2: no parameter ``.grad`` at all, only this rank's slices (zeroed,
        1/N of the gradient); the hooks fill and reduce one bucket at a time.
        """
        self.grads.zero_grad()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale the averaged gradient so that its global L2 norm is at most ``max_norm``; return the norm.

        ``torch.nn.utils.clip_grad_norm_(model.parameters())`` cannot see that
        gradient (stage 2: there is none to see; stage 1: each rank's own,
        unaveraged one; stage 1 raises if it is used). Call this between the
        backward(s) and ``step``: stage 1 reduce-scatters here instead of in
        ``step``. Costs one all-reduce of one number (``zero_agreement.global_norm``).
        """
        if not max_norm > 0:
            raise ValueError(f"max_norm must be positive, got {max_norm!r}")
        self.grads.sync()
        grads = [b.piece.grad for b in self.buckets if b.piece.grad is not None]
        norm = global_norm(grads, self.counter, like=self.flat_params)
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)  # as torch.nn.utils.clip_grad_norm_
        for g in grads:
            g.mul_(coef)
        return norm[0]

    @torch.no_grad()
    def step(self) -> None:
        """Stage 1: reduce-scatter the full gradient. Both: update this rank's slices, all-gather the parameters.

        Stage 2 first takes part in any backward another rank ran and this one did not (with zeros).
        """
        # 2. reduce-scatter: every piece's .grad becomes this rank's slice of the mean over ranks. Stage 1 does it
        # now (zero_stage1); stage 2 did it during the backward and joins any backward it skipped (zero_stage2).
        self.grads.before_step()
        # 3. the inner optimizer sees this rank's slices only: its state is 1/N of the model's
        self.optimizer.step()
        # 4. all-gather, bucket by bucket: every rank receives every updated slice, (N-1)/N x P sent.
        # The input is a copy of our slice because the output region contains it.
        for b in self.buckets:
            comm.all_gather(b.region(self.flat_params), b.piece.detach().clone(), counter=self.counter)
        self.grads.after_step()  # stage 1: zero_grad will check that nobody changed the gradients since

    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds now: ``params``, ``grads``, ``optimizer`` (after ``step``: the ZeRO picture)."""
        return {"params": memory.tensor_bytes(self.flat_params), "grads": self.grads.held_bytes(),
                "optimizer": memory.optimizer_state_bytes(self.optimizer)}


@dataclass
class BucketTimeline:
    """When ZeroOptimizer's buckets leave, seen from each parameter's gradient as the backward computes it."""

    stage: int
    buckets: int
    names: list[str]                 # parameters in the order their gradients were computed
    reduce_scatters_seen: list[int]  # reduce-scatters already issued when that gradient was computed
    after_backward: int              # reduce-scatters issued by the end of the backward
    full_grad_bytes_after_backward: int  # bytes of the parameters' .grad left after the backward
    slice_grad_bytes: int            # bytes of this rank's averaged gradient slices after the backward


def bucket_timeline(zopt: ZeroOptimizer, model: nn.Module, loss_fn: Callable[[], torch.Tensor]) -> BucketTimeline:
    """One backward of ``loss_fn()`` under ``zopt``: how many buckets had left as each gradient was computed.

    Stage 2 reduce-scatters a bucket from the hooks as soon as it is full, stage 1 only in ``step``. The caller
    then calls ``zopt.step()`` on every rank (it takes part in the same collectives).
    """
    names: list[str] = []
    seen: list[int] = []
    for name, p in model.named_parameters():
        def computed(grad: torch.Tensor, name: str = name) -> None:  # before autograd accumulates it
            names.append(name)
            seen.append(zopt.counter.calls.get("reduce_scatter", 0))
        p.register_hook(computed)
    zopt.zero_grad()
    loss_fn().backward()
    return BucketTimeline(
        stage=zopt.stage, buckets=len(zopt.buckets), names=names, reduce_scatters_seen=seen,
        after_backward=zopt.counter.calls.get("reduce_scatter", 0),
        full_grad_bytes_after_backward=memory.grad_bytes(model),
        slice_grad_bytes=sum(memory.tensor_bytes(b.piece.grad) for b in zopt.buckets if b.piece.grad is not None))


# ----- ZeRO-3 as torch's FSDP2, and meters for torch's own data-parallel wrappers ------------


def shard_fsdp2(model: TinyTransformer, reshard_after_forward: bool = True,
                mp_policy: object | None = None, offload_policy: object | None = None) -> TinyTransformer:
    """ZeRO-3 with FSDP2: one ``fully_shard`` per block, for the embedding and the head, then the root.

    Order matters: inner modules first, so each gets its own all-gather group
    and the root only collects what is left (here nothing). Passing
    ``reshard_after_forward`` to the root as well overrides FSDP2's heuristic
    of keeping the root's parameters between forward and backward, so every
    parameter is gathered twice per step, as in the paper's stage 3.
    ``mp_policy``: a ``MixedPrecisionPolicy``; ``offload_policy``: an
    ``OffloadPolicy`` (``CPUOffloadPolicy()`` keeps the shards on the host,
    chapter 11), the same for every part.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard

    kwargs: dict = {"reshard_after_forward": reshard_after_forward}
    for name, policy, kind in (("mp_policy", mp_policy, MixedPrecisionPolicy),
                               ("offload_policy", offload_policy, OffloadPolicy)):
        if policy is not None:
            if not isinstance(policy, kind):
                raise ValueError(f"{name} must be a {kind.__name__}, got {type(policy).__name__}")
            kwargs[name] = policy
    parts: list[nn.Module] = [model.embed, *model.blocks, model.head]
    for part in parts:
        fully_shard(part, **kwargs)
    fully_shard(model, **kwargs)
    return model


def local_bytes(t: torch.Tensor | None) -> int:
    """Bytes this rank stores for ``t``: a DTensor's local shard, else the tensor itself."""
    if t is None:
        return 0
    if hasattr(t, "to_local"):  # a DTensor (FSDP2's sharded parameters, gradients and Adam moments)
        t = t.to_local()
    return memory.tensor_bytes(t)


def held_bytes(model: nn.Module, optimizer: object) -> dict[str, int]:
    """Bytes of ``params``, ``grads`` and ``optimizer`` state this rank holds (DTensor-aware)."""
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps the local one in .optim
    return {"params": sum(local_bytes(p) for p in model.parameters()),
            "grads": sum(local_bytes(p.grad) for p in model.parameters()),
            "optimizer": sum(local_bytes(v) for s in inner.state.values() for v in s.values() if torch.is_tensor(v))}


def held_bytes_by_device(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """The same bytes (parameters, gradients, optimizer state) by the device type that holds them, ``cpu`` or
    ``cuda``: where FSDP2's ``CPUOffloadPolicy`` keeps a rank's shards (chapter 11)."""
    out = {"cpu": 0, "cuda": 0}
    states = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    for t in [*model.parameters(), *(p.grad for p in model.parameters() if p.grad is not None), *states]:
        kind = (t.to_local() if hasattr(t, "to_local") else t).device.type
        out[kind] = out.get(kind, 0) + local_bytes(t)
    return out


def count_fsdp_traffic(model: nn.Module, counter: comm.ByteCounter) -> int:
    """Route every FSDP2 all-gather and reduce-scatter in ``model`` through ``comm``, counting the bytes.

    Uses FSDP2's public hooks ``set_custom_all_gather`` / ``set_custom_reduce_scatter``;
    the collectives themselves are unchanged (same ``torch.distributed`` calls).
    Returns how many FSDP modules were instrumented.
    """
    from torch.distributed.fsdp import FSDPModule
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
    except ImportError as exc:  # the interface lives in a private module; say so if it moves
        raise RuntimeError(f"this torch ({torch.__version__}) has no FSDP2 custom-collective interface") from exc

    class CountingAllGather(AllGather):
        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            return comm.all_gather(output_tensor, input_tensor, counter=counter, group=group, async_op=async_op)

    class CountingReduceScatter(ReduceScatter):
        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            return comm.reduce_scatter(output_tensor, input_tensor, op=op, counter=counter, group=group,
                                       async_op=async_op)

    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise ValueError("no FSDP2 module in the model: call fully_shard on it first")
    for m in modules:
        m.set_custom_all_gather(CountingAllGather())
        m.set_custom_reduce_scatter(CountingReduceScatter())
    return len(modules)


@contextlib.contextmanager
def count_broadcasts(counter: comm.ByteCounter) -> Iterator[None]:
    """Count every ``dist.broadcast`` made inside the block (ZeroRedundancyOptimizer's parameter sync)."""
    original = dist.broadcast

    def counted(tensor, src, *args, **kwargs):
        counter.add("broadcast", comm.ring_factor("broadcast", dist.get_world_size()) * comm.nbytes(tensor))
        return original(tensor, src, *args, **kwargs)

    dist.broadcast = counted
    try:
        yield
    finally:
        dist.broadcast = original
