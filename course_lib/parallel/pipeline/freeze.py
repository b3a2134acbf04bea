"""Freeze training on a pipeline, after PipeTransformer (He et al., ICML 2021) (chapter 08).

The first layers of a network settle early in training (Raghu et al. 2017, SVCCA), so their training can stop
before the rest. Frozen layers form a prefix of the model, on a pipeline the first stages:

- a frozen stage runs its forwards only (``frozen_schedule``; ``executor.run_stage`` keeps no graph for a stage
  without backward, and the first trainable stage asks no gradient of its input and sends none back);
- its forward no longer changes, so its output for each sample can be computed once and kept (``ActivationCache``);
- its devices then idle: PipeTransformer packs the active layers into fewer stages and gives the freed devices to
  data-parallel replicas of the shorter pipeline (``repack``).

The paper decides what to freeze from the layers' gradients (AutoFreeze); ``progressive_freeze`` is a fixed
schedule of the same shape: at each freeze point a share ``alpha`` of the layers still active joins the prefix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from course_lib.parallel.pipeline.schedules import Schedule, SimResult, make_schedule, simulate


def progressive_freeze(num_layers: int, num_epochs: int, alpha: float, keep: int = 1) -> list[int]:
    """Frozen layers at the start of each epoch: 0, then ``+ floor(alpha * active)`` per epoch; ``keep`` layers at
    the end (the head) always train. The share frozen per step follows the shape of PipeTransformer's bound (a
    fraction ``alpha`` of the active layers at most); the paper also stops earlier when the layers' gradients say
    so, which a fixed schedule leaves out."""
    if num_layers < 1 or num_epochs < 1 or not 0 < alpha <= 1 or not 1 <= keep <= num_layers:
        raise ValueError(f"need num_layers >= 1, num_epochs >= 1, 0 < alpha <= 1, 1 <= keep <= num_layers; got "
                         f"{num_layers}, {num_epochs}, {alpha}, {keep}")
    frozen = [0]
    for _ in range(num_epochs - 1):
        f = frozen[-1]
        frozen.append(min(num_layers - keep, f + math.floor(alpha * (num_layers - f))))
    return frozen


def frozen_schedule(kind: str, num_stages: int, num_microbatches: int, frozen_stages: int) -> Schedule:
    """``make_schedule(kind, ...)`` with the first ``frozen_stages`` stages running their forwards only. The
    trainable stages keep their order: a backward never waited for a frozen stage (gradients flow the other way),
    and the first trainable stage now sends none. Plain schedules only (``gpipe``, ``1f1b``, ``zb-h1``)."""
    if kind == "interleaved":
        raise ValueError("a frozen prefix is a set of whole devices; interleaving spreads each device's "
                         "layers over the model")
    if not 0 <= frozen_stages < num_stages:
        raise ValueError(f"frozen_stages must be in [0, {num_stages}): the last stage computes the loss and "
                         f"trains; got {frozen_stages}")
    schedule = make_schedule(kind, num_stages, num_microbatches)
    return [[o for o in order if o[0] == "F"] if s < frozen_stages else order for s, order in enumerate(schedule)]


def freeze(modules: nn.Module | list[nn.Module]) -> None:
    """Stop training ``modules``: their parameters need no gradient (the optimizer skips them)."""
    for mod in modules if isinstance(modules, list) else [modules]:
        mod.requires_grad_(False)


@dataclass
class ElasticPlan:
    """Where the active layers go after a freeze: ``stages`` per pipeline, ``replicas`` pipelines."""

    num_layers: int
    frozen_layers: int
    stages: int                       # pipeline length after repacking
    replicas: int                     # data-parallel pipelines: devices // stages
    layers_per_stage: list[int]       # active layers on each stage

    @property
    def active_layers(self) -> int:
        return self.num_layers - self.frozen_layers


def repack(num_layers: int, frozen_layers: int, devices: int, max_layers_per_stage: int) -> ElasticPlan:
    """Pack the active layers into the fewest stages and fill the freed devices with replicas. The pipeline length
    stays a power of two that divides ``devices`` (as in PipeTransformer, which halves it when the active layers fit
    in half the devices), and is the shortest one whose stages hold at most ``max_layers_per_stage`` layers (what one
    device's memory takes; usually the unfrozen pipeline's stage). The frozen prefix is not placed: its outputs come
    from the ``ActivationCache``."""
    active = num_layers - frozen_layers
    if devices < 1 or devices & (devices - 1):
        raise ValueError(f"devices must be a power of two (the pipeline is halved); got {devices}")
    if not 0 < active <= num_layers or max_layers_per_stage < 1:
        raise ValueError(f"need 0 <= frozen_layers < num_layers and max_layers_per_stage >= 1; got "
                         f"{frozen_layers} of {num_layers}, {max_layers_per_stage}")
    stages = 1
    while stages < devices and math.ceil(active / stages) > max_layers_per_stage:
        stages *= 2
    if math.ceil(active / stages) > max_layers_per_stage:
        raise ValueError(f"{active} active layers do not fit on {devices} devices of {max_layers_per_stage}")
    stages = min(stages, active)      # never more stages than layers
    base, extra = divmod(active, stages)
    # the same split as executor.split_sequential: the first stages take one more
    return ElasticPlan(num_layers, frozen_layers, stages, devices // stages,
                       [base + (1 if s < extra else 0) for s in range(stages)])


def simulate_repacked(plan: ElasticPlan, num_microbatches: int, t_forward: float, t_backward: float,
                      layers_per_old_stage: int, kind: str = "1f1b") -> SimResult:
    """One replica's step after ``repack``: ``m / replicas`` micro-batches, each op as long as its stage's layers.
    ``t_forward`` and ``t_backward`` are a stage's times before repacking, when it held ``layers_per_old_stage``
    layers; every replica runs the same schedule at the same time, so one replica's makespan is the step's (before
    the gradients' all-reduce, which this leaves out)."""
    if num_microbatches % plan.replicas:
        raise ValueError(f"{num_microbatches} micro-batches do not split over {plan.replicas} replicas")
    scale = max(plan.layers_per_stage) / layers_per_old_stage     # the slowest stage sets the pace
    return simulate(make_schedule(kind, plan.stages, num_microbatches // plan.replicas),
                    t_forward * scale, t_backward * scale)


class ActivationCache:
    """The frozen prefix's output for each sample, computed once and kept (PipeTransformer's AutoCache).

    ``get(index, x)`` returns the prefix's output for the samples ``index`` (their inputs ``x``), running the prefix
    only on those not yet cached. Memory: one prefix output per sample of the data set, ``nbytes``; what it saves is
    the prefix's forward in every later epoch. Valid only while the prefix stays frozen (and runs no dropout): a
    change of the frozen set needs a new cache.
    """

    def __init__(self, prefix: nn.Module, num_samples: int):
        self.prefix, self.num_samples = prefix, num_samples
        self.store: torch.Tensor | None = None          # (num_samples, *output shape), made at the first call
        self.filled = torch.zeros(num_samples, dtype=torch.bool)  # host: bookkeeping of sample indices

    @torch.no_grad()
    def get(self, index: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        index = torch.as_tensor(index, dtype=torch.long)  # host: indexes the host-side mask above
        miss = ~self.filled[index]
        if miss.any():
            out = self.prefix(x[miss.to(x.device)])
            if self.store is None:
                self.store = torch.empty((self.num_samples, *out.shape[1:]), dtype=out.dtype, device=out.device)
            self.store[index[miss].to(out.device)] = out
            self.filled[index[miss]] = True
        return self.store[index.to(self.store.device)].clone()   # a copy: the caller may send or modify it

    @property
    def nbytes(self) -> int:
        """Bytes the cache holds (all samples, whether filled yet or not)."""
        return 0 if self.store is None else self.store.nbytes
