"""Exact byte accounting and a memory estimator (chapter 01).

Training memory has four parts:

- parameters: ``numel * element size`` of every parameter;
- gradients: one tensor like each trainable parameter (after ``backward``);
- optimizer state: SGD none, SGD with momentum one buffer, Adam two
  (``exp_avg`` and ``exp_avg_sq``) plus a scalar ``step`` per parameter tensor;
- activations: the tensors autograd saves during the forward pass for use in
  the backward pass. They grow with the batch and usually dominate.

``measure`` counts what really exists; ``estimate`` predicts it from the model
and the batch shape alone, layer by layer, without running the computation.
"""

from __future__ import annotations

import copy
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch
from torch import nn

from course_lib.models import CausalSelfAttention

GB = 1e9  # the ZeRO paper reports decimal gigabytes
OPTIMIZER_STATES = {"sgd": 0, "momentum": 1, "adam": 2}  # fp32 buffers per parameter


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of the tensor's own elements (not of a larger storage it may view)."""
    return t.numel() * t.element_size()


def param_bytes(model: nn.Module) -> int:
    """Bytes of all parameters, each shared parameter once."""
    return sum(tensor_bytes(p) for p in model.parameters())


def grad_bytes(model: nn.Module) -> int:
    """Bytes of the ``.grad`` tensors that exist now (zero before the first backward)."""
    return sum(tensor_bytes(p.grad) for p in model.parameters() if p.grad is not None)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in the optimizer's state (empty until its first step)."""
    return sum(
        tensor_bytes(v) for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)
    )


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    # Views share one storage; key by the storage's address so each is counted once.
    return (str(t.device), t.untyped_storage().data_ptr())


def saved_activation_bytes(fn: Callable[[], object], exclude: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of the tensors autograd saves for backward while ``fn()`` runs.

    Counted by storage (a view and its base count once) and without the
    storages of ``exclude`` (pass ``model.parameters()``: weights are saved too,
    but they are not activations).
    """
    excluded = {_storage_key(t) for t in exclude}
    seen: dict[tuple[str, int], int] = {}
    keep: list[torch.Tensor] = []  # hold every saved tensor so no address is reused while we count

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key not in excluded:
            seen[key] = t.untyped_storage().nbytes()
            keep.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def measure(model: nn.Module, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
            inputs: torch.Tensor, targets: torch.Tensor, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Run one real training step and count params, grads, optimizer state and saved activations."""
    optimizer.zero_grad(set_to_none=True)
    holder: list[torch.Tensor] = []
    acts = saved_activation_bytes(lambda: holder.append(loss_fn(model(inputs), targets)),
                                  exclude=list(model.parameters()))
    holder[0].backward()
    optimizer.step()
    out = {"params": param_bytes(model), "grads": grad_bytes(model),
           "optimizer": optimizer_state_bytes(optimizer), "activations": acts}
    out["total"] = sum(out.values())
    return out


# ----- the estimator -------------------------------------------------------------
# What each layer saves for its backward pass, as (tensor, bytes per element)
# pairs. Running on the "meta" device gives shapes without computing anything.
# Tensors are keyed by identity, so a ReLU's output that the next convolution
# also saves is counted once, as autograd does; ``None`` marks a tensor that
# only this layer creates (statistics, masks), always counted.


def _layer_saves(module: nn.Module, inp: torch.Tensor, out: torch.Tensor,
                 act_size: int, mask_size: int) -> list[tuple[torch.Tensor | None, int]]:
    n_in = inp.numel() if torch.is_tensor(inp) else 0
    if isinstance(module, (nn.Linear, nn.Conv2d, nn.Conv1d)):
        return [(inp, n_in * act_size)]                       # input, for the weight gradient
    if isinstance(module, (nn.ReLU, nn.Sigmoid, nn.Tanh, nn.Softmax)):
        return [(out, out.numel() * 4)]                       # output: the derivative needs it
    if isinstance(module, (nn.GELU, nn.SiLU)):
        return [(inp, n_in * 4)]                              # input: the derivative needs it
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        c = inp.shape[1]
        return [(inp, n_in * 4), (None, 4 * c * 4)]  # input; mean, invstd, running stats
    if isinstance(module, nn.LayerNorm):
        rows = n_in // max(1, module.normalized_shape[-1])
        return [(inp, n_in * 4), (None, 2 * rows * 4)]  # input; mean and rstd per row
    if isinstance(module, nn.GroupNorm):
        return [(inp, n_in * 4), (None, 2 * inp.shape[0] * module.num_groups * 4)]
    if isinstance(module, nn.Embedding):
        return [(inp, n_in * 8)]                              # the int64 indices
    if isinstance(module, nn.Dropout) and module.p > 0:
        return [(None, out.numel() * mask_size)]  # the keep-mask: bool on CUDA, float on CPU
    if isinstance(module, nn.MaxPool2d):
        return [(inp, n_in * 4), (None, out.numel() * 8)]
    if isinstance(module, CausalSelfAttention):
        B, T, C = inp.shape
        H = module.n_heads
        # q, k and v (saved by the two matmuls), the softmax output (saved by
        # softmax and by att @ v), and the causal mask buffer. The two Linear
        # layers inside are counted by their own rule.
        saves = [(None, 3 * B * T * C * act_size),
                 (None, B * H * T * T * 4),
                 (module.mask, module.mask.numel())]
        if isinstance(module.attn_drop, nn.Dropout):
            # att @ v then saves the dropped-out copy as well (its mask is counted by Dropout's rule)
            saves.append((None, B * H * T * T * act_size))
        return saves
    return []


def _leaf_like(module: nn.Module) -> bool:
    return len(list(module.children())) == 0 or isinstance(module, CausalSelfAttention)


def estimate_activation_bytes(model: nn.Module, batch_shape: tuple[int, ...], act_size: int = 4,
                              device: str = "cpu", with_loss: bool = True) -> int:
    """Predict saved-activation bytes of one forward pass plus the cross-entropy loss.

    ``act_size``: bytes per element of what matmuls and convolutions save (4 in
    fp32, 2 under bf16 autocast). ``device`` matters for dropout: CUDA saves a
    1-byte mask, the CPU a float mask the size of the input.
    """
    mask_size = 1 if device.startswith("cuda") else act_size
    meta = copy.deepcopy(model).to("meta").train()
    is_tokens = any(isinstance(m, nn.Embedding) for m in meta.modules())
    x = torch.empty(batch_shape, dtype=torch.long if is_tokens else torch.float32, device="meta")
    saved: dict[object, int] = {}
    keep: list[object] = []  # keeps every keyed tensor alive, so no id is reused

    def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        for tensor, nbytes in _layer_saves(module, args[0] if args else None, out, act_size, mask_size):
            key = object() if tensor is None else tensor
            keep.append(key)
            saved[id(key)] = nbytes

    handles = [m.register_forward_hook(hook) for m in meta.modules() if _leaf_like(m)]
    try:
        logits = meta(x)
    except Exception as exc:
        raise ValueError(f"batch shape {tuple(batch_shape)} does not fit {type(model).__name__}: {exc}") from exc
    finally:
        for h in handles:
            h.remove()
    if with_loss:
        # cross_entropy = log_softmax (saves its output) + nll_loss (saves the targets)
        rows = logits.numel() // logits.shape[-1]
        saved["loss"] = logits.numel() * 4 + rows * 8
    return sum(saved.values())


def estimate(model: nn.Module, batch_shape: tuple[int, ...], optimizer: str = "adam",
             precision: str = "fp32", device: str = "cpu") -> dict[str, int]:
    """Predict the bytes of one training step: ``params``, ``grads``, ``optimizer``, ``activations``, ``total``.

    ``optimizer``: ``"sgd"``, ``"momentum"`` or ``"adam"``. ``precision``:
    ``"fp32"``, or ``"bf16"`` for autocast (fp32 weights, gradients and
    optimizer state; the inputs that matmuls and convolutions save are bf16).
    """
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"unknown optimizer {optimizer!r}: choose one of {', '.join(OPTIMIZER_STATES)}")
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"unknown precision {precision!r}: choose 'fp32' or 'bf16'")
    params = list(model.parameters())
    p_bytes = sum(tensor_bytes(p) for p in params)
    trainable = [p for p in params if p.requires_grad]
    g_bytes = sum(tensor_bytes(p) for p in trainable)
    o_bytes = OPTIMIZER_STATES[optimizer] * g_bytes
    if optimizer == "adam":
        o_bytes += 4 * len(trainable)  # torch.optim.Adam keeps a float32 scalar 'step' per tensor
    acts = estimate_activation_bytes(model, batch_shape, act_size=2 if precision == "bf16" else 4,
                                     device=str(device))
    out = {"params": p_bytes, "grads": g_bytes, "optimizer": o_bytes, "activations": acts}
    out["total"] = sum(out.values())
    return out


def zero_memory(num_params: float, num_devices: int, stage: int, optimizer_multiplier: float = 12, *,
                param_bytes: float = 2, grad_bytes: float = 2) -> float:
    """Bytes per device of the model states under ZeRO (Rajbhandari et al. 2020, Figure 1).

    Each parameter costs ``param_bytes`` (2: fp16 weights) + ``grad_bytes`` (2:
    fp16 gradients) + K = ``optimizer_multiplier`` (12: fp32 master weights,
    momentum, variance). Stage 1 shards the K bytes over the devices, stage 2
    the gradients too, stage 3 the weights too; stage 0 is plain data
    parallelism. Activations are not included. This is the course's one ZeRO
    formula: ``distributed.zero.zero_bytes_per_rank`` splits it into its parts.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")
    if num_devices < 1:
        raise ValueError(f"num_devices must be at least 1, got {num_devices}")
    n, d = float(num_params), float(num_devices)
    weights = param_bytes * n / (d if stage >= 3 else 1)
    grads = grad_bytes * n / (d if stage >= 2 else 1)
    states = optimizer_multiplier * n / (d if stage >= 1 else 1)
    return weights + grads + states


# ----- peak memory -----------------------------------------------------------------


def cuda_peak_bytes(fn: Callable[[], object], device: torch.device | str = "cuda") -> int:
    """Peak CUDA memory allocated while ``fn()`` runs, above what was allocated before."""
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


@contextmanager
def _quiet_native_stderr() -> Iterator[None]:
    """Send file descriptor 2 to /dev/null: the profiler's C++ side logs a few lines there at start and stop."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no descriptor 2 (some embedded interpreters): nothing to silence
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def cpu_peak_bytes(fn: Callable[[], object]) -> int:
    """Peak CPU memory allocated by PyTorch while ``fn()`` runs, above the start.

    Replays the profiler's allocation records (every allocation and free of
    the CPU allocator, in time order), so it sees temporaries that live only
    inside an op. Frees of tensors made before ``fn`` are not recorded.
    """
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _quiet_native_stderr():
        prof.start()
    try:
        fn()
    finally:
        with _quiet_native_stderr():
            prof.stop()
    # The raw records, not ``prof.events()``: there an allocation made inside
    # an op is folded into that op's totals and its moment is lost.
    allocations = sorted(
        ((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
         if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU),
        key=lambda x: x[0],
    )
    live = peak = 0
    for _, nbytes in allocations:
        live += nbytes
        peak = max(peak, live)
    return peak


def peak_bytes(fn: Callable[[], object], device: torch.device | str) -> int:
    """Peak bytes allocated while ``fn()`` runs: CUDA statistics on a GPU, profiler events on the CPU."""
    if torch.device(device).type == "cuda":
        return cuda_peak_bytes(fn, device)
    return cpu_peak_bytes(fn)


@contextmanager
def cuda_memory_history(path: str | Path, max_entries: int = 100_000, stacks: str = "python") -> Iterator[None]:
    """Record CUDA allocations to a snapshot file for https://pytorch.org/memory_viz (GPU only).

    ``stacks="python"`` keeps the Python stack of each allocation; ``"all"`` adds the
    C++ frames, whose symbolisation can make the dump take minutes on a long run.
    """
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks=stacks)
    try:
        yield
    finally:
        torch.cuda.memory._dump_snapshot(str(path))
        torch.cuda.memory._record_memory_history(enabled=None)


def largest_fitting(fits: Callable[[int], bool], limit: int = 1 << 16) -> int:
    """The largest ``n`` in 1..limit with ``fits(n)`` true, assuming ``fits`` turns false once and stays false.

    Doubles until the first failure, then bisects: about 2 log2(n) calls of
    ``fits`` (each may be a real training step that runs out of memory).
    Returns 0 when even ``n = 1`` does not fit.
    """
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:  # invariant: fits(lo), not fits(hi) (or hi is past the limit)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
