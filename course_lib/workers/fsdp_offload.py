"""Chapter 11's FSDP2 run with and without ``CPUOffloadPolicy``: per-rank memory and step time.

    torchrun --nproc-per-node 2 -m course_lib.workers.fsdp_offload --cfg '{"d_model": 1024, ...}'

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
import torch.distributed as dist
from torch import nn

from course_lib import memory, timing
from course_lib.distributed import launch
from course_lib.distributed.experiment import RunConfig, build_model, local_batch
from course_lib.distributed.results import gather_per_rank, mean_over_ranks
from course_lib.distributed.zero import shard_fsdp2
from course_lib.models import lm_loss

MODES = ("none", "cpu")


def shard(model: nn.Module, offload: bool, pin_memory: bool) -> nn.Module:
    """``zero.shard_fsdp2`` (chapter 09's ZeRO-3), its shards on the host when ``offload``."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    return shard_fsdp2(model, offload_policy=CPUOffloadPolicy(pin_memory=pin_memory) if offload else None)


def state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    """This rank's bytes of parameter shards, gradient shards and optimizer state, by device type."""
    out = {"cpu": 0, "cuda": 0}

    def add(t: torch.Tensor) -> None:
        local = t.to_local() if hasattr(t, "to_local") else t
        out[local.device.type] = out.get(local.device.type, 0) + local.numel() * local.element_size()

    for p in model.parameters():
        add(p)
        if p.grad is not None:
            add(p.grad)
    for state in opt.state.values():
        for v in state.values():
            if torch.is_tensor(v):
                add(v)
    return out


def run_mode(mode: str, cfg: RunConfig, rank: int, world: int, device: torch.device, pin_memory: bool) -> dict:
    """Train ``cfg.steps`` Adam steps with FSDP2, offloaded to the host or not."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
    losses: list[float] = []
    times: list[float] = []
    held: dict[str, int] = {}

    def train() -> None:
        model = shard(build_model(cfg, device), offload=mode == "cpu", pin_memory=pin_memory)
        opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)  # on the host's shards when offloaded
        for s in range(cfg.steps):
            x, y = local_batch(cfg, s, rank, world, device)
            holder: list[torch.Tensor] = []

            def step() -> None:
                opt.zero_grad()
                holder.append(lm_loss(model(x), y))
                holder[0].backward()
                opt.step()
            dist.barrier()
            times.append(timing.time_s(step, device))  # CUDA events on a GPU, the host's work in between included
            losses.append(mean_over_ranks(holder[0].item(), device))
        held.update(state_bytes(model, opt))

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
