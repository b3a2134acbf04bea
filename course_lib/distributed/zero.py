"""ZeRO stages 1 and 2 written by hand, and the meters for ZeRO-3 as FSDP2 (chapter 08).

Data parallelism keeps a full copy of the parameters, the gradients and the
optimizer state on every rank. ZeRO (Rajbhandari et al. 2020, "ZeRO: Memory
Optimizations Toward Training Trillion Parameter Models") removes the copies:

- stage 1 shards the optimizer state: rank r keeps the state, and does the
  update, for its own 1/N slice of the flat parameter vector;
- stage 2 shards the gradients too: each rank keeps only its slice of the
  averaged gradient;
- stage 3 shards the parameters too (here: PyTorch's FSDP2, ``fully_shard``).

Communication per step, per rank, for P bytes of parameters on N ranks (ring
algorithm): DDP all-reduces the gradients, 2(N-1)/N x P. Stages 1 and 2
reduce-scatter the gradients and all-gather the updated parameters:
(N-1)/N x P twice, the same 1x. Stage 3 all-gathers the parameters for the
forward and again for the backward, plus the reduce-scatter: 1.5x.

``ZeroOptimizer`` is the teaching version: one flat buffer, one
reduce-scatter and one all-gather per step, after the backward. DeepSpeed and
FSDP2 reduce-scatter bucket by bucket *during* the backward, so the full
gradient never exists at once; here it does, briefly (see ``zero_grad``).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from course_lib.distributed import comm
from course_lib.memory import optimizer_state_bytes, tensor_bytes

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


def zero_bytes_per_rank(num_params: int, world_size: int, stage: int, param_bytes: int = 4,
                        grad_bytes: int = 4, optimizer_bytes: int = 8) -> dict[str, float]:
    """Bytes of parameters, gradients and optimizer state one rank holds under ZeRO ``stage`` (0 = DDP).

    The defaults are fp32 Adam as trained on the CPU here: 4 + 4 + 8 (two fp32
    moments) bytes per parameter. Mixed-precision Adam is ``2, 2, 12`` (fp32
    master weights, momentum and variance; Rajbhandari et al. 2020, section 3).
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0 (plain data parallel), 1, 2 or 3, got {stage}")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    n, d = float(num_params), float(world_size)
    return {"params": param_bytes * n / (d if stage >= 3 else 1),
            "grads": grad_bytes * n / (d if stage >= 2 else 1),
            "optimizer": optimizer_bytes * n / (d if stage >= 1 else 1)}


class ZeroOptimizer:
    """ZeRO stage 1 or 2 around any element-wise optimizer: ``zero_grad(); loss.backward(); step()``.

    Every rank runs the same model on its own part of the batch. The model's
    parameters become views into one flat buffer (padded to a multiple of N);
    rank r's slice of it, ``self.shard``, is the only parameter the inner
    optimizer sees, so the optimizer state exists for 1/N of the model.
    ``counter`` counts the bytes this rank sends in ``step`` (``comm`` ring formulas).

    Only trainable parameters are sharded and synchronised (from rank 0, at
    construction); buffers such as BatchNorm's running statistics are not,
    unlike DDP, which broadcasts them before every forward.
    """

    def __init__(self, model: nn.Module, optimizer_cls: type[torch.optim.Optimizer], stage: int,
                 **optimizer_kwargs):
        if stage not in (1, 2):
            raise ValueError(f"ZeroOptimizer implements stages 1 and 2, got {stage}; stage 3 shards the "
                             "parameters as well: use torch.distributed.fsdp.fully_shard (chapter 08)")
        if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, ELEMENTWISE_OPTIMIZERS)):
            names = ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)
            raise ValueError(f"optimizer_cls must be an element-wise torch optimizer class ({names}); got "
                             f"{optimizer_cls!r}. Flat shards would change the meaning of per-tensor optimizers.")
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
        self.stage = stage
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.numel = sum(p.numel() for p in self.params)
        self.shard_size = math.ceil(self.numel / self.world)
        # (offset, numel) of each parameter inside the flat vector
        self.slots: list[tuple[int, int]] = []
        offset = 0
        for p in self.params:
            self.slots.append((offset, p.numel()))
            offset += p.numel()

        # One flat buffer; each parameter becomes a view of its slot. The padding
        # (at most N-1 elements) stays zero: zero gradient, zero update.
        flat = torch.zeros(self.shard_size * self.world, dtype=self.params[0].dtype, device=self.params[0].device)
        with torch.no_grad():
            for p, (o, n) in zip(self.params, self.slots):
                flat[o:o + n].copy_(p.reshape(-1))
                p.data = flat[o:o + n].view_as(p)
        # Start from rank 0's weights everywhere, as DDP does (not counted: once per run, not per step).
        comm.broadcast(flat, src=0)
        self.flat_params = flat
        lo = self.rank * self.shard_size
        # A view too: the inner optimizer's in-place update writes straight into the model's weights.
        self.shard = nn.Parameter(flat[lo:lo + self.shard_size])
        self.optimizer = optimizer_cls([self.shard], **optimizer_kwargs)
        self.flat_grads: torch.Tensor | None = None
        self.counter = comm.ByteCounter()

    @property
    def param_groups(self) -> list[dict]:
        """The inner optimizer's parameter groups (to change the learning rate)."""
        return self.optimizer.param_groups

    def zero_grad(self) -> None:
        """Give every parameter a zeroed gradient that is a view into one flat gradient buffer.

        Autograd then accumulates straight into the buffer (as DDP's
        ``gradient_as_bucket_view``), so ``step`` needs no copy. Under stage 2
        this full buffer lives from here to the end of ``step``: the price of
        reducing once after the backward instead of bucket by bucket during it.
        """
        if self.flat_grads is None:
            self.flat_grads = torch.zeros_like(self.flat_params)
        else:
            self.flat_grads.zero_()
        for p, (o, n) in zip(self.params, self.slots):
            p.grad = self.flat_grads[o:o + n].view_as(p)
        self.shard.grad = None

    def _collect_grads(self) -> torch.Tensor:
        """The flat gradient buffer, copying in any ``.grad`` that is not already a view of it."""
        if self.flat_grads is None:
            self.flat_grads = torch.zeros_like(self.flat_params)
        for p, (o, n) in zip(self.params, self.slots):
            slot = self.flat_grads[o:o + n]
            if p.grad is None:
                slot.zero_()  # unused this step (or zero_grad was skipped): contributes nothing
            elif p.grad.data_ptr() != slot.data_ptr():
                slot.copy_(p.grad.reshape(-1))
                p.grad = slot.view_as(p)
        return self.flat_grads

    @torch.no_grad()
    def step(self) -> None:
        """Average the gradients into each rank's shard, update the shard, gather the parameters."""
        grads = self._collect_grads()
        lo = self.rank * self.shard_size
        # 1. reduce-scatter: rank r receives the sum over ranks of its own slice, (N-1)/N x P sent
        shard_grad = torch.empty(self.shard_size, dtype=grads.dtype, device=grads.device)
        comm.reduce_scatter(shard_grad, grads, counter=self.counter)
        shard_grad.div_(self.world)  # the mean over ranks, as DDP: the gradient of the whole batch's mean loss
        if self.stage == 1:
            # keep the full gradient buffer (stage 1 does not shard it); the shard's grad is its slice
            grads[lo:lo + self.shard_size].copy_(shard_grad)
            self.shard.grad = grads[lo:lo + self.shard_size]
        else:
            # stage 2: keep only the averaged slice; drop the full buffer now (P bytes freed)
            self.shard.grad = shard_grad
            for p in self.params:
                p.grad = None
            self.flat_grads = None
        # 2. update: the inner optimizer sees one parameter of P/N elements, so its state is 1/N of the model's
        self.optimizer.step()
        # 3. all-gather: every rank receives every updated slice, (N-1)/N x P sent.
        # The input is a copy of our slice because the output buffer contains it.
        comm.all_gather(self.flat_params, self.shard.detach().clone(), counter=self.counter)

    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds now: ``params``, ``grads``, ``optimizer`` (after ``step``: the ZeRO picture)."""
        grads = tensor_bytes(self.flat_grads) if self.flat_grads is not None else 0
        if self.stage == 2 and self.shard.grad is not None:
            grads += tensor_bytes(self.shard.grad)  # (under stage 1 it is a view of flat_grads)
        return {"params": tensor_bytes(self.flat_params), "grads": grads,
                "optimizer": optimizer_state_bytes(self.optimizer)}


# ----- meters for torch's own data-parallel wrappers ----------------------------------------


def local_bytes(t: torch.Tensor | None) -> int:
    """Bytes this rank stores for ``t``: a DTensor's local shard, else the tensor itself."""
    if t is None:
        return 0
    if hasattr(t, "to_local"):  # a DTensor (FSDP2's sharded parameters, gradients and Adam moments)
        t = t.to_local()
    return tensor_bytes(t)


def held_bytes(model: nn.Module, optimizer: object) -> dict[str, int]:
    """Bytes of ``params``, ``grads`` and ``optimizer`` state this rank holds (DTensor-aware)."""
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps the local one in .optim
    return {"params": sum(local_bytes(p) for p in model.parameters()),
            "grads": sum(local_bytes(p.grad) for p in model.parameters()),
            "optimizer": sum(local_bytes(v) for s in inner.state.values() for v in s.values() if torch.is_tensor(v))}


def counting_allreduce_hook(counter: comm.ByteCounter):
    """A DDP communication hook that all-reduces each gradient bucket through ``comm`` and counts it.

    ``ddp.register_comm_hook(None, counting_allreduce_hook(counter))``. It
    averages like DDP's default hook, synchronously (no overlap: a meter, not a speed-up).
    """
    # No annotations on hook: DDP checks them against the real classes, and
    # ``from __future__ import annotations`` would turn them into strings.
    def hook(state, bucket):
        buf = bucket.buffer()
        comm.all_reduce(buf, counter=counter)
        buf.div_(dist.get_world_size())
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(buf)
        return fut
    return hook


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
