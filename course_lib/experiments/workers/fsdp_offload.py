"""Chapter 11's FSDP2 run with and without ``CPUOffloadPolicy``: per-rank memory and step time.

    torchrun --nproc-per-node 2 -m course_lib.experiments.workers.fsdp_offload --cfg '{"d_model": 1024, ...}'

FSDP2 (chapter 09) shards the parameters, gradients and Adam state over the
ranks. ``fully_shard(..., offload_policy=CPUOffloadPolicy())`` keeps each rank's
shards in (pinned) host memory instead: the forward and backward passes copy one
block's parameter shard to the GPU before gathering it, the reduce-scattered
gradient shards go back to the host, and the optimizer step runs on the CPU. The
GPU then holds the activations and the blocks being computed, not the model
states; the step pays the copies and a CPU optimizer step.

Reported per mode (``none``, ``cpu``): the mean loss per step, every rank's
state bytes on the device and on the host, its CUDA peak (``memory.peak_bytes``, from building the model on)
and the median step time, timed with CUDA events around the whole step (the CPU
optimizer step included). Pinned memory needs CUDA: with ``--pin-memory 0`` the
same code runs on CPU ranks (gloo), which checks that offload changes no loss;
there the device is the host, and no memory or time it reports means anything.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from course_lib import memory
from course_lib.experiments import launch
from course_lib.experiments.dp_methods import fsdp2_adam, train_steps
from course_lib.experiments.run_config import RunConfig, build_model
from course_lib.experiments.results import gather_per_rank
from course_lib.experiments.zero_meters import held_bytes_by_device

MODES = ("none", "cpu")


def run_mode(mode: str, cfg: RunConfig, rank: int, world: int, device: torch.device, pin_memory: bool) -> dict:
    """Train ``cfg.steps`` Adam steps with FSDP2 (chapter 09's ZeRO-3), its shards on the host when ``mode`` is cpu."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
    losses: list[float] = []
    times: list[float] = []
    held: dict[str, int] = {}

    def train() -> None:
        model, opt = fsdp2_adam(cfg, device, CPUOffloadPolicy(pin_memory=pin_memory) if mode == "cpu" else None)
        losses.extend(train_steps(model, opt, cfg, device, times=times))
        held.update(held_bytes_by_device(model, opt))

    if device.type == "cuda":
        torch.cuda.empty_cache()  # the blocks the previous mode left cached are not this mode's
        peak = gather_per_rank(memory.peak_bytes(train, device))  # the model's construction included
    else:
        train()
        peak = None
    return {"losses": losses, "device_state_bytes": gather_per_rank(held["cuda"]),
            "host_state_bytes": gather_per_rank(held["cpu"]),
            "step_s": statistics.median(times[1:] if len(times) > 1 else times), "cuda_peak_bytes": peak}


def run_modes(a: argparse.Namespace, rank: int, world: int, device: torch.device) -> dict:
    """Every mode of ``a.modes`` on the same ``RunConfig``."""
    cfg = RunConfig.from_json(a.cfg)
    if a.pin_memory and device.type != "cuda":
        raise RuntimeError("CPUOffloadPolicy(pin_memory=True) needs CUDA ranks; these run on the CPU "
                           "(pass --pin-memory 0 to check the losses there)")
    modes = {m: run_mode(m, cfg, rank, world, device, bool(a.pin_memory)) for m in a.modes.split(",")}
    return {"world": world, "device": device.type, "num_params": sum(p.numel() for p in build_model(cfg).parameters()),
            "modes": modes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cfg", default=RunConfig().to_json(), help="RunConfig as JSON")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated from {MODES}")
    parser.add_argument("--pin-memory", type=int, default=1, help="1: pinned host buffers (CUDA only)")
    launch.serve(parser, run_modes)


if __name__ == "__main__":
    main()
