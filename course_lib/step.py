"""One training step under a configuration: precision, micro-batch with accumulation, checkpointing.

The capstone's planner (``plan``) predicts what a ``Config`` costs; this module
runs one, so the prediction can be checked against a measurement.
"""

from __future__ import annotations

import copy
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from course_lib import memory
from course_lib.checkpointing import checkpointed_sequential

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Config:
    """One way to run a training step on each rank."""

    precision: str          # "fp32", or "bf16" autocast (weights, gradients, optimizer state stay fp32)
    micro_batch: int
    accumulation_steps: int
    segments: int           # checkpoint segments over ``model.blocks``; 1 = no checkpointing
    zero_stage: int         # 0 = plain data parallel (or one device)

    def describe(self) -> str:
        ckpt = "no checkpointing" if self.segments == 1 else f"checkpointing in {self.segments} segments"
        return (f"{self.precision}, micro-batch {self.micro_batch} x {self.accumulation_steps} accumulation "
                f"steps, {ckpt}, ZeRO stage {self.zero_stage}")


def autocast(precision: str, device: torch.device | str):
    """bf16 autocast for ``"bf16"``, nothing for ``"fp32"``."""
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"unknown precision {precision!r}: choose 'fp32' or 'bf16'")
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16) if precision == "bf16" else nullcontext()


def with_checkpointing(model: nn.Module, segments: int) -> nn.Module:
    """``model`` with its ``blocks`` checkpointed in ``segments`` segments, same parameters (1: the model itself)."""
    if segments == 1:
        return model
    if not isinstance(getattr(model, "blocks", None), nn.Sequential):
        raise ValueError("checkpointing needs a model whose `blocks` attribute is an nn.Sequential")
    wrapped = copy.copy(model)
    wrapped._modules = dict(model._modules)  # its own module table: the original keeps its plain blocks
    wrapped.blocks = checkpointed_sequential(model.blocks, segments)
    return wrapped


def train_step(model: nn.Module, loss_fn: LossFn, inputs: torch.Tensor, targets: torch.Tensor,
               optimizer: torch.optim.Optimizer, config: Config) -> float:
    """One optimizer step of ``config`` on one rank's batch (``model`` from ``with_checkpointing``); the mean loss."""
    if len(inputs) != config.micro_batch * config.accumulation_steps:
        raise ValueError(f"the batch has {len(inputs)} samples; {config.describe()} needs "
                         f"{config.micro_batch * config.accumulation_steps}")
    optimizer.zero_grad(set_to_none=True)
    total = 0.0
    for x, y in zip(inputs.split(config.micro_batch), targets.split(config.micro_batch)):
        with autocast(config.precision, inputs.device):
            loss = loss_fn(model(x), y) / config.accumulation_steps  # equal micro-batches, equal weights
        loss.backward()  # frees this micro-batch's activations before the next forward
        total += loss.item()
    optimizer.step()
    return total


def measure_peak(model: nn.Module, loss_fn: LossFn, inputs: torch.Tensor, targets: torch.Tensor,
                 optimizer: torch.optim.Optimizer, config: Config) -> int:
    """Measured peak bytes of one ``train_step``, counted as ``predict_peak`` counts (states + batch + transients).

    Call it after a first step (Adam makes its state then). The gradients are freed
    first: the CPU profiler cannot see the free of a tensor made before it started.
    """
    optimizer.zero_grad(set_to_none=True)
    resident = (memory.param_bytes(model) + memory.optimizer_state_bytes(optimizer)
                + memory.tensor_bytes(inputs) + memory.tensor_bytes(targets))
    step = lambda: train_step(model, loss_fn, inputs, targets, optimizer, config)  # noqa: E731
    return resident + memory.peak_bytes(step, inputs.device)
