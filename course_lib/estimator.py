"""A memory estimator: the bytes of a training step predicted from the model and the batch shape (chapter 01).

``estimate`` predicts what ``memory.measure`` counts (parameters, gradients,
optimizer state, saved activations) without running the computation: a copy
of the model runs on the "meta" device, which gives shapes and dtypes only,
and each layer's rule below says what it saves for backward. In fp32 or under
bf16 autocast, whose saved tensors are partly bf16, partly fp32, and not quite
the same on the CPU and on CUDA (see the notes on autocast below).
``attention_saved_bytes`` is its formula for an attention layer, naive or
fused (chapter 11). Checked against ``memory``'s counts in tests/test_memory.py.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from course_lib.memory import autocast_dtype, device_type, tensor_bytes
from course_lib.models import CausalSelfAttention

OPTIMIZER_STATES = {"sgd": 0, "momentum": 1, "adam": 2}  # fp32 buffers per parameter


# What each layer saves for its backward pass, as (key, bytes) pairs. Running a
# copy of the model on the "meta" device gives shapes (and dtypes) without
# computing anything. A key is the saved tensor itself when a later layer may
# save the same one (a ReLU's output that the next convolution also saves is
# counted once, as autograd does), ``None`` for a tensor only this layer makes
# (statistics, masks, autocast's low-precision copies), always counted.
#
# Under autocast each op runs in a dtype chosen from PyTorch's op lists
# (https://pytorch.org/docs/stable/amp.html#autocast-op-reference; the source of
# truth is aten/src/ATen/autocast_mode.cpp). For the course's layers:
# - on both devices linear, matmul and convolutions run in the low-precision dtype; they
#   save a low-precision copy of their input (unless it is one already) and of their weight;
# - on CUDA layer_norm, group_norm, softmax and nll_loss run in fp32 (log_softmax too, but
#   not inside cross_entropy, which passes it a dtype); on the CPU the norms and softmax keep
#   their input's dtype, and cross_entropy runs in fp32 as a whole;
# - everything else (ReLU, GELU, BatchNorm, MABN, dropout, additions, embeddings) keeps its
#   input's dtype, the widest when it has several: bf16 + fp32 gives fp32.
# Checked against saved-tensor hooks under CPU autocast (tests/test_memory.py), and under
# CUDA autocast with fake tensors (FakeTensorMode: CUDA's dispatch without a GPU).

LOW, FP32_ON_CUDA, SAME = "low", "fp32 on cuda", "same"  # how autocast runs an op (see above)


def _run_dtype(policy: str, dtype: torch.dtype, amp: torch.dtype | None, device: str) -> torch.dtype:
    """The dtype an op of this policy runs in, given its input's dtype; ``amp``: autocast's dtype, or None."""
    if amp is None or not dtype.is_floating_point:
        return dtype
    if policy == LOW:
        return amp
    if policy == FP32_ON_CUDA and device == "cuda":
        return torch.float32
    return dtype


def _policy(module: nn.Module) -> str:
    if isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d)):
        return LOW
    if isinstance(module, (nn.LayerNorm, nn.GroupNorm, nn.Softmax)):
        return FP32_ON_CUDA
    return SAME


def _as(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor | None, int]:
    """``x`` as an op that runs in ``dtype`` saves it: itself, or autocast's new copy."""
    return (x if x.dtype == dtype else None, x.numel() * dtype.itemsize)


def _is_mabn(module: nn.Module) -> bool:
    # norms.MABN2d (chapter 04) sits below this module, so it is recognised by its two buffers, not imported.
    return hasattr(module, "stat_buffer") and hasattr(module, "grad_buffer")


def _layer_saves(module: nn.Module, x: torch.Tensor, out: torch.Tensor, amp: torch.dtype | None,
                 device: str) -> list[tuple[object, int]]:
    d = _run_dtype(_policy(module), x.dtype, amp, device) if torch.is_tensor(x) else None
    if isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d)):
        saves = [_as(x, d)]                                  # the input, for the weight gradient
        w = module.weight
        # the weight, for the input gradient: the parameter itself (not an activation) unless autocast
        # cast it (a bf16 copy) or the layer derives it (norms.CenConv2d's centred weight). A Linear keeps it
        # only when its input needs a gradient; a convolution always does.
        derived = hasattr(module, "centered_weight") or d != w.dtype
        if derived and (x.requires_grad or not isinstance(module, nn.Linear)):
            saves.append((None, w.numel() * d.itemsize))
        return saves
    if isinstance(module, (nn.ReLU, nn.Sigmoid, nn.Tanh, nn.Softmax)):
        return [(out, tensor_bytes(out))]      # the output: the derivative needs it
    if isinstance(module, (nn.GELU, nn.SiLU)):
        return [(x, tensor_bytes(x))]           # the input: the derivative needs it
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        running = 2 if module.running_mean is not None else 0
        return [_as(x, d), (None, (2 + running) * x.shape[1] * 4)]  # input; fp32 mean, invstd, running stats
    if _is_mabn(module):
        return [(x, tensor_bytes(x)), (None, 2 * x.shape[1] * 4)]  # input; 1/s and r per channel
    if isinstance(module, nn.LayerNorm):
        rows = x.numel() // math.prod(module.normalized_shape)
        return [_as(x, d), (None, 2 * rows * 4)]              # input; fp32 mean and rstd per row
    if isinstance(module, nn.GroupNorm):
        return [_as(x, d), (None, 2 * x.shape[0] * module.num_groups * 4)]
    if isinstance(module, nn.Embedding):
        return [(x, tensor_bytes(x))]           # the integer indices
    if isinstance(module, nn.Dropout) and module.p > 0:
        # the keep-mask: CUDA's fused kernel saves bool, the CPU a mask in the input's dtype
        return [(None, out.numel() * (1 if device == "cuda" else x.element_size()))]
    if isinstance(module, nn.MaxPool2d):
        return [(x, tensor_bytes(x)), (None, out.numel() * 8)]  # input; int64 argmax indices
    if isinstance(module, CausalSelfAttention):
        B, T, C = x.shape
        low = _run_dtype(LOW, x.dtype, amp, device)          # q, k, v come out of a Linear
        dropout = module.dropout > 0 and module.training
        return [(None, attention_saved_bytes(B, T, C, module.n_heads, low, fused=module.fused, dropout=dropout,
                                             autocast=amp is not None, device=device))]
    return []


def attention_saved_bytes(batch: int, seq: int, d_model: int, n_heads: int, dtype: torch.dtype = torch.float32,
                          *, fused: bool = False, dropout: bool = False, autocast: bool = False,
                          device: str = "cpu") -> int:
    """Bytes the core of one causal self-attention layer saves for backward (chapters 01, 11).

    The core is everything between the ``qkv`` and ``proj`` Linear layers; ``dtype``
    is the dtype q, k and v come in (bf16 under bf16 autocast). The naive layer
    saves q, k, v, the causal mask and the ``(B, H, T, T)`` softmax (on CUDA under
    autocast in fp32, and then a bf16 copy for ``att @ v``), with dropout its mask
    and the dropped-out matrix: quadratic in ``T``. The fused kernel
    (``F.scaled_dot_product_attention``) saves q, k, v, its output and one fp32
    log-sum-exp per row: linear in ``T``. Which kernel runs, and what it saves:

    - the CPU: its flash kernel; with dropout it has none and falls back to the math
      path, in fp32 (16-bit inputs are upcast): q, k, v and three (B, H, T, T) tensors;
    - CUDA (PyTorch's default order): flash attention for 16-bit inputs (sm80 or later),
      memory-efficient attention for fp32, which pads the log-sum-exp to a multiple of
      32 rows and writes its output as (B, T, H, hd), so that ``proj`` saves a view of
      it, counted there. Both keep a few bytes of RNG state, left out.
    """
    device = device_type(device)
    B, T, C, H, size = batch, seq, d_model, n_heads, dtype.itemsize
    if fused and dropout and device == "cpu":
        f32 = max(size, 4)
        return 3 * B * T * C * f32 + 3 * B * H * T * T * f32
    if fused and device == "cuda" and dtype == torch.float32:  # memory-efficient attention
        return 3 * B * T * C * 4 + B * H * 32 * math.ceil(T / 32) * 4
    if fused:
        return 4 * B * T * C * size + B * H * T * 4
    soft = 4 if autocast and device == "cuda" else size         # softmax: fp32 on CUDA under autocast
    saved = 3 * B * T * C * size + T * T + B * H * T * T * soft  # q, k, v; the bool mask; the softmax output
    if dropout:  # its keep-mask (CUDA's fused dropout: bool; the CPU: the input's dtype), the dropped-out matrix
        saved += B * H * T * T * ((1 if device == "cuda" else soft) + size)
    elif soft != size:  # att @ v saves autocast's bf16 copy of the fp32 softmax
        saved += B * H * T * T * size
    return saved


def _loss_saves(logits: torch.Tensor, amp: torch.dtype | None, device: str) -> int:
    """cross_entropy = log_softmax (saves its output) + nll_loss (saves that output and the int64 targets)."""
    n, rows = logits.numel(), logits.numel() // logits.shape[-1]
    if amp is None or logits.dtype == torch.float32:
        return n * logits.element_size() + rows * 8
    if device == "cuda":
        # CUDA has no entry for cross_entropy: log_softmax runs in bf16 (it is given an explicit dtype), then
        # nll_loss (on the fp32 list) saves an fp32 copy of it too.
        return n * (logits.dtype.itemsize + 4) + rows * 8
    return n * 4 + rows * 8  # the CPU list has cross_entropy_loss: one fp32 log_softmax


def _leaf_like(module: nn.Module) -> bool:
    return len(list(module.children())) == 0 or isinstance(module, CausalSelfAttention)


def estimate_activation_bytes(model: nn.Module, batch_shape: tuple[int, ...],
                              autocast_dtype: torch.dtype | None = None, device: str = "cpu",
                              with_loss: bool = True) -> int:
    """Predict saved-activation bytes of one forward pass plus the cross-entropy loss.

    ``autocast_dtype`` (e.g. ``torch.bfloat16``): the forward runs under
    ``torch.autocast(device, dtype=...)``. ``device`` (``"cpu"`` or ``"cuda"``)
    matters for dropout's mask and for which ops autocast runs in fp32.
    """
    device = device_type(device)
    meta = copy.deepcopy(model).to("meta").train()
    is_tokens = any(isinstance(m, nn.Embedding) for m in meta.modules())
    x = torch.empty(batch_shape, dtype=torch.long if is_tokens else torch.float32, device="meta")
    saved: dict[int, int] = {}
    keep: list[object] = []  # keeps every key alive, so no id is reused

    def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        inp = args[0] if args else None
        if torch.is_tensor(inp) and torch.is_tensor(out) and out.is_floating_point():
            # Give the output the dtype autocast would: later layers then see (and save) that dtype.
            out = out.to(_run_dtype(_policy(module), out.dtype, autocast_dtype, device))
        for key, nbytes in _layer_saves(module, inp, out, autocast_dtype, device):
            key = object() if key is None else key
            keep.append(key)
            saved[id(key)] = nbytes
        return out

    inside = {id(m.attn_drop) for m in meta.modules() if isinstance(m, CausalSelfAttention)}  # counted with it
    handles = [m.register_forward_hook(hook) for m in meta.modules() if _leaf_like(m) and id(m) not in inside]
    try:
        with torch.enable_grad():  # which inputs need a gradient decides what a Linear keeps
            logits = meta(x)
    except Exception as exc:
        raise ValueError(f"batch shape {tuple(batch_shape)} does not fit {type(model).__name__}: {exc}") from exc
    finally:
        for h in handles:
            h.remove()
    loss = _loss_saves(logits, autocast_dtype, device) if with_loss else 0
    return sum(saved.values()) + loss


def estimate(model: nn.Module, batch_shape: tuple[int, ...], optimizer: str = "adam",
             precision: str = "fp32", device: torch.device | str = "cpu") -> dict[str, int]:
    """Predict the bytes of one training step: ``params``, ``grads``, ``optimizer``, ``activations``, ``total``.

    ``optimizer``: ``"sgd"``, ``"momentum"`` or ``"adam"``. ``precision``:
    ``"fp32"``, or ``"bf16"`` for bf16 autocast on ``device`` (fp32 weights,
    gradients and optimizer state; the activations follow autocast's op lists
    for that device, and include the bf16 copies of the weights it saves).
    """
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"unknown optimizer {optimizer!r}: choose one of {', '.join(OPTIMIZER_STATES)}")
    amp = autocast_dtype(precision)
    params = list(model.parameters())
    p_bytes = sum(tensor_bytes(p) for p in params)
    trainable = [p for p in params if p.requires_grad]
    g_bytes = sum(tensor_bytes(p) for p in trainable)
    o_bytes = OPTIMIZER_STATES[optimizer] * g_bytes
    if optimizer == "adam":
        o_bytes += 4 * len(trainable)  # torch.optim.Adam keeps a float32 scalar 'step' per tensor
    acts = estimate_activation_bytes(model, batch_shape, autocast_dtype=amp, device=device)
    out = {"params": p_bytes, "grads": g_bytes, "optimizer": o_bytes, "activations": acts}
    out["total"] = sum(out.values())
    return out
