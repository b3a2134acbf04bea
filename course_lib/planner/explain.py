"""Explain: what ``plan`` chose, why, and every candidate it weighed, in words and a table (chapter 13, section 3).

``Plan`` is the planner's answer; ``explain`` writes why it won: its predicted peak and what fills it, the
micro-batch that would not fit, what chapter 11's options save, what the ring or offloading costs, the
runner-up, and what the low precisions measured here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from torch import nn

from course_lib.planner.config import Config
from course_lib.planner.measure import Measurements
from course_lib.planner.predict import cp_comm_bytes, offload_bytes, pipeline_runs, pipeline_terms, predict_peak

MiB = 2**20


@dataclass
class Candidate:
    """One (pass, segments, layout, stage, offload, loss chunks) at its largest fitting micro-batch (at 1 if none
    fits)."""

    config: Config
    fits: bool
    peak: dict                               # predict_peak of config
    samples_per_s: float                     # 0 when it does not fit


@dataclass
class Plan:
    """What ``plan`` chose, why, and every candidate it weighed."""

    config: Config
    predicted_peak_bytes: int
    predicted_samples_per_s: float
    budget_bytes: int
    world_size: int
    peak: dict
    explanation: str
    candidates: list[Candidate] = field(default_factory=list)
    measurements: Measurements | None = None

    @property
    def mesh(self) -> tuple[int, int]:
        """(data-parallel, tensor-parallel) ranks of the chosen configuration."""
        return data_parallel_ranks(self.config, self.world_size), self.config.tp

    def table(self, limit: int | None = None) -> str:
        """The candidates, fastest first (then those that do not fit), one line each. The layout column reads
        ``d`` data-parallel ranks times ``t`` tensor-parallel (``2t``), ``c`` context-parallel (``2c``) or
        ``p`` pipeline (``2p``; ``2p/2``: two interleaved chunks per stage) ranks."""
        rows = [f"{'precision':>9} {'chapter 11':>18} {'segments':>8} {'layout':>7} {'ZeRO':>4} {'micro':>5} "
                f"{'accum':>5} {'peak MiB':>9} {'samples/s':>9}"]
        # fastest first, in the order ``plan`` weighed them where the speeds tie (so its choice is the first line);
        # those that do not fit by their peak
        for c in sorted(self.candidates, key=lambda c: (-c.samples_per_s, 0 if c.fits else c.peak["total"]))[:limit]:
            m, a = (c.config.micro_batch, c.config.accumulation_steps) if c.fits else ("-", "-")
            note = "  <- chosen" if c.config == self.config else ("" if c.fits else "  (micro-batch 1 too big)")
            rows.append(f"{c.config.precision:>9} {_options(c.config):>18} {c.config.segments:>8} "
                        f"{layout(c.config, self.world_size):>7} {c.config.zero_stage:>4} {m:>5} {a:>5} "
                        f"{c.peak['total'] / MiB:9.1f} {c.samples_per_s:9.1f}{note}")
        return "\n".join(rows)


def data_parallel_ranks(config: Config, world_size: int) -> int:
    """The ranks that split the batch: the world over the tensor, context and pipeline ranks."""
    return world_size // (config.tp * config.cp * config.pp)


def layout(config: Config, world_size: int) -> str:
    """``config``'s layout of ``world_size`` ranks in a few characters: ``4``, ``2x2t``, ``1x4c``, ``2x2p/2``."""
    return layout_text(data_parallel_ranks(config, world_size), config.tp, config.cp, config.pp,
                        config.virtual_stages)


def layout_text(d: int, t: int, c: int, p: int = 1, v: int = 1) -> str:
    """``d`` data-parallel ranks times ``t`` tensor-, ``c`` context-, ``p`` pipeline-parallel: ``2x2t``."""
    axes = [f"{n}{a}" for n, a in ((t, "t"), (c, "c"), (p, "p")) if n > 1]
    return "x".join([str(d), *axes]) + (f"/{v}" if v > 1 else "")


def _options(config: Config) -> str:
    """Chapter 11's options of ``config``, in a few characters: fused attention, loss chunks, offload."""
    names = ["fused"] * config.fused + [f"loss/{config.loss_chunks}"] * (config.loss_chunks > 1)
    return " ".join(names + ["offload"] * config.offload) or "-"


def peak_parts(peak: dict) -> str:
    """A predicted peak's parts in MiB, in a few words."""
    return ", ".join(f"{k} {peak[k] / MiB:.1f}" for k in ("params", "grads", "optimizer", "batch", "transient"))


def explain(best: Candidate, fits: list[Candidate], meas: Measurements, model: nn.Module, device: torch.device,
            world_size: int, global_batch: int, usable: int, budget_text: str, unsearched: str,
            tp_bandwidth: float, host_bandwidth: float) -> str:
    """Why ``best`` (the fastest of ``fits``) won, in a few sentences a learner can check against the table."""
    cfg = best.config
    dp = data_parallel_ranks(cfg, world_size)
    per_rank = global_batch // dp
    mesh = (f" on {dp} data-parallel x {cfg.tp} tensor-parallel ranks" if cfg.tp > 1 else
            f" on {dp} data-parallel x {cfg.cp} context-parallel ranks" if cfg.cp > 1 else "")
    # the parts sum to the predicted peak, so they follow it, before the budget it must fit
    why = [f"Chosen: {cfg.describe()}{mesh}. Predicted peak {best.peak['total'] / MiB:.1f} MiB per device "
           f"({peak_parts(best.peak)} MiB; the peak is in the {best.peak['where']}), within a budget of {budget_text}; "
           f"about {best.samples_per_s:.0f} samples/s."]
    bigger = [dataclasses.replace(cfg, micro_batch=m, accumulation_steps=per_rank // m)
              for m in range(cfg.micro_batch + 1, per_rank + 1) if per_rank % m == 0]
    bigger = [c for c in bigger if pipeline_runs(meas, c)]
    if bigger:
        nxt = bigger[0]
        need = predict_peak(meas, nxt, world_size)["total"]
        fits_too = "" if need > usable else (  # a pipeline: it fits, but needs more micro-batches for its bubble
            f" and leave the pipeline a bubble of {pipeline_terms(nxt, meas.n_blocks)['bubble']:.2f}, not "
            f"{pipeline_terms(cfg, meas.n_blocks)['bubble']:.2f}")
        why.append(f"Micro-batch {nxt.micro_batch} would need {need / MiB:.1f} MiB{fits_too}.")
    if cfg.memory_options() and cfg.cp == 1:  # the ring needs the fused kernel: no plain twin to compare
        plain = dataclasses.replace(cfg, fused=False, offload=False, loss_chunks=1)
        plain_peak, options = predict_peak(meas, plain, world_size)["total"], " and ".join(cfg.memory_options())
        if plain_peak > usable:
            why.append(f"Without {options} it would need {plain_peak / MiB:.1f} MiB.")
        else:  # chosen for speed: without them it fits too (at the same peak where that is the optimizer step)
            why.append(f"{options[0].upper()}{options[1:]}: chosen for speed, not memory (without, the peak would "
                       f"be {plain_peak / MiB:.1f} MiB, which fits too).")
    if cfg.cp > 1:
        why.append(f"The ring (chapter 12) sends {cp_comm_bytes(meas, cfg) / 1e6:.1f} MB per rank per step, priced "
                   f"at {tp_bandwidth / 1e9:.0f} GB/s; every rank keeps the whole model, so the gradients are "
                   f"summed over all {dp * cfg.cp} of them.")
    if cfg.offload:
        why.append(f"Offloading moves {offload_bytes(meas, cfg) / 1e6:.1f} MB per step over the host link (priced "
                   f"at {host_bandwidth / 1e9:.0f} GB/s)" + ("; on a CPU machine that is chapter 11's simulation: "
                                                            "the host is the same memory, nothing is saved"
                                                            if device.type == "cpu" else "") + ".")
    if unsearched:
        why.append(unsearched.strip())
    if len(fits) > 1:
        why.append(f"Runner-up: {fits[1].config.describe()}, {fits[1].samples_per_s:.0f} samples/s.")
    t = {p: a + b * meas.timing_micro for p, (a, b) in meas.time.items()}
    for low in ("bf16", "fp8"):
        if low in t and "fp32" in t:
            why.append(f"A micro-batch of {meas.timing_micro} took {t[low] / t['fp32']:.2f}x as long in {low} as in "
                       "fp32 here.")
    if cfg.micro_batch < per_rank and any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        why.append(f"BatchNorm will see micro-batches of {cfg.micro_batch}, not the batch: consider GroupNorm "
                   "(chapter 04).")
    return " ".join(why)
