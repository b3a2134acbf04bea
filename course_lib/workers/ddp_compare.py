"""NaiveDDP, BucketedDDP, DynamicBucketedDDP and torch DDP against one process on the whole batch (chapter 07).

    torchrun --nproc-per-node 2 -m course_lib.workers.ddp_compare --steps 3

Rank 0 reports a ``CompareResult``:

- ``equal``: for three models that stress a DDP wrapper (a frozen layer and a
  block used twice; the same block inside a reentrant checkpoint, so its
  gradient hooks fire twice per step; an auxiliary head used on odd steps
  only), the largest gradient and parameter differences to a single process
  that trains on the concatenation of every rank's batch (``SUPPORTED`` says
  which scenarios each wrapper is built for);
- ``timing``: median step time of each wrapper on an MLP (``--timing-*``),
  with the bytes each sends per step, by the ring formula and by a spy on
  ``dist.all_reduce``;
- ``no_sync``: all-reduce calls for k accumulated micro-batches, with and
  without ``no_sync()``;
- ``batchnorm`` (with ``--bn``): see ``ddp_batchnorm``;
- ``trace`` (with ``--trace-dir``): one profiled step of NaiveDDP and BucketedDDP on the timing MLP, a Chrome
  trace per rank in that folder (``step_trace.trace_ddp``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

from course_lib.distributed import comm, launch
from course_lib.distributed.clock import Clock, clock_for
from course_lib.distributed.ddp import BucketedDDP, NaiveDDP, counting_allreduce_hook
from course_lib.distributed.ddp_dynamic import DynamicBucketedDDP
from course_lib.distributed.results import WorkerResult
from course_lib.models import MLP
from course_lib.workers.ddp_batchnorm import BatchNormResult, batchnorm_checks
from course_lib.workers.step_trace import trace_ddp

SMALL_CAP_MB = 4096 / 2**20  # 4 KiB: about one bucket per weight of this small model, so buckets leave mid-backward


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
# BucketedDDP assumes one hook call per parameter and backward, and a gradient for every parameter:
# only the first scenario meets that. The others show what goes wrong without DynamicBucketedDDP.
SUPPORTED = {"naive": tuple(SCENARIOS), "bucketed": ("frozen_shared",), "dynamic": tuple(SCENARIOS),
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

    bytes: float            # ByteCounter: the ring formula 2(N-1)/N per byte all-reduced
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
class CompareResult(WorkerResult):
    world: int
    backend: str
    equal: dict[str, dict[str, WrapperRun]] = field(default_factory=dict)  # scenario -> wrapper -> run
    no_sync: NoSync | None = None
    timing: Timing | None = None
    batchnorm: BatchNormResult | None = None
    trace: list[str] = field(default_factory=list)  # rank 0's trace files (one per rank each, in --trace-dir)


def _wrap(kind: str, model: nn.Module, ddp_kwargs: dict, cap_mb: float | None,
          counter: comm.ByteCounter | None = None):
    """``cap_mb=None``: each wrapper's defaults (25 MiB buckets, the first one 1 MiB)."""
    cap = {} if cap_mb is None else dict(bucket_cap_mb=cap_mb)
    if kind == "naive":
        return NaiveDDP(model, counter=counter)
    if kind == "bucketed":
        return BucketedDDP(model, counter=counter, **cap)
    if kind == "dynamic":
        return DynamicBucketedDDP(model, counter=counter, **cap)
    if kind == "dynamic_first_call":  # the mistake that learning the counts avoids: one call per parameter
        n = sum(p.requires_grad for p in model.parameters())
        return DynamicBucketedDDP(model, counter=counter, hook_calls=[1] * n, **cap)
    if kind == "torch":
        # torch DDP keeps its small first bucket only when bucket_cap_mb is left at its default
        ddp = DDP(model, **ddp_kwargs, **cap)
        if counter is not None:
            ddp.register_comm_hook(None, counting_allreduce_hook(counter))
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
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(steps, world * batch, 32, generator=g).to(device)
    Y = torch.randint(0, 10, (steps, world * batch), generator=g).to(device)
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
        hist = train(wrapped, X[:, mine], Y[:, mine])
        inner = wrapped.module
        none_match = all((a is None) == (b is None) for h, r in zip(hist, ref) for a, b in zip(h, r))
        grad_diff = max(((a - b).abs().max().item() for h, r in zip(hist, ref) for a, b in zip(h, r)
                         if a is not None and b is not None), default=0.0)
        param_diff = max((p - q).abs().max().item() for p, q in zip(inner.parameters(), ref_model.parameters()))
        out[kind] = WrapperRun(grad_diff, param_diff, none_match)
        if isinstance(wrapped, BucketedDDP):
            out[kind].buckets = len(wrapped.buckets)
        if isinstance(wrapped, DynamicBucketedDDP):
            out[kind].max_hook_calls, out[kind].resent = max(wrapped.expected), wrapped.resent
    return out


def _median_step_ms(models: dict[str, nn.Module], x: torch.Tensor, y: torch.Tensor, rounds: int,
                    steps: int, clock: Clock) -> dict[str, float]:
    """Interleave the wrappers round by round (fair on a noisy machine); median ms per step."""
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in models.items()}
    times: dict[str, list[float]] = {k: [] for k in models}
    for r in range(rounds + 1):  # round 0 warms up (and teaches DynamicBucketedDDP its hook counts)
        for kind, model in models.items():
            dist.barrier()
            start = clock.mark()
            for _ in range(steps):
                opts[kind].zero_grad(set_to_none=True)
                _backward(model, x, y)
                opts[kind].step()
            elapsed = torch.tensor([clock.elapsed(start, clock.mark()) / steps], device=x.device)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step is as slow as its slowest rank
            if r > 0:
                times[kind].append(elapsed.item() * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def timing(world: int, rank: int, batch: int, in_features: int, hidden: list[int], rounds: int, steps: int,
           cap_mb: float | None, seed: int, device: torch.device) -> Timing:
    """Step time of each wrapper on an MLP, and the bytes each sends per step."""
    torch.manual_seed(seed)
    base = MLP(in_features, tuple(hidden)).to(device)
    g = torch.Generator().manual_seed(seed + rank)
    x = torch.randn(batch, in_features, generator=g).to(device)
    y = torch.randint(0, 10, (batch,), generator=g).to(device)
    clock = clock_for(device)
    models = {k: _wrap(k, copy.deepcopy(base), {}, cap_mb) for k in KINDS}
    ms = _median_step_ms(models, x, y, rounds, steps, clock)
    sent = {}
    for kind in KINDS:  # count the second step: both DDPs set up buckets in the first
        counter = comm.ByteCounter()
        model = _wrap(kind, copy.deepcopy(base), {}, cap_mb, counter)
        for _ in range(2):
            counter.reset()
            model.zero_grad(set_to_none=True)
            with comm.handed_bytes("all_reduce") as handed:
                _backward(model, x, y)
        sent[kind] = Sent(counter.bytes, counter.calls.get("all_reduce", 0), sum(handed), len(handed))
    return Timing(ms, clock.name, sent, grad_bytes=sum(comm.nbytes(p) for p in base.parameters()),
                  params=sum(p.numel() for p in base.parameters()), tensors=len(list(base.parameters())),
                  batch_per_rank=batch, cap_mb=cap_mb)


def no_sync_counts(rank: int, world: int, batch: int, k: int, steps: int, seed: int, device: torch.device) -> NoSync:
    """All-reduce messages for ``steps`` optimizer steps of ``k`` micro-batches, with and without no_sync."""
    torch.manual_seed(seed)
    base = EdgeCaseNet().to(device)
    g = torch.Generator().manual_seed(seed + rank)
    micro = [(torch.randn(batch, 32, generator=g).to(device), torch.randint(0, 10, (batch,), generator=g).to(device))
             for _ in range(k)]
    out = NoSync(k, steps, {}, {}, {}, {})
    for kind in ("torch", "bucketed", "dynamic"):
        last_grads: dict[bool, list[torch.Tensor]] = {}
        for use_no_sync in (False, True):
            counter = comm.ByteCounter()
            model = _wrap(kind, copy.deepcopy(base), {}, SMALL_CAP_MB, counter)
            for step in range(steps + 1):
                if step == 1:
                    counter.reset()  # count from the second step: both DDPs set up their buckets in the first
                for j, (x, y) in enumerate(micro):
                    last = j == k - 1
                    ctx = model.no_sync() if (use_no_sync and not last) else contextlib.nullcontext()
                    with ctx:  # / k: the mean over the k micro-batches
                        _backward(model, x, y, micro_batches=k, sync=not use_no_sync or last)
                last_grads[use_no_sync] = [p.grad.clone() for p in model.parameters() if p.grad is not None]
                model.zero_grad(set_to_none=True)
            (out.no_sync if use_no_sync else out.every_micro_batch)[kind] = counter.calls.get("all_reduce", 0)
        out.buckets[kind] = out.no_sync[kind] // steps
        # the same averaged gradient either way: skipping the early all-reduces loses nothing
        out.grad_diff[kind] = max((a - b).abs().max().item() for a, b in zip(last_grads[False], last_grads[True]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8, help="samples per rank for the equality checks")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps for the equality checks")
    parser.add_argument("--timing-batch", type=int, default=32)
    parser.add_argument("--timing-in", type=int, default=512)
    parser.add_argument("--timing-hidden", type=int, nargs="+", default=[512] * 4)
    parser.add_argument("--timing-rounds", type=int, default=3, help="0 skips the timing")
    parser.add_argument("--timing-steps", type=int, default=5)
    parser.add_argument("--cap-mb", type=float, default=None,
                        help="bucket size in MiB for the timing (default: each wrapper's, 25 with a first bucket of 1)")
    parser.add_argument("--accum", type=int, default=4, help="micro-batches per step for the no_sync count")
    parser.add_argument("--bn", action="store_true", help="also run the BatchNorm checks")
    parser.add_argument("--timing-only", action="store_true", help="skip the equality and no_sync checks")
    parser.add_argument("--trace-dir", default=None, help="also profile one step of naive and bucketed DDP there")
    parser.add_argument("--seed", type=int, default=0)
    launch.serve(parser, run_checks)


def run_checks(a: argparse.Namespace, rank: int, world: int, device: torch.device) -> CompareResult:
    """The checks ``a`` asks for, on CPU + gloo or on a GPU per rank + NCCL."""
    result = CompareResult(world, dist.get_backend())
    if not a.timing_only:
        result.equal = {name: compare_scenario(name, rank, world, a.batch, a.steps, a.seed, device)
                        for name in SCENARIOS}
        result.no_sync = no_sync_counts(rank, world, a.batch, a.accum, steps=2, seed=a.seed, device=device)
    if a.timing_rounds > 0:
        result.timing = timing(world, rank, a.timing_batch, a.timing_in, a.timing_hidden, a.timing_rounds,
                               a.timing_steps, a.cap_mb, a.seed, device)
    if a.bn:
        result.batchnorm = batchnorm_checks(rank, world, device, batch=4, seed=a.seed)
    if a.trace_dir:
        result.trace = trace_ddp(rank, world, device, a.trace_dir, a.timing_in, tuple(a.timing_hidden),
                                 a.timing_batch, seed=a.seed)
    return result


if __name__ == "__main__":
    main()
