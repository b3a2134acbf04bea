"""The DDP wrappers checked against one process, counted and timed (chapter 07; ``workers.ddp_compare`` runs them).

Every function runs on every rank: ``compare_scenario`` (an ``EdgeCaseNet`` scenario trained by each wrapper and by
one process on the whole batch), ``time_wrappers`` (step times, and bytes sent by the ring formula and as handed to
``dist.all_reduce``), ``no_sync_counts`` (all-reduces of k micro-batches with and without ``no_sync()``) and
``batchnorm_checks`` (per-rank BatchNorm against ``SyncBatchNorm2dByHand``, and torch's on GPUs).
"""

from __future__ import annotations

import contextlib
import copy
import statistics
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

from course_lib.parallel import collectives as comm
from course_lib.experiments.clock import clock_for, slowest_rank_s
from course_lib.experiments.comm_spies import handed_bytes
from course_lib.experiments.counting import ByteCounter, counted
from course_lib.parallel.data_parallel.ddp import BucketedDDP, NaiveDDP
from course_lib.parallel.data_parallel.ddp_dynamic import DynamicBucketedDDP
from course_lib.experiments.results import WorkerResult
from course_lib.parallel.data_parallel.sync_batchnorm import SyncBatchNorm2dByHand
from course_lib.models import MLP

SMALL_CAP_MB = 4096 / 2**20  # 4 KiB: about one bucket per weight of this small model, so buckets leave mid-backward


def allreduce_hook() -> Callable:
    """A DDP communication hook: torch DDP's default all-reduce (average), through ``dist.all_reduce``.

    ``torch_ddp.register_comm_hook(None, allreduce_hook())``: torch DDP's own all-reduce runs inside its C++
    reducer, which ``counting.counted`` cannot see; this one it counts, one call per bucket.
    """
    # no annotations on purpose: torch DDP checks them, and `from __future__ import annotations` makes them strings
    def hook(state, bucket):  # (None, dist.GradBucket) -> torch.futures.Future[torch.Tensor]
        t = bucket.buffer()
        t.div_(dist.get_world_size())  # torch DDP's default hook divides before summing, too
        work = dist.all_reduce(t, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])
    return hook



class EdgeCaseNet(nn.Module):
    """A small MLP with the cases a DDP wrapper must handle.

    ``frozen`` has ``requires_grad=False``; ``block`` runs twice per forward;
    with ``reentrant`` its second use sits in a reentrant checkpoint (its
    parameters then accumulate twice per backward); with ``aux`` a second head
    exists that is used only when ``use_aux`` is passed.
    """

    def __init__(self, d_in: int = 32, d: int = 64, classes: int = 10, reentrant: bool = False, aux: bool = False):
        super().__init__()
        self.inp = nn.Linear(d_in, d)
        self.frozen = nn.Linear(d, d).requires_grad_(False)
        self.block = nn.Sequential(nn.Linear(d, d), nn.Tanh())
        self.head = nn.Linear(d, classes)
        self.aux = nn.Linear(d, classes) if aux else None
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor, use_aux: bool = False) -> torch.Tensor:
        h = torch.tanh(self.frozen(torch.tanh(self.inp(x))))
        h = self.block(h)
        h = checkpoint(self.block, h, use_reentrant=True) if self.reentrant else self.block(h)
        # aux runs before head, so backward reaches it last: its bucket (shared with head) has
        # often left already when aux's gradient arrives on a step that uses it
        extra = self.aux(h) if (use_aux and self.aux is not None) else None
        out = self.head(h)
        return out if extra is None else out + extra


SCENARIOS = {  # name: (model kwargs, torch DDP kwargs, use_aux(step))
    "frozen_shared": (dict(), dict(), lambda s: False),
    "reentrant": (dict(reentrant=True), dict(static_graph=True), lambda s: False),
    "unused": (dict(aux=True), dict(find_unused_parameters=True), lambda s: s % 2 == 1),
}
KINDS = ("naive", "bucketed", "dynamic", "torch")
# BucketedDDP assumes at most one hook call per parameter and backward: the reentrant checkpoint shows
# what goes wrong without DynamicBucketedDDP. In "unused" every rank leaves the aux head out alike (the
# bet of NaiveDDP and BucketedDDP): it keeps grad None in both, as in one process.
SUPPORTED = {"naive": tuple(SCENARIOS), "bucketed": ("frozen_shared", "unused"), "dynamic": tuple(SCENARIOS),
             "torch": tuple(SCENARIOS)}


@dataclass
class WrapperRun(WorkerResult):
    """One wrapper in one scenario, against the single process."""

    grad_diff: float        # max |gradient - reference| over the steps
    param_diff: float       # max |parameter - reference| after the steps
    none_match: bool        # the same parameters without a gradient as in the single process
    buckets: int | None = None
    max_hook_calls: int | None = None   # DynamicBucketedDDP: the most hook calls of one parameter per backward
    resent: int | None = None           # DynamicBucketedDDP: buckets sent again after a late gradient


@dataclass
class Sent(WorkerResult):
    """What one wrapper sent in one (second) step."""

    bytes: float            # counting.counted: the ring formula 2(N-1)/N per byte all-reduced
    messages: int           # counted all-reduce calls
    handed_bytes: int       # bytes of every tensor handed to dist.all_reduce (a spy: what the group really got)
    handed_calls: int


@dataclass
class Timing(WorkerResult):
    ms: dict[str, float]    # median ms per step, each step as slow as the slowest rank
    clock: str              # what measured them
    sent: dict[str, Sent]
    grad_bytes: int
    params: int
    tensors: int
    batch_per_rank: int
    cap_mb: float | None


@dataclass
class NoSync(WorkerResult):
    k: int                              # micro-batches per optimizer step
    steps: int
    every_micro_batch: dict[str, int]   # all-reduce calls without no_sync, per wrapper
    no_sync: dict[str, int]             # with no_sync on the first k - 1 micro-batches
    buckets: dict[str, int]             # all-reduce calls of one synchronised backward
    grad_diff: dict[str, float]         # the accumulated gradient, with against without no_sync


@dataclass
class BatchNormResult(WorkerResult):
    """Per variant ("per_rank_bn", "sync_bn_by_hand", on GPUs "torch_sync_bn"): gradient and buffer differences."""

    world: int
    batch_per_rank: int
    grad_diff: dict[str, float]             # max |gradient - one process on the whole batch|
    running_mean_spread: dict[str, float]   # how far apart the ranks' running means drifted
    reference_grad_norm: float


def labelled(g: torch.Generator, lead: tuple[int, ...], features: tuple[int, ...],
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random inputs of shape ``lead + features`` and class labels (0-9) of shape ``lead``, drawn from ``g``.

    Seeded with ``seed`` the draw is one batch every rank shares (then sliced); with ``seed + rank``, each rank's own.
    """
    return torch.randn(*lead, *features, generator=g).to(device), torch.randint(0, 10, lead, generator=g).to(device)


def _max_diff(pairs: Iterable[tuple[torch.Tensor | None, torch.Tensor | None]]) -> float:
    """The largest ``|a - b|`` over the pairs where both exist (0.0 if none), in the tensors' own dtype."""
    return max(((a - b).abs().max().item() for a, b in pairs if a is not None and b is not None), default=0.0)


def _wrap(kind: str, model: nn.Module, ddp_kwargs: dict, cap_mb: float | None, counted_hook: bool = False):
    """``cap_mb=None``: each wrapper's defaults (25 MiB buckets, the first one 1 MiB); ``counted_hook``: torch DDP's
    all-reduces through ``allreduce_hook``, where ``counting.counted`` sees them."""
    cap = {} if cap_mb is None else dict(bucket_cap_mb=cap_mb)
    if kind == "naive":
        return NaiveDDP(model)
    if kind == "bucketed":
        return BucketedDDP(model, **cap)
    if kind == "dynamic":
        return DynamicBucketedDDP(model, **cap)
    if kind == "dynamic_first_call":  # the mistake that learning the counts avoids: one call per parameter
        n = sum(p.requires_grad for p in model.parameters())
        return DynamicBucketedDDP(model, hook_calls=[1] * n, **cap)
    if kind == "torch":
        # torch DDP keeps its small first bucket only when bucket_cap_mb is left at its default
        ddp = DDP(model, **ddp_kwargs, **cap)
        if counted_hook:
            ddp.register_comm_hook(None, allreduce_hook())
        return ddp
    raise ValueError(kind)


def _backward(model: nn.Module, x: torch.Tensor, y: torch.Tensor, micro_batches: int = 1, sync: bool = True,
              **forward_kw) -> None:
    """The backward of the loss (its share of ``micro_batches``); with ``sync``, the gradients then averaged over
    the ranks (our wrappers' ``finish_gradient_synchronization``; torch DDP averages inside backward)."""
    (F.cross_entropy(model(x, **forward_kw), y) / micro_batches).backward()
    if sync and hasattr(model, "finish_gradient_synchronization"):
        model.finish_gradient_synchronization()


def compare_scenario(name: str, rank: int, world: int, batch: int, steps: int, seed: int,
                     device: torch.device) -> dict[str, WrapperRun]:
    """Train each wrapper ``steps`` SGD-momentum steps; max |difference| to the single-process reference."""
    model_kw, ddp_kw, use_aux = SCENARIOS[name]
    X, Y = labelled(torch.Generator().manual_seed(seed), (steps, world * batch), (32,), device)
    torch.manual_seed(seed)
    base = EdgeCaseNet(**model_kw).to(device)

    def train(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> list[list]:
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
        history = []
        for s in range(steps):
            opt.zero_grad(set_to_none=True)
            _backward(model, inputs[s], targets[s], use_aux=use_aux(s))
            history.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
            opt.step()
        return history

    ref_model = copy.deepcopy(base)
    ref = train(ref_model, X, Y)
    mine = slice(rank * batch, (rank + 1) * batch)
    out = {}
    for kind in (*KINDS, "dynamic_first_call"):
        if kind == "dynamic_first_call" and name != "reentrant":
            continue
        wrapped = _wrap(kind, copy.deepcopy(base), ddp_kw, SMALL_CAP_MB)
        pairs = [pair for h, r in zip(train(wrapped, X[:, mine], Y[:, mine]), ref) for pair in zip(h, r)]
        run = out[kind] = WrapperRun(_max_diff(pairs), _max_diff(zip(wrapped.module.parameters(),
                                                                     ref_model.parameters())),
                                     none_match=all((a is None) == (b is None) for a, b in pairs))
        if isinstance(wrapped, BucketedDDP):
            run.buckets = len(wrapped.buckets)
        if isinstance(wrapped, DynamicBucketedDDP):
            run.max_hook_calls, run.resent = max(wrapped.expected), wrapped.resent
    return out


def time_wrappers(world: int, rank: int, batch: int, in_features: int, hidden: list[int], rounds: int, steps: int,
                  cap_mb: float | None, seed: int, device: torch.device) -> Timing:
    """Step time of each wrapper on an MLP, and the bytes each sends per step."""
    torch.manual_seed(seed)
    base = MLP(in_features, tuple(hidden)).to(device)
    x, y = labelled(torch.Generator().manual_seed(seed + rank), (batch,), (in_features,), device)
    clock = clock_for(device)
    models = {k: _wrap(k, copy.deepcopy(base), {}, cap_mb) for k in KINDS}
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in models.items()}

    def train(kind: str) -> None:
        for _ in range(steps):
            opts[kind].zero_grad(set_to_none=True)
            _backward(models[kind], x, y)
            opts[kind].step()
    times: dict[str, list[float]] = {k: [] for k in KINDS}
    for r in range(rounds + 1):  # round 0 warms up (and teaches DynamicBucketedDDP its hook counts)
        for kind in KINDS:  # the wrappers in turns, round by round: fair on a noisy machine
            seconds, _ = slowest_rank_s(lambda: train(kind), clock, device)
            if r > 0:
                times[kind].append(seconds / steps * 1e3)
    sent = {}
    for kind in KINDS:  # count the second step: both DDPs set up buckets in the first
        counter = ByteCounter()
        model = _wrap(kind, copy.deepcopy(base), {}, cap_mb, counted_hook=True)  # its broadcast: not counted
        for _ in range(2):
            counter.reset()
            model.zero_grad(set_to_none=True)
            with handed_bytes("all_reduce") as handed, counted(counter):
                _backward(model, x, y)
        sent[kind] = Sent(counter.bytes, counter.calls.get("all_reduce", 0), sum(handed), len(handed))
    return Timing({k: statistics.median(v) for k, v in times.items()}, clock.name, sent,
                  grad_bytes=sum(comm.nbytes(p) for p in base.parameters()),
                  params=sum(p.numel() for p in base.parameters()), tensors=len(list(base.parameters())),
                  batch_per_rank=batch, cap_mb=cap_mb)


def no_sync_counts(rank: int, world: int, batch: int, k: int, steps: int, seed: int, device: torch.device) -> NoSync:
    """All-reduce messages for ``steps`` optimizer steps of ``k`` micro-batches, with and without no_sync."""
    torch.manual_seed(seed)
    base = EdgeCaseNet().to(device)
    g = torch.Generator().manual_seed(seed + rank)
    micro = [labelled(g, (batch,), (32,), device) for _ in range(k)]
    out = NoSync(k, steps, {}, {}, {}, {})
    for kind in ("torch", "bucketed", "dynamic"):
        last_grads: dict[bool, list[torch.Tensor]] = {}
        for use_no_sync in (False, True):
            counter = ByteCounter()
            model = _wrap(kind, copy.deepcopy(base), {}, SMALL_CAP_MB, counted_hook=True)
            for step in range(steps + 1):
                if step == 1:
                    counter.reset()  # count from the second step: both DDPs set up their buckets in the first
                for j, (x, y) in enumerate(micro):
                    last = j == k - 1
                    ctx = model.no_sync() if (use_no_sync and not last) else contextlib.nullcontext()
                    with ctx, counted(counter):  # / k: the mean over the k micro-batches
                        _backward(model, x, y, micro_batches=k, sync=not use_no_sync or last)
                last_grads[use_no_sync] = [p.grad.clone() for p in model.parameters() if p.grad is not None]
                model.zero_grad(set_to_none=True)
            (out.no_sync if use_no_sync else out.every_micro_batch)[kind] = counter.calls.get("all_reduce", 0)
        out.buckets[kind] = out.no_sync[kind] // steps
        # the same averaged gradient either way: skipping the early all-reduces loses nothing
        out.grad_diff[kind] = _max_diff(zip(last_grads[False], last_grads[True]))
    return out


def small_convnet(norm: type[nn.Module], channels: int = 8, classes: int = 10) -> nn.Sequential:
    """conv - BN - ReLU - conv - BN - ReLU - pool - linear: two BatchNorms, nothing else with state."""
    return nn.Sequential(
        nn.Conv2d(3, channels, 3, padding=1, bias=False), norm(channels), nn.ReLU(),
        nn.Conv2d(channels, channels, 3, padding=1, bias=False), norm(channels), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, classes),
    )


def batchnorm_checks(rank: int, world: int, device: torch.device, batch: int, seed: int = 0) -> BatchNormResult:
    """Gradient differences to one process on the whole batch: per-rank BN, SyncBN by hand (and torch's on GPU)."""
    X, Y = labelled(torch.Generator().manual_seed(seed), (world * batch,), (3, 16, 16), device)
    x, y = X[rank * batch:(rank + 1) * batch], Y[rank * batch:(rank + 1) * batch]
    torch.manual_seed(seed)
    reference = small_convnet(nn.BatchNorm2d).to(device)
    F.cross_entropy(reference(X), Y).backward()
    ref = [p.grad.detach().clone() for p in reference.parameters()]

    variants = {"per_rank_bn": nn.BatchNorm2d, "sync_bn_by_hand": SyncBatchNorm2dByHand}
    if device.type == "cuda":
        variants["torch_sync_bn"] = nn.SyncBatchNorm
    out = BatchNormResult(world, batch, {}, {}, torch.cat([r.flatten() for r in ref]).norm().item())
    for name, norm in variants.items():
        torch.manual_seed(seed)
        model = NaiveDDP(small_convnet(norm).to(device))
        _backward(model, x, y)
        out.grad_diff[name] = _max_diff(zip((p.grad for p in model.parameters()), ref))
        # how far apart the ranks' running means drifted (NaiveDDP does not broadcast buffers)
        running_mean = model.module[1].running_mean.detach()
        high, low = running_mean.clone(), running_mean.clone()
        dist.all_reduce(high, op=dist.ReduceOp.MAX)
        dist.all_reduce(low, op=dist.ReduceOp.MIN)
        out.running_mean_spread[name] = (high - low).max().item()
    return out
