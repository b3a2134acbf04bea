"""NaiveDDP, BucketedDDP and torch DDP against one process on the whole batch (chapter 06).

    torchrun --nproc-per-node 2 -m course_lib.workers.ddp_compare --steps 3

Reports, from rank 0:

- ``equal``: for three models that stress a DDP wrapper (a frozen layer and a
  block used twice; the same block inside a reentrant checkpoint, so its
  gradient hooks fire twice per step; an auxiliary head used on odd steps
  only), the largest gradient and parameter differences to a single process
  that trains on the concatenation of every rank's batch;
- ``timing``: median step time of each wrapper on an MLP (``--timing-*``),
  with the bytes each sends per step;
- ``no_sync``: all-reduce calls for k accumulated micro-batches, with and
  without ``no_sync()``;
- ``batchnorm`` (with ``--bn``): see ``ddp_batchnorm``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

from course_lib.distributed import comm, launch
from course_lib.distributed.ddp import BucketedDDP, NaiveDDP, counting_allreduce_hook
from course_lib.models import MLP

SMALL_CAP_MB = 4096 / 2**20  # 4 KB: about one bucket per weight of this small model, so buckets leave mid-backward


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


def _wrap(kind: str, model: nn.Module, ddp_kwargs: dict, cap_mb: float | None,
          counter: comm.ByteCounter | None = None):
    """``cap_mb=None``: each wrapper's defaults (25 MB buckets, the first one 1 MB)."""
    if kind == "naive":
        return NaiveDDP(model, counter=counter)
    if kind == "bucketed":
        return BucketedDDP(model, counter=counter, **({} if cap_mb is None else dict(bucket_cap_mb=cap_mb)))
    if kind == "torch":
        # torch DDP keeps its small first bucket only when bucket_cap_mb is left at its default
        ddp = DDP(model, **ddp_kwargs, **({} if cap_mb is None else dict(bucket_cap_mb=cap_mb)))
        if counter is not None:
            ddp.register_comm_hook(None, counting_allreduce_hook(counter))
        return ddp
    raise ValueError(kind)


def _sync(model: nn.Module) -> None:
    if hasattr(model, "finish_gradient_synchronization"):  # torch DDP synchronises inside backward
        model.finish_gradient_synchronization()


def compare_scenario(name: str, rank: int, world: int, batch: int, steps: int, seed: int,
                     device: torch.device) -> dict:
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
            F.cross_entropy(model(inputs[s], use_aux=use_aux(s)), targets[s]).backward()
            _sync(model)
            history.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
            opt.step()
        return history

    ref_model = copy.deepcopy(base)
    ref = train(ref_model, X, Y)
    mine = slice(rank * batch, (rank + 1) * batch)
    out = {}
    for kind in ("naive", "bucketed", "torch", "bucketed_first_call"):
        if kind == "bucketed_first_call" and name != "reentrant":
            continue
        wrapped = _wrap(kind.removesuffix("_first_call"), copy.deepcopy(base), ddp_kw, SMALL_CAP_MB)
        if kind == "bucketed_first_call":
            # the mistake the hook counting avoids: send a bucket at the first hook call of each parameter
            wrapped._expected = [1] * len(wrapped.params)
            wrapped._reset()
        hist = train(wrapped, X[:, mine], Y[:, mine])
        inner = wrapped.module
        none_match = all((a is None) == (b is None) for h, r in zip(hist, ref) for a, b in zip(h, r))
        grad_diff = max(((a - b).abs().max().item() for h, r in zip(hist, ref) for a, b in zip(h, r)
                         if a is not None and b is not None), default=0.0)
        param_diff = max((p - q).abs().max().item() for p, q in zip(inner.parameters(), ref_model.parameters()))
        out[kind] = {"grad_diff": grad_diff, "param_diff": param_diff, "none_match": none_match}
        if kind.startswith("bucketed"):
            out[kind].update(buckets=len(wrapped.buckets), max_hook_calls=max(wrapped._expected),
                             resent=wrapped.resent)
    return out


def _median_step_ms(models: dict[str, nn.Module], x: torch.Tensor, y: torch.Tensor, rounds: int,
                    steps: int) -> dict[str, float]:
    """Interleave the wrappers round by round (fair on a noisy machine); median ms per step."""
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in models.items()}
    times: dict[str, list[float]] = {k: [] for k in models}
    for r in range(rounds + 1):  # round 0 warms up (and teaches BucketedDDP its hook counts)
        for kind, model in models.items():
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                opts[kind].zero_grad(set_to_none=True)
                F.cross_entropy(model(x), y).backward()
                _sync(model)
                opts[kind].step()
            if x.is_cuda:
                torch.cuda.synchronize()
            elapsed = torch.tensor([(time.perf_counter() - start) / steps], device=x.device)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step is as slow as its slowest rank
            if r > 0:
                times[kind].append(elapsed.item() * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def timing(world: int, rank: int, batch: int, in_features: int, hidden: list[int], rounds: int, steps: int,
           cap_mb: float | None, seed: int, device: torch.device) -> dict:
    """Step time of each wrapper on an MLP, and the bytes each sends per step."""
    torch.manual_seed(seed)
    base = MLP(in_features, tuple(hidden)).to(device)
    g = torch.Generator().manual_seed(seed + rank)
    x = torch.randn(batch, in_features, generator=g).to(device)
    y = torch.randint(0, 10, (batch,), generator=g).to(device)
    models = {k: _wrap(k, copy.deepcopy(base), {}, cap_mb) for k in ("naive", "bucketed", "torch")}
    ms = _median_step_ms(models, x, y, rounds, steps)
    grad_bytes = sum(comm.nbytes(p) for p in base.parameters())
    sent = {}
    for kind in ("naive", "bucketed", "torch"):  # count the second step: both DDPs set up buckets in the first
        counter = comm.ByteCounter()
        model = _wrap(kind, copy.deepcopy(base), {}, cap_mb, counter)
        for _ in range(2):
            counter.reset()
            model.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            _sync(model)
        sent[kind] = {"bytes": counter.bytes, "messages": counter.calls.get("all_reduce", 0)}
    return {"ms": ms, "grad_bytes": grad_bytes, "sent": sent, "params": sum(p.numel() for p in base.parameters()),
            "tensors": len(list(base.parameters())), "batch_per_rank": batch, "cap_mb": cap_mb}


def no_sync_counts(rank: int, world: int, batch: int, k: int, steps: int, seed: int, device: torch.device) -> dict:
    """All-reduce messages for ``steps`` optimizer steps of ``k`` micro-batches, with and without no_sync.

    ``buckets`` is the number of messages one synchronised backward sends.
    """
    torch.manual_seed(seed)
    base = EdgeCaseNet().to(device)
    g = torch.Generator().manual_seed(seed + rank)
    micro = [(torch.randn(batch, 32, generator=g).to(device), torch.randint(0, 10, (batch,), generator=g).to(device))
             for _ in range(k)]
    out: dict = {"k": k, "steps": steps}
    for kind in ("torch", "bucketed"):
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
                    with ctx:
                        (F.cross_entropy(model(x), y) / k).backward()  # / k: the mean over the k micro-batches
                        if not use_no_sync or last:
                            _sync(model)
                last_grads[use_no_sync] = [p.grad.clone() for p in model.parameters() if p.grad is not None]
                model.zero_grad(set_to_none=True)
            out[f"{kind}_{'no_sync' if use_no_sync else 'every_micro_batch'}"] = counter.calls.get("all_reduce", 0)
        out[f"{kind}_buckets"] = out[f"{kind}_no_sync"] // steps
        # the same averaged gradient either way: skipping the early all-reduces loses nothing
        out[f"{kind}_grad_diff"] = max((a - b).abs().max().item() for a, b in zip(last_grads[False], last_grads[True]))
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
                        help="bucket size for the timing (default: each wrapper's, 25 MB with a 1 MB first bucket)")
    parser.add_argument("--accum", type=int, default=4, help="micro-batches per step for the no_sync count")
    parser.add_argument("--bn", action="store_true", help="also run the BatchNorm checks")
    parser.add_argument("--timing-only", action="store_true", help="skip the equality and no_sync checks")
    parser.add_argument("--seed", type=int, default=0)
    a = parser.parse_args()

    rank, world, device = launch.init_distributed()  # CPU + gloo, or one GPU per rank + NCCL
    result: dict = {"world": world, "backend": dist.get_backend()}
    if not a.timing_only:
        result["equal"] = {name: compare_scenario(name, rank, world, a.batch, a.steps, a.seed, device)
                           for name in SCENARIOS}
        result["no_sync"] = no_sync_counts(rank, world, a.batch, a.accum, steps=2, seed=a.seed, device=device)
    if a.timing_rounds > 0:
        result["timing"] = timing(world, rank, a.timing_batch, a.timing_in, a.timing_hidden, a.timing_rounds,
                                  a.timing_steps, a.cap_mb, a.seed, device)
    if a.bn:
        from course_lib.workers.ddp_batchnorm import batchnorm_checks

        result["batchnorm"] = batchnorm_checks(rank, world, device, batch=4, seed=a.seed)
    launch.report(result)
    launch.shutdown()


if __name__ == "__main__":
    main()
