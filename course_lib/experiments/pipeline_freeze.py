"""Chapter 08's freeze-training run on ``p`` ranks: a frozen prefix in place, then the pipeline repacked.

``freeze_steps`` runs one 1F1B step with the first ``k`` stages frozen (``pipeline.freeze.frozen_schedule``) and
one with the active layers repacked (``freeze.repack``) and the freed ranks as data-parallel replicas, both against
the sequential step with the prefix frozen (the worker ``course_lib.experiments.workers.pipeline_freeze_run``).
"""

from __future__ import annotations

import argparse
import copy
from dataclasses import dataclass, field, replace
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from course_lib.experiments.clock import Clock
from course_lib.experiments.pipeline_meter import (StageRun, fastest_of, gather_step, grad_diff, measured_bubble,
                                                   metered_stage)
from course_lib.experiments.pipeline_model import op_pads, staged
from course_lib.experiments.results import WorkerResult
from course_lib.models import lm_loss
from course_lib.parallel.pipeline.executor import boundary_shapes, split_sequential
from course_lib.parallel.pipeline.freeze import ActivationCache, frozen_schedule, repack, simulate_repacked
from course_lib.parallel.pipeline.schedules import make_schedule, simulate


class CountedCache(ActivationCache):
    """An ``ActivationCache`` that counts the samples its prefix ran on (``computed``) and those it served (``hits``)."""

    def __init__(self, prefix: nn.Module, num_samples: int):
        super().__init__(prefix, num_samples)
        self.computed = self.hits = 0

    def get(self, index: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        new = int((~self.filled[torch.as_tensor(index, dtype=torch.long)]).sum())   # host: indexes the host mask
        self.computed, self.hits = self.computed + new, self.hits + len(index) - new
        return super().get(index, x)


@dataclass
class FreezeRun(WorkerResult):
    """Rank 0's figures of ``freeze_steps``, the frozen and the repacked steps (times in seconds)."""

    p: int
    m: int
    frozen_stages: int
    loss_reference: float
    # 1. frozen in place: p stages, the first k forwards only
    counted_ops: list[tuple[int, str, int, dict[str, int]]]   # (stage, op, micro-batch, ATen ops), m = p
    makespan_s: float
    makespan_simulated_s: float
    bubble_measured: float
    bubble_simulated: float
    busy_s: list[float]                      # per stage
    peak_activation_bytes: list[int]         # per stage
    sent_messages: int
    sent_bytes: int
    grad_max_abs_diff: float                 # trainable stages against the sequential step
    frozen_grads_none: bool                  # the frozen stages' parameters got no gradient
    loss: float
    overruns: int
    timings: list[tuple[int, str, int, float, float]]        # (stage, op, micro-batch, start, end) from the start
    # 2. repacked, with the activation cache
    stages: int = 0
    replicas: int = 0
    layers_per_stage: list[int] = field(default_factory=list)
    repacked_makespan_s: float = 0.0         # pipelines plus the gradients' all-reduce
    repacked_pipeline_s: float = 0.0         # until the last pipeline op
    repacked_makespan_simulated_s: float = 0.0
    repacked_bubble_measured: list[float] = field(default_factory=list)  # per replica, pipeline part
    repacked_bubble_simulated: float = 0.0
    repacked_grad_max_abs_diff: float = 0.0
    repacked_loss: float = 0.0
    repacked_peak_activation_bytes: list[int] = field(default_factory=list)   # per rank
    allreduce_bytes: int = 0                 # gradient bytes each rank all-reduces
    cache_bytes: int = 0                     # on each replica's first stage
    cache_samples: int = 0                   # samples it holds
    cache_computed: int = 0                  # samples the prefix ran on, over every repeat
    cache_hits: int = 0
    repacked_timings: list[tuple[int, str, int, float, float]] = field(default_factory=list)


def freeze_steps(a: argparse.Namespace, k: int, m: int, repeats: int, rank: int, world: int, device: torch.device,
                 clock: Clock) -> FreezeRun | None:
    """On ``p`` ranks with the first ``k`` stages frozen, one 1F1B step in place, then one repacked (``repack``,
    the freed ranks as replicas), both over ``m`` micro-batches, each the fastest of ``repeats`` padded tries,
    against the sequential step with the prefix frozen; rank 0 returns the figures, the others ``None``.

    ``a`` holds ``pipeline_model.add_model_args``'s options. The frozen step is also run once unpadded at
    ``m = p`` with every op's ATen ops counted (and the first messages and backward warmed up).
    """
    ref = staged(a, world, m, frozen=k)
    pad = op_pads(a)

    # 1. frozen in place
    mine = copy.deepcopy(ref.stages[rank]).to(device)
    shapes = boundary_shapes(ref.stages, ref.xs[0])

    def step(mb: int, padded: bool, count: bool) -> StageRun:
        mine.zero_grad(set_to_none=True)
        dist.barrier()                           # start together, so idle time is the schedule's
        return metered_stage(mine, frozen_schedule("1f1b", world, mb, k), rank, shapes[rank], inputs=ref.xs[:mb],
                         targets=ref.ys[:mb], loss_fn=lm_loss, op_seconds=pad if padded else None, device=device,
                         clock=clock, count_ops=count)

    counted = step(world, False, True)
    counted_ops = [(rank, op, i, n) for (op, i, *_), n in zip(counted.busy, counted.op_counts)]

    def padded() -> tuple[dict[str, float], Callable[[], tuple]]:
        run = step(m, True, False)
        return {"start": run.start, "end": run.end}, lambda: (
            run, grad_diff([mine], [ref.refs[rank]]), all(p.grad is None for p in mine.parameters()))
    run, gdiff, no_grads = fastest_of(repeats, padded, device)
    frozen = gather_step(run, ops=counted_ops, diff=gdiff, none=no_grads)

    # 2. repacked: the active layers on fewer stages, the freed ranks as replicas
    layers, ref_layers = [[mod for s in pieces for mod in s] for pieces in (ref.stages, ref.refs)]
    per_old = len(layers) // world               # layers of one stage before (split_sequential: equal here)
    plan = repack(len(layers), sum(len(s) for s in ref.stages[:k]), world, per_old)
    K, R, cut = plan.stages, plan.replicas, plan.frozen_layers
    replica, local = divmod(rank, K)
    prefix = nn.Sequential(*layers[:cut])
    active = split_sequential(nn.Sequential(*copy.deepcopy(layers[cut:])), K)
    new_mod = active[local].to(device)
    m_r, mbs = m // R, a.microbatch_size
    own = list(range(replica * m_r, (replica + 1) * m_r))      # this replica's micro-batches
    groups = [dist.new_group([s + r * K for r in range(R)]) for s in range(K)]  # every rank makes each group
    with torch.no_grad():
        new_shapes = boundary_shapes(active, prefix(ref.xs[0]))
    cache = None
    if local == 0:                               # the replica's first stage holds the prefix's outputs
        cache = CountedCache(prefix.to(device), num_samples=m_r * mbs)
    scale = max(plan.layers_per_stage) / per_old  # a stage's ops take as long as its layers
    pad_r = op_pads(a, scale=scale)
    flat_bytes = sum(p.numel() * p.element_size() for p in new_mod.parameters())
    refs_new = split_sequential(nn.Sequential(*ref_layers[cut:]), K)

    def repacked_step() -> tuple[dict[str, float], Callable[[], tuple]]:
        new_mod.zero_grad(set_to_none=True)
        inputs = None
        if cache is not None:                    # served from the cache: the prefix runs in the first repeat only
            inputs = [cache.get(torch.arange(j * mbs, (j + 1) * mbs), ref.xs[i].to(device))  # host: indices
                      for j, i in enumerate(own)]
        dist.barrier()
        r_run = metered_stage(new_mod, make_schedule("1f1b", K, m_r), local, new_shapes[local], inputs=inputs,
                          targets=[ref.ys[i] for i in own], loss_fn=lm_loss, op_seconds=pad_r, device=device,
                          clock=clock, ranks=list(range(replica * K, replica * K + K)))
        grads = [p.grad for p in new_mod.parameters()]
        flat = torch.cat([g.reshape(-1) for g in grads])     # one message per stage, not one per tensor
        dist.all_reduce(flat, group=groups[local])   # sum over the replicas' copies of this stage
        flat /= R                                 # each replica's loss is its own mean: average them
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))
        done = clock.seconds(clock.mark())
        return {"start": r_run.start, "done": done}, lambda: (r_run, done, grad_diff([new_mod], [refs_new[local]]))
    r_run, done, rdiff = fastest_of(repeats, repacked_step, device, end="done")
    repacked = gather_step(replace(r_run, rank=rank), done=done, diff=rdiff,
                           cache=None if cache is None else [cache.nbytes, cache.num_samples, cache.computed,
                                                             cache.hits])
    if rank != 0:
        return None
    t_f, t_b = a.t_forward_ms / 1e3 or 1.0, a.t_backward_ms / 1e3 or 2.0   # seconds; units with no padding
    sim = simulate(frozen_schedule("1f1b", world, m, k), t_f, t_b)
    r_sim = simulate_repacked(plan, m, t_f, t_b, per_old)
    r0 = min(r.start for r in repacked.runs)
    cache_figures = next(c for c in repacked.each("cache") if c is not None)
    losses = [loss for r in repacked.runs for loss in r.losses]
    return FreezeRun(
        p=world, m=m, frozen_stages=k, loss_reference=ref.loss,
        counted_ops=[o for ops in frozen.each("ops") for o in ops], makespan_s=frozen.makespan_s,
        makespan_simulated_s=sim.makespan, bubble_measured=frozen.bubble, bubble_simulated=sim.bubble_fraction,
        busy_s=frozen.busy_s, peak_activation_bytes=frozen.each("peak_activation_bytes"),
        sent_messages=frozen.total("sent_messages"), sent_bytes=frozen.total("sent_bytes"),
        grad_max_abs_diff=max(frozen.each("diff")[k:]), frozen_grads_none=all(frozen.each("none")[:k]),
        loss=sum(frozen.runs[-1].losses) / len(frozen.runs[-1].losses), overruns=frozen.total("overruns"),
        timings=frozen.timings, stages=K, replicas=R, layers_per_stage=plan.layers_per_stage,
        repacked_makespan_s=max(repacked.each("done")) - r0, repacked_pipeline_s=max(repacked.each("end")) - r0,
        repacked_makespan_simulated_s=r_sim.makespan,
        repacked_bubble_measured=[measured_bubble(repacked.runs[r * K:(r + 1) * K])["bubble_fraction"]
                                  for r in range(R)],
        repacked_bubble_simulated=r_sim.bubble_fraction, repacked_grad_max_abs_diff=max(repacked.each("diff")),
        repacked_loss=sum(losses) / len(losses),
        repacked_peak_activation_bytes=repacked.each("peak_activation_bytes"),
        allreduce_bytes=flat_bytes, cache_bytes=cache_figures[0], cache_samples=cache_figures[1],
        cache_computed=cache_figures[2], cache_hits=cache_figures[3], repacked_timings=repacked.timings)
