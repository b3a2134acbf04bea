"""ZeRO stages 1 and 2 written by hand, and the meters for ZeRO-3 as FSDP2 (chapter 08).

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

``ZeroOptimizer`` is the teaching version. The parameters live in one flat
buffer cut into buckets (``ddp.assign_buckets``: backward order, at most
``bucket_cap_mb`` each), each padded to a multiple of N; rank r owns slice r
of every bucket. Stage 1 keeps a full gradient buffer and reduce-scatters it,
bucket by bucket, in ``step``. Stage 2 starts each bucket's reduce-scatter
from the gradient hooks as soon as the backward has produced it, without
waiting for it (``max_in_flight`` of them, as FSDP2), keeps only its
own averaged slice and frees the rest, so the full gradient never exists at
once and the communication overlaps the rest of the backward (DeepSpeed's and
FSDP's way).

What keeps every rank in step (a rank left waiting in a collective on NCCL
waits for ever, or for the process group's timeout): every backward starts
with a small all-reduce of flags in which each rank says whether it is in a
backward; a rank that skipped its backward (or whose micro-batch reached no
trainable parameter, so no hook fired) answers from ``step`` and takes part in
that backward's reduce-scatters with zeros, as torch's ``Join`` does for DDP.
Every backward ends with a second small all-reduce: the ranks that saw an
error (a gradient that arrived twice) and the buckets that got a gradient
anywhere; an error is raised on every rank together, never on one alone.
"""

from __future__ import annotations

import collections
import itertools
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from course_lib import memory
from course_lib.distributed import comm
from course_lib.distributed.ddp import MiB, assign_buckets

# Optimizers whose update of one element depends only on that element's
# parameter, gradient and state (plus shared scalars such as the step count).
# For these, updating a flat slice gives bit-for-bit the update of the whole
# tensor. Optimizers that look at a whole tensor (LAMB's trust ratio,
# Adafactor's factored moments, LBFGS's line search) would change meaning.
ELEMENTWISE_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
    torch.optim.RAdam, torch.optim.Adagrad, torch.optim.RMSprop, torch.optim.Rprop,
)
DEFAULT_BUCKET_MB = 25.0  # PyTorch DDP's bucket_cap_mb (MiB)
# Stage 2: reduce-scatters left running while the backward goes on (0: wait for each at once). Each holds its
# bucket's full gradient (and, on gloo, a copy of it) until it is done: the peak grows by that per one in flight.
MAX_IN_FLIGHT = 1
MISUSE = ("(clip_grad_norm_ on the model?). Under ZeRO each rank holds its own, unaveraged gradient until step() "
          "reduces it, and afterwards the mean only in its own slice: clip (or read the norm) with "
          "ZeroOptimizer.clip_grad_norm_(max_norm) between the backward and step(); scale the loss to scale it")


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


def bucket_sizes(params: list[torch.Tensor], bucket_cap_mb: float = DEFAULT_BUCKET_MB) -> list[int]:
    """Bytes of each bucket ``ZeroOptimizer`` (and ``ddp.BucketedDDP``) makes of ``params``, before padding."""
    nbytes = [memory.tensor_bytes(p) for p in params]
    return [sum(nbytes[i] for i in b) for b in assign_buckets(nbytes, bucket_cap_mb * MiB)]


def flag_group() -> dist.ProcessGroup | None:
    """The group ``ZeroOptimizer``'s flags travel on, as CPU tensors: the default one where it has gloo (gloo, or
    launch's ``cpu:gloo,cuda:nccl``), else a gloo group of the same ranks, made for them (collectively: every rank
    builds its optimizer together, as the broadcast of the weights needs anyway).

    The flags are read on the host as soon as they are summed. Summed on an NCCL
    group, on the GPU, reading them would make the host wait for everything the
    device has queued: in the first gradient hook, in the middle of the backward,
    and again at its end. Through gloo it costs a round trip between the hosts.
    """
    if "gloo" in str(dist.get_backend()).lower():
        return None
    return dist.new_group(backend="gloo")


@dataclass(eq=False)
class _Bucket:
    """Parameters ``params`` (indices) at ``offsets`` inside a region of N x ``slots`` elements of the flat buffer."""

    params: list[int]
    offsets: list[int]      # where each parameter starts, relative to the region
    start: int              # where the region starts in the flat buffer
    slots: int              # elements per rank: the region is padded to N x slots
    piece: nn.Parameter | None = None  # this rank's slice of the region: what the inner optimizer updates
    grad: torch.Tensor | None = None   # stage 2: the region's gradient while the backward fills it
    arrived: int = 0        # stage 2: parameters done in this backward (their gradient in ``grad``, or unused)
    used: bool = False      # stage 2: a gradient of one of them arrived on this rank in this backward
    fresh: bool = False     # stage 2: ``piece.grad`` was None before this backward's reduction

    def region(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.start:self.start + self.slots * dist.get_world_size()]

    def zeros(self) -> torch.Tensor:
        """A zero gradient for the whole region."""
        return self.piece.new_zeros(self.slots * dist.get_world_size())

    @property
    def complete(self) -> bool:
        return self.arrived == len(self.params)


class ZeroOptimizer:
    """ZeRO stage 1 or 2 around any element-wise optimizer: ``zero_grad(); loss.backward(); step()``.

    Every rank runs the same model on its own part of the batch. The model's
    parameters become views into one flat buffer; the inner optimizer sees
    only this rank's slice of each bucket, so the optimizer state exists for
    1/N of the model. ``counter`` counts the bytes this rank sends (``comm``
    ring formulas): a reduce-scatter per bucket per backward, an all-gather
    per bucket per step.

    Stage 2 under gradient accumulation reduce-scatters after *every*
    micro-batch: a rank keeps only its slice, so the rest of a micro-batch's
    gradient must leave before the next backward (chapter 08). Its
    parameters' ``.grad`` are ``None`` after the backward: the gradient exists
    only as the slices, one per bucket (``self.buckets[b].piece.grad``).
    A parameter unused on some rank contributes zeros there; it counts as
    arrived as soon as the backward starts, so its bucket does not wait for
    the end (DDP's ``find_unused_parameters``). A bucket no rank got a
    gradient for keeps ``piece.grad = None``, so Adam skips it; a parameter
    unused everywhere but sharing a bucket with used ones gets a zero
    gradient, which Adam's momentum still turns into a step.

    Clipping: each rank holds only its slice of the averaged gradient, so
    ``torch.nn.utils.clip_grad_norm_(model.parameters())`` cannot see the
    gradient (stage 2: there is none to see; stage 1: each rank's own,
    unaveraged one); use ``clip_grad_norm_`` here, between the backward and
    ``step``. Stage 1 raises, in ``step`` or in the next ``zero_grad``, when
    the gradients were changed in place after the backward or after ``step``. ``counter`` counts the training traffic; the
    two flag all-reduces per backward and one per stage-2 ``step`` (a few
    bytes each) are counted in ``control_calls`` only.

    Only trainable
    parameters are sharded and synchronised (from rank 0, at construction);
    buffers such as BatchNorm's running statistics are not.
    """

    def __init__(self, model: nn.Module, optimizer_cls: type[torch.optim.Optimizer], stage: int,
                 bucket_cap_mb: float = DEFAULT_BUCKET_MB, max_in_flight: int = MAX_IN_FLIGHT, **optimizer_kwargs):
        if stage not in (1, 2):
            raise ValueError(f"ZeroOptimizer implements stages 1 and 2, got {stage}; stage 3 shards the "
                             "parameters as well: use torch.distributed.fsdp.fully_shard (chapter 08)")
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
        # The layout: bucket after bucket, each padded to a multiple of N (at most N-1 zeros,
        # which get zero gradients and zero updates); rank r owns slice r of every bucket.
        self.buckets: list[_Bucket] = []
        self.bucket_of: dict[int, tuple[int, int]] = {}  # parameter index -> (its bucket, its offset there)
        start = 0
        for idx in assign_buckets([memory.tensor_bytes(p) for p in self.params], bucket_cap_mb * MiB):
            sizes = [self.params[i].numel() for i in idx]
            offsets = list(itertools.accumulate(sizes[:-1], initial=0))
            self.bucket_of.update({i: (len(self.buckets), o) for i, o in zip(idx, offsets)})
            self.buckets.append(_Bucket(idx, offsets, start, math.ceil(sum(sizes) / self.world)))
            start += self.buckets[-1].slots * self.world
        flat = torch.zeros(start, dtype=self.params[0].dtype, device=self.params[0].device)
        with torch.no_grad():
            for i, p in enumerate(self.params):
                self._view(flat, i).copy_(p.reshape(-1))
                p.data = self._view(flat, i).view_as(p)
        # Start from rank 0's weights everywhere, as DDP does (not counted: once per run, not per step).
        comm.broadcast(flat, src=0)
        for b in self.buckets:  # views: the inner optimizer's in-place update writes straight into the weights
            b.piece = nn.Parameter(b.region(flat)[self.rank * b.slots:(self.rank + 1) * b.slots])
        self.flat_params = flat
        self.optimizer = optimizer_cls([b.piece for b in self.buckets], **optimizer_kwargs)
        self.flat_grads: torch.Tensor | None = None  # stage 1's full gradient buffer
        self.counter = comm.ByteCounter()
        self.control_calls = 0        # the small all-reduces of flags that keep the ranks in step (uncounted bytes)
        self._flag_group = flag_group()
        self._next = 0                # stage 2: the next bucket to reduce (in order: every rank the same)
        self._in_backward = False
        self._arrived = [False] * len(self.params)  # stage 2: done in this backward (arrived, or unused)
        self._pending: collections.deque = collections.deque()  # stage 2: (bucket, output, input, work) in flight
        self._error: str | None = None  # stage 2: what went wrong on this rank in this backward
        self._reduced = False         # stage 1: the gradient is already reduced this step (by clip_grad_norm_)
        self._grad_version: int | None = None  # stage 1: the gradient buffer's version after the last accumulation
        with torch.enable_grad():  # each parameter's AccumulateGrad node: does this backward reach it?
            self._grad_accs = [p.view_as(p).grad_fn.next_functions[0][0] for p in self.params]
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook(i) if stage == 2 else self._seen(i))
                       for i, p in enumerate(self.params)]

    def _view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter ``i``'s elements in a flat buffer laid out as the parameters are."""
        k, o = self.bucket_of[i]
        at = self.buckets[k].start + o
        return flat[at:at + self.params[i].numel()]

    @property
    def param_groups(self) -> list[dict]:
        """The inner optimizer's parameter groups (to change the learning rate)."""
        return self.optimizer.param_groups

    def zero_grad(self) -> None:
        """Start a new step's gradients.

        Stage 1: every parameter gets a zeroed ``.grad`` that is a view into one
        flat gradient buffer, which autograd accumulates into (as DDP's
        ``gradient_as_bucket_view``): the full gradient, held to the end of ``step``.
        Stage 2: no parameter ``.grad`` at all, only this rank's slices (zeroed,
        1/N of the gradient); the hooks fill and reduce one bucket at a time.
        """
        if self.stage == 2:
            for p in self.params:
                p.grad = None
            for b in self.buckets:
                if b.piece.grad is not None:
                    b.piece.grad.zero_()
            self._reset_round()
            return
        if self._grad_version is not None and self.flat_grads._version != self._grad_version:
            self._grad_version = None
            raise RuntimeError(f"the gradients were changed in place after step() {MISUSE}")
        # a new step: nothing reduced yet (clip_grad_norm_ may have reduced the last one, whose step() was skipped)
        self._reduced, self._grad_version = False, None
        if self.flat_grads is None:
            self.flat_grads = torch.zeros_like(self.flat_params)
        else:
            self.flat_grads.zero_()
        for i, p in enumerate(self.params):
            p.grad = self._view(self.flat_grads, i).view_as(p)

    # ----- stage 2: reduce-scatter each bucket as soon as the backward has filled it --------------

    def _hook(self, i: int):
        def on_grad(p: torch.Tensor) -> None:  # runs right after autograd accumulated p.grad
            k, o = self.bucket_of[i]
            b = self.buckets[k]
            if not self._in_backward:  # first gradient of this backward
                self._begin_backward()
            if self._arrived[i]:  # noted here, raised on every rank together at the end of the backward
                self._error = self._error or (
                    f"a gradient of parameter {i} arrived twice in one backward (or after the backward had "
                    "counted it unused): it takes part in the backward twice (reentrant checkpointing?); use "
                    "torch.utils.checkpoint with use_reentrant=False")
                p.grad = None
                return
            if b.grad is None:  # the bucket's buffer exists only while the backward fills it
                b.grad = b.zeros()
            b.grad[o:o + p.numel()].add_(p.grad.reshape(-1))
            p.grad = None  # its full gradient is in the bucket now: free it
            b.used = True
            self._mark(i)
        return on_grad

    def _mark(self, i: int) -> None:
        """Parameter ``i`` is done in this backward; start every bucket that is complete now, in order."""
        self._arrived[i] = True
        self.buckets[self.bucket_of[i][0]].arrived += 1
        while self._next < len(self.buckets) and self.buckets[self._next].complete:
            self._reduce(self.buckets[self._next])

    def _begin_backward(self) -> None:
        """Agree with the other ranks that a backward runs; count the parameters it will not reach as done."""
        self._in_backward = True
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        self._agree([1])  # ranks that skipped their backward answer from step() and join with zeros
        for i, acc in enumerate(self._grad_accs):
            if not self._arrived[i] and not torch._C._will_engine_execute_node(acc):
                self._mark(i)  # unused here: zeros, and its bucket need not wait for the end

    def _end_of_backward(self) -> None:
        """Start what is left (buckets with a parameter unused here: zeros), finish all, agree on errors."""
        for i in range(len(self.params)):
            if not self._arrived[i]:
                self._mark(i)
        while self._pending:
            self._finish()
        errors_and_used = self._agree([0] * self.world + [int(b.used) for b in self.buckets],
                                      at=self.rank if self._error else None)
        errors, used = errors_and_used[:self.world], errors_and_used[self.world:]
        for b, u in zip(self.buckets, used):
            if u == 0 and b.fresh:  # no rank had a gradient for it: no gradient at all, so Adam skips it
                b.piece.grad = None
        mine = self._error
        self._reset_round()
        if any(errors):
            ranks = [r for r, e in enumerate(errors) if e]
            raise RuntimeError(f"ZeroOptimizer: the backward failed on rank(s) {ranks}; every rank raises this "
                               f"error together" + (f": {mine}" if mine else ""))

    def _agree(self, flags: list[int], at: int | None = None) -> list[int]:
        """Sum small integer flags over the ranks (blocking; ``at``: set flag ``at`` to 1 on this rank)."""
        t = torch.tensor(flags, dtype=torch.int32)  # host: read back at once, see flag_group
        if at is not None:
            t[at] = 1
        dist.all_reduce(t, group=self._flag_group)
        self.control_calls += 1
        return t.tolist()

    def _reset_round(self) -> None:
        for b in self.buckets:
            b.grad, b.arrived, b.used, b.fresh = None, 0, False, False
        self._arrived = [False] * len(self.params)
        self._pending.clear()
        self._next, self._in_backward, self._error = 0, False, None

    def _join(self) -> None:
        """In ``step``: take part, with zero gradients, in every backward another rank is still running."""
        while self._agree([0])[0] > 0:  # some rank is in a backward this one skipped
            self._in_backward = True
            self._end_of_backward()  # every parameter unused here: zeros for every bucket

    @torch.no_grad()
    def _reduce(self, b: _Bucket) -> None:
        """Start bucket ``b``'s reduce-scatter; wait only for those beyond ``max_in_flight``, oldest first."""
        full = b.grad if b.grad is not None else b.zeros()  # no gradient of it arrived on this rank
        out = torch.empty(b.slots, dtype=full.dtype, device=full.device)
        work = comm.reduce_scatter(out, full, counter=self.counter, async_op=True)  # (N-1)/N x the bucket's bytes
        self._pending.append((b, out, full, work))  # ``full`` must live until the collective is done
        b.grad = None
        self._next += 1
        while len(self._pending) > self.max_in_flight:
            self._finish()

    @torch.no_grad()
    def _finish(self) -> None:
        """Wait for the oldest reduce-scatter; add this rank's averaged slice to its ``piece.grad``; free the rest."""
        b, out, _, work = self._pending.popleft()
        work.wait()
        out.div_(self.world)  # the mean over ranks, as DDP: the gradient of the whole batch's mean loss
        b.fresh = b.piece.grad is None
        b.piece.grad = out if b.piece.grad is None else b.piece.grad.add_(out)  # accumulation: a sum of means

    # ----- stage 1: notice gradients changed in place between the backward and step --------------

    def _seen(self, i: int):
        def on_grad(p: torch.Tensor) -> None:
            if self.flat_grads is not None and p.grad is not None and p.grad.data_ptr() == self._view(
                    self.flat_grads, i).data_ptr():
                self._grad_version = self.flat_grads._version  # views share their base's version counter
        return on_grad

    # ----- clipping ---------------------------------------------------------------------------

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale the averaged gradient so that its global L2 norm is at most ``max_norm``; return the norm.

        Every element of the gradient lives in exactly one rank's slice (the padding
        is zero), so the squared norm is the sum over ranks of the squared norms of
        the slices: one all-reduce of one number. Call it after the backward(s) and
        before ``step``; stage 1 reduce-scatters here instead of in ``step``.
        """
        if not max_norm > 0:
            raise ValueError(f"max_norm must be positive, got {max_norm!r}")
        if self.stage == 1:
            self._reduce_stage1()
        else:
            self._join()
        grads = [b.piece.grad for b in self.buckets if b.piece.grad is not None]
        sq = torch.zeros(1, dtype=torch.float64, device=self.flat_params.device)
        for g in grads:
            sq += g.double().pow(2).sum()
        comm.all_reduce(sq, counter=self.counter)  # the sum of every rank's slices
        norm = sq.sqrt().to(self.flat_params.dtype)
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)  # as torch.nn.utils.clip_grad_norm_
        for g in grads:
            g.mul_(coef)
        return norm[0]

    # ----- the step ---------------------------------------------------------------------------

    def _collect_grads(self) -> torch.Tensor:
        """Stage 1's flat gradient buffer, copying in any ``.grad`` that is not already a view of it."""
        if self.flat_grads is None:
            self.flat_grads = torch.zeros_like(self.flat_params)
        for i, p in enumerate(self.params):
            slot = self._view(self.flat_grads, i)
            if p.grad is None:
                slot.zero_()  # unused this step (or zero_grad was skipped): contributes nothing
            elif p.grad.data_ptr() != slot.data_ptr():
                slot.copy_(p.grad.reshape(-1))
                p.grad = slot.view_as(p)
        return self.flat_grads

    @torch.no_grad()
    def _reduce_stage1(self) -> None:
        """Stage 1: reduce-scatter the full gradient, bucket by bucket (once per step)."""
        if self._reduced:
            return
        if self._grad_version is not None and self.flat_grads._version != self._grad_version:
            self._grad_version = None  # said once
            raise RuntimeError(f"the gradients were changed in place after the backward {MISUSE}")
        grads = self._collect_grads()
        for b in self.buckets:
            out = torch.empty(b.slots, dtype=grads.dtype, device=grads.device)
            comm.reduce_scatter(out, b.region(grads), counter=self.counter)
            # keep the full buffer (stage 1 does not shard it); this rank's slice becomes the mean
            mine = b.region(grads)[self.rank * b.slots:(self.rank + 1) * b.slots]
            b.piece.grad = mine.copy_(out.div_(self.world))
        self._reduced = True

    @torch.no_grad()
    def step(self) -> None:
        """Stage 1: reduce-scatter the full gradient. Both: update this rank's slices, all-gather the parameters.

        Stage 2 first takes part in any backward another rank ran and this one did not (with zeros).
        """
        if self.stage == 1:
            self._reduce_stage1()
            self._reduced, self._grad_version = False, None
        else:
            self._join()
        # the inner optimizer sees this rank's slices only: its state is 1/N of the model's
        self.optimizer.step()
        # all-gather, bucket by bucket: every rank receives every updated slice, (N-1)/N x P sent.
        # The input is a copy of our slice because the output region contains it.
        for b in self.buckets:
            comm.all_gather(b.region(self.flat_params), b.piece.detach().clone(), counter=self.counter)
        if self.stage == 1 and self.flat_grads is not None:  # zero_grad checks nobody changed them since
            self._grad_version = self.flat_grads._version

    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds now: ``params``, ``grads``, ``optimizer`` (after ``step``: the ZeRO picture)."""
        if self.stage == 1:
            grads = memory.tensor_bytes(self.flat_grads) if self.flat_grads is not None else 0
        else:  # stage 2: the slices (under stage 1 they are views of flat_grads)
            grads = sum(memory.tensor_bytes(b.piece.grad) for b in self.buckets if b.piece.grad is not None)
        return {"params": memory.tensor_bytes(self.flat_params), "grads": grads,
                "optimizer": memory.optimizer_state_bytes(self.optimizer)}


# ----- meters for torch's own data-parallel wrappers ----------------------------------------


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
