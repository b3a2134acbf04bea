"""A ``Config`` run for real: ``train_step``, and ``measure_peak``, its measured peak (chapter 13, section 2 on).

The capstone verifies every plan by running it. Each lever of a ``Config`` is a context manager that changes the
model in place for the step and restores it after, also after an error: ``autocast`` (chapter 05's bf16),
``fp8_matmuls`` (chapter 06's FP8 linear layers), ``checkpointing`` (chapter 05), ``attention_kernel`` (chapter
11's fused attention) and ``offloading`` (chapter 11); the micro-batches accumulate (chapter 03), and the loss may
run in chunks (chapter 11). ``measure_peak`` counts what ``predict.predict_peak`` predicts: the states, the batch,
and the step's peak above them (``memory.peak_bytes``).
"""

from __future__ import annotations

import types
from contextlib import contextmanager, nullcontext
from typing import Callable, Iterator

import torch
from torch import nn

from course_lib import chunked_loss, kernels, memory, offload
from course_lib.checkpointing import checkpointed_sequential
from course_lib.fp8_linear import FP8Linear, check_features
from course_lib.models import CausalSelfAttention, lm_loss
from course_lib.planner.config import Config

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


PRECISIONS = ("fp32", "bf16", "fp8")


def autocast(precision: str, device: torch.device | str):
    """bf16 autocast for ``"bf16"``; nothing for ``"fp32"``, nor for ``"fp8"``, whose ops outside the blocks'
    matmuls run in float32 (``fp8_matmuls`` changes the matmuls)."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}: choose one of {', '.join(PRECISIONS)}")
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16) if precision == "bf16" else nullcontext()


@contextmanager
def fp8_matmuls(model: nn.Module, on: bool = True) -> Iterator[nn.Module]:
    """Inside the block every ``nn.Linear`` of ``model.blocks`` runs ``FP8Linear``'s forward (chapter 06: e4m3
    inputs and weights, e5m2 gradients, float32 master weights, FP8 copies saved); restored after. The same
    parameters and modules: only the matmuls change. The head and the embedding stay float32, as DeepSeek-V3's FP8
    recipe keeps them in higher precision. ``on=False``: unchanged."""
    if not on:
        yield model
        return
    blocks = getattr(model, "blocks", None)
    layers = {name: m for name, m in blocks.named_modules() if type(m) is nn.Linear} if isinstance(
        blocks, nn.Module) else {}
    if not layers:
        raise ValueError("fp8 needs a model whose `blocks` hold nn.Linear layers (course_lib.models' transformers)")
    for name, m in layers.items():
        check_features(m, f"fp8: blocks.{name}")
    for m in layers.values():
        m.forward = types.MethodType(FP8Linear.forward, m)  # an instance attribute: wins over the class's forward
    try:
        yield model
    finally:
        for m in layers.values():
            del m.forward


def bf16_kernels(precision: str, device: torch.device | str):
    """For ``"bf16"``, this machine's bf16 matmuls as measured (``kernels.bf16_matmuls``: emulated where the CPU's
    are slow or broken); nothing otherwise. Around a backward too: its matmuls are bf16 as well."""
    return kernels.bf16_matmuls(device) if precision == "bf16" else nullcontext()


@contextmanager
def precision(model: nn.Module, name: str, device: torch.device | str) -> Iterator[nn.Module]:
    """Both precision levers at once: ``autocast(name)`` and, for ``"fp8"``, ``fp8_matmuls``."""
    with fp8_matmuls(model, name == "fp8"), bf16_kernels(name, device), autocast(name, device):
        yield model


@contextmanager
def _blocks_replaced(model: nn.Module, what: str, wrap: Callable[[nn.Sequential], nn.Module]) -> Iterator[nn.Module]:
    """Inside the block ``model.blocks`` is ``wrap(model.blocks)``; restored after, also after an error.

    The model's forward calls ``self.blocks``: swapping that one child for a wrapper of the same blocks (same
    parameters) changes the step and nothing else, and copies nothing.
    """
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.Sequential):
        raise ValueError(f"{what} needs a model whose `blocks` attribute is an nn.Sequential")
    model.blocks = wrap(blocks)
    try:
        yield model
    finally:
        model.blocks = blocks


@contextmanager
def checkpointing(model: nn.Module, segments: int) -> Iterator[nn.Module]:
    """Inside the block, ``model.blocks`` runs checkpointed in ``segments`` segments (1: unchanged); restored after."""
    if segments == 1:
        yield model
        return
    with _blocks_replaced(model, "checkpointing", lambda blocks: checkpointed_sequential(blocks, segments)):
        yield model


@contextmanager
def offloading(model: nn.Module, on: bool = True) -> Iterator[nn.Module]:
    """Inside the block, every block of ``model.blocks`` saves into host memory (``offload.OffloadToHost``, the
    parameters left in place): pinned on CUDA; on a CPU machine chapter 11's simulation, NumPy memory that the
    allocator does not count. ``on=False``: unchanged."""
    if not on:
        yield model
        return
    hooks = offload.OffloadToHost(keep=model.parameters(), pin_memory=next(model.parameters()).is_cuda)
    with _blocks_replaced(model, "offloading", lambda blocks: offload.offload_blocks(blocks, hooks)):
        yield model


@contextmanager
def attention_kernel(model: nn.Module, fused: bool) -> Iterator[nn.Module]:
    """Inside the block every ``CausalSelfAttention`` of ``model`` runs fused (chapter 11) or op by op; restored
    after. Only the kernel changes: the same parameters, the same function."""
    layers = [m for m in model.modules() if isinstance(m, CausalSelfAttention)]
    if fused and not layers:
        raise ValueError("fused attention needs a model with CausalSelfAttention layers (course_lib.models)")
    before = [m.fused for m in layers]
    for m in layers:
        m.fused = fused
    try:
        yield model
    finally:
        for m, was in zip(layers, before):
            m.fused = was


def train_step(model: nn.Module, loss_fn: LossFn, inputs: torch.Tensor, targets: torch.Tensor,
               optimizer: torch.optim.Optimizer, config: Config) -> float:
    """One optimizer step of ``config`` on one rank's batch; the mean loss.

    With ``config.loss_chunks > 1`` the loss is ``chunked_loss.transformer_loss``: ``lm_loss`` in chunks, so
    ``loss_fn`` must be ``lm_loss``.
    """
    if len(inputs) != config.micro_batch * config.accumulation_steps:
        raise ValueError(f"the batch has {len(inputs)} samples; {config.describe()} needs "
                         f"{config.micro_batch * config.accumulation_steps}")
    if config.loss_chunks > 1 and loss_fn is not lm_loss:
        raise ValueError("a loss in chunks is models.lm_loss computed from the head's input: pass loss_fn=lm_loss, "
                         "or loss_chunks=1 for another loss")
    optimizer.zero_grad(set_to_none=True)
    total = 0.0
    with (fp8_matmuls(model, config.precision == "fp8"), checkpointing(model, config.segments),
          attention_kernel(model, config.fused), offloading(model, config.offload),
          bf16_kernels(config.precision, inputs.device)):
        for x, y in zip(inputs.split(config.micro_batch), targets.split(config.micro_batch)):
            with autocast(config.precision, inputs.device):
                loss = (chunked_loss.transformer_loss(model, x, y, config.loss_chunks) if config.loss_chunks > 1
                        else loss_fn(model(x), y))
                loss = loss / config.accumulation_steps  # equal micro-batches, equal weights
            loss.backward()  # frees this micro-batch's activations before the next forward
            total += loss.item()
    optimizer.step()
    return total


def measure_peak(model: nn.Module, loss_fn: LossFn, inputs: torch.Tensor, targets: torch.Tensor,
                 optimizer: torch.optim.Optimizer, config: Config) -> int:
    """Measured peak bytes of one ``train_step``, counted as ``predict_peak`` counts (states + batch + transients).

    Call it after a first step (Adam makes its state then). The gradients are freed first: the CPU profiler
    cannot see the free of a tensor made before it started.
    """
    optimizer.zero_grad(set_to_none=True)
    resident = (memory.param_bytes(model) + memory.optimizer_state_bytes(optimizer)
                + memory.tensor_bytes(inputs) + memory.tensor_bytes(targets))
    return resident + memory.peak_bytes(lambda: train_step(model, loss_fn, inputs, targets, optimizer, config),
                                        inputs.device)
