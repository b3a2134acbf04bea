"""Activation offload: move what autograd saves off the device until the backward pass needs it (chapter 11).

Checkpointing (chapter 05) drops saved tensors and recomputes them; offloading copies them to host memory in the
forward pass and back in the backward: nothing is recomputed, but every offloaded byte crosses the host link twice
(PCIe 4.0 x16: about 25 GB/s, against a GPU's 1-5 TB/s), so it pays when the copies overlap with compute. Both ride
on ``torch.autograd.graph.saved_tensors_hooks(pack, unpack)``: autograd stores ``pack(t)`` for every saved ``t``.

- ``OffloadToHost``: the hooks by hand. On CUDA, ``pack`` copies to host memory; on a CPU machine the device *is*
  the host, so it copies into a NumPy array, which PyTorch's allocator does not count: exact in bytes, not in time.
- ``CountedSaveOnCpu``: PyTorch's ``save_on_cpu``, counting what it copies (on a CPU machine: nothing).
- ``Offloaded`` and ``offload_blocks``: each block of a model under the hooks.
- ``predict_offload_peak`` and ``offload_traffic_bytes``: what a planner needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import numpy as np
import torch
from torch import nn
from torch.autograd.graph import save_on_cpu, saved_tensors_hooks


@dataclass
class _OnHost:
    """A saved tensor's bytes off the device, and what is needed to rebuild it there."""

    device: torch.device
    dtype: torch.dtype
    shape: torch.Size
    data: np.ndarray | torch.Tensor  # NumPy bytes (a CPU machine) or a host tensor (from CUDA)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class OffloadToHost(saved_tensors_hooks):
    """Saved-tensor hooks that copy every saved tensor to the host and back (by hand).

    ``keep``: tensors to leave where they are (pass ``model.parameters()``: a
    weight exists anyway, copying it would only cost traffic). ``min_bytes``:
    leave smaller tensors too (each copy has a fixed cost). ``pin_memory``
    (CUDA only): page-locked host buffers, so the copies can run asynchronously.
    Counts, since the last ``reset``: ``copies``, ``copied_bytes`` (device to
    host), ``reloaded_bytes`` (host to device), ``kept_bytes`` (saved tensors
    below ``min_bytes``, left on the device; the ``keep`` tensors are not counted).
    A tensor saved by two ops is packed, and copied, twice. Tensors come back
    contiguous (a transposed view as a plain copy): a matmul may then sum in
    another order, so gradients agree to rounding, not to the bit.
    """

    def __init__(self, keep: Iterable[torch.Tensor] = (), min_bytes: int = 0, pin_memory: bool = False):
        if min_bytes < 0:
            raise ValueError(f"min_bytes must be >= 0, got {min_bytes}")
        if pin_memory and not torch.cuda.is_available():
            raise ValueError("pin_memory=True needs CUDA (pinned memory is for fast copies to a GPU); "
                             "use pin_memory=False on a CPU machine")
        self.min_bytes, self.pin_memory = min_bytes, pin_memory
        self._keep = {t.untyped_storage().data_ptr() for t in keep}
        self.reset()
        super().__init__(self._pack, self._unpack)

    def reset(self) -> None:
        self.copies = self.copied_bytes = self.reloaded_bytes = self.kept_bytes = 0

    def _pack(self, t: torch.Tensor) -> torch.Tensor | _OnHost:
        nbytes = _nbytes(t)
        if t.untyped_storage().data_ptr() in self._keep:
            return t
        if nbytes < self.min_bytes:
            self.kept_bytes += nbytes
            return t
        self.copies += 1
        self.copied_bytes += nbytes
        if t.device.type == "cpu":
            # as raw bytes: NumPy has no bfloat16. The device copy is freed once no one else holds it.
            data: np.ndarray | torch.Tensor = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().copy()
        else:
            data = torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pin_memory)
            data.copy_(t, non_blocking=self.pin_memory)  # stream-ordered: the device block is reused after it
        return _OnHost(t.device, t.dtype, t.shape, data)

    def _unpack(self, packed: torch.Tensor | _OnHost) -> torch.Tensor:
        if torch.is_tensor(packed):
            return packed
        self.reloaded_bytes += packed.shape.numel() * packed.dtype.itemsize
        if isinstance(packed.data, np.ndarray):
            # clone(): the copy back "to the device", into memory the allocator counts again
            return torch.from_numpy(packed.data).view(packed.dtype).reshape(packed.shape).clone()
        return packed.data.to(packed.device, non_blocking=self.pin_memory)


class CountedSaveOnCpu(save_on_cpu):
    """``torch.autograd.graph.save_on_cpu``, counting the ``copies`` and ``copied_bytes`` it makes.

    A copy is a packed tensor in other memory than the original; on a CPU
    machine ``tensor.cpu()`` returns the tensor itself, and none are made.
    """

    def __init__(self, pin_memory: bool = False, device_type: str = "cuda"):
        super().__init__(pin_memory=pin_memory, device_type=device_type)
        self.copies = self.copied_bytes = 0
        inner = self.pack_hook

        def pack(t: torch.Tensor) -> tuple[torch.device, torch.Tensor]:
            device, packed = inner(t)
            if packed.untyped_storage().data_ptr() != t.untyped_storage().data_ptr():
                self.copies += 1
                self.copied_bytes += _nbytes(t)
            return device, packed

        self.pack_hook = pack  # what __enter__ installs


class Offloaded(nn.Module):
    """One module whose forward runs under ``hooks``: what it saves for backward goes where the hooks put it."""

    def __init__(self, module: nn.Module, hooks: saved_tensors_hooks):
        super().__init__()
        self.module = module
        self.hooks = hooks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.hooks:
            return self.module(x)


def offload_blocks(blocks: nn.Sequential, hooks: saved_tensors_hooks) -> nn.Sequential:
    """A new ``nn.Sequential`` of the same blocks, each run under ``hooks``.

    Apply it as ``model.blocks = offload_blocks(model.blocks, OffloadToHost(model.parameters()))``.
    The embedding, the head and the loss keep their saved tensors on the device.
    """
    if not isinstance(blocks, nn.Sequential):
        raise ValueError(f"expected an nn.Sequential of blocks, got {type(blocks).__name__}")
    return nn.Sequential(*[Offloaded(b, hooks) for b in blocks])


# ----- what a planner needs -------------------------------------------------------------


def predict_offload_peak(peak_without: int, n_blocks: int, block_saved_bytes: int) -> int:
    """The peak of a step whose ``n_blocks`` blocks offload what they save, from the peak without offload.

    The saves of all blocks but one leave the device: in the backward pass they
    come back one autograd node at a time, never more than one block's worth,
    next to that block's gradient temporaries. A planning estimate, not a bound:
    measured (chapter 11, the tests) at most 5% below the real peak, and up to
    about half above it when a block's backward needs less than it saved. The peak
    cannot fall below ``peak_without - n_blocks * block_saved_bytes``, what the
    head and the loss need (chapter 11's chunked loss).
    """
    if n_blocks < 1 or block_saved_bytes < 0:
        raise ValueError(f"need n_blocks >= 1 and block_saved_bytes >= 0, got {n_blocks}, {block_saved_bytes}")
    if peak_without < n_blocks * block_saved_bytes:
        raise ValueError(f"a peak of {peak_without} bytes cannot hold {n_blocks} blocks' saves of "
                         f"{block_saved_bytes} bytes each: pass the peak of the same step without offload")
    return peak_without - (n_blocks - 1) * block_saved_bytes


def offload_traffic_bytes(n_blocks: int, block_packed_bytes: int) -> int:
    """Bytes over the host link per step: each packed byte out in the forward pass and back in the backward."""
    if n_blocks < 0 or block_packed_bytes < 0:
        raise ValueError(f"need non-negative counts, got {n_blocks}, {block_packed_bytes}")
    return 2 * n_blocks * block_packed_bytes
