"""A linear layer whose three matmuls run in FP8, by hand (chapter 06).

Forward ``y = x W^T``: x and W cast to e4m3 with per-tensor dynamic scales, multiplied by
``torch._scaled_mm`` (FP8 inputs, float32 accumulation and output, the scales undone inside). Backward: the
incoming gradient cast to e5m2 (wider range, less precision: gradients span more decades than they need
digits), then ``dX = dY W`` and ``dW = dY^T x`` in FP8 as well, from the e4m3 copies the forward saved (so the
saved activation costs 1 byte an element, not 4). The master weight, its gradient and Adam's state stay float32.
On a CPU this is slower than float32 (no FP8 units: the kernel converts; on some CPUs thousands of times slower,
on some it raises); there ``scaled_mm`` runs ``scaled_mm_emulated``, the same numbers from an fp32 matmul, unless
``kernels.probe("fp8")`` found the kernel native. On an H100/H200 the FP8 tensor cores run about twice the bf16 rate.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from course_lib import fp8, kernels


def scaled_mm(a_q: torch.Tensor, a_scale: torch.Tensor, b_q: torch.Tensor, b_scale: torch.Tensor) -> torch.Tensor:
    """``dequant(a) @ dequant(b)`` for FP8 ``a`` (M x K) and ``b`` (K x N), float32 out: torch's kernel where this
    machine runs it natively (``kernels.native("fp8")``), else ``scaled_mm_emulated``."""
    if kernels.native("fp8", a_q.device):
        return scaled_mm_kernel(a_q, a_scale, b_q, b_scale)
    return scaled_mm_emulated(a_q, a_scale, b_q, b_scale)


def scaled_mm_kernel(a_q: torch.Tensor, a_scale: torch.Tensor, b_q: torch.Tensor, b_scale: torch.Tensor
                     ) -> torch.Tensor:
    """The product through ``torch._scaled_mm``: FP8 inputs, float32 accumulation and output, scales undone inside.
    It wants the second operand column-major and the scales as the inverse (dequantizing) factors."""
    return torch._scaled_mm(a_q.contiguous(), b_q.t().contiguous().t(), scale_a=(1.0 / a_scale).reshape(()),
                            scale_b=(1.0 / b_scale).reshape(()), out_dtype=torch.float32)


def scaled_mm_emulated(a_q: torch.Tensor, a_scale: torch.Tensor, b_q: torch.Tensor, b_scale: torch.Tensor
                       ) -> torch.Tensor:
    """What ``_scaled_mm`` computes, in float32: each FP8 value (exact in float32) times its dequantizing scale
    ``1 / scale``, as the kernel is handed it, then an fp32 matmul. Equal to the kernel to float32 rounding; a
    little over fp32's time on any CPU (the two conversions)."""
    return _dequantized_product(a_q, (1.0 / a_scale).reshape(()), b_q, (1.0 / b_scale).reshape(()))


def _dequantized_product(a: torch.Tensor, inv_a: torch.Tensor, b: torch.Tensor, inv_b: torch.Tensor) -> torch.Tensor:
    # one arithmetic for both twins (ours and torchao's calls), so that the two FP8 layers built on them round alike
    return (a.float() * inv_a) @ (b.float() * inv_b)


def cast_dynamic(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` in ``fmt`` with its per-tensor dynamic scale, and the scale (what each matmul input goes through).

    On a CPU the casts check for inf/NaN and a bad scale and say so clearly. On a GPU they do not: each check makes
    the host wait for the device, five times per layer and step; a NaN there shows in the loss instead (chapter
    05's loss scaler skips such steps)."""
    check = x.device.type == "cpu"
    s = fp8.dynamic_scale(x, fmt, check=check)
    return fp8.quantize(x, fmt, s, check=check), s


class _FP8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # x: (M, K), weight: (N, K)
        xq, xs = cast_dynamic(x, "e4m3")
        wq, ws = cast_dynamic(weight, "e4m3")
        ctx.save_for_backward(xq, xs, wq, ws)  # FP8 copies: 1 byte an element
        return scaled_mm(xq, xs, wq.t(), ws)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        xq, xs, wq, ws = ctx.saved_tensors
        gq, gs = cast_dynamic(grad_out, "e5m2")
        grad_x = scaled_mm(gq, gs, wq, ws)            # (M, N) @ (N, K)
        grad_w = scaled_mm(gq.t(), gs, xq, xs)        # (N, M) @ (M, K)
        return grad_x, grad_w


def fp8_matmul_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The same forward from quantize-dequantize in float32: what ``_FP8Matmul`` must equal to rounding."""
    return fp8.qdq(x, "e4m3", fp8.dynamic_scale(x, "e4m3")) @ fp8.qdq(weight, "e4m3",
                                                                        fp8.dynamic_scale(weight, "e4m3")).t()


class FP8Linear(nn.Linear):
    """``nn.Linear`` whose matmuls run in FP8 (float32 master weight; the bias added in float32)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = _FP8Matmul.apply(x.reshape(-1, x.shape[-1]).float(), self.weight)
        y = y.reshape(*lead, self.out_features)
        return y + self.bias if self.bias is not None else y


class ScaledMMEmulation(TorchDispatchMode):
    """Inside the block every ``torch._scaled_mm`` on a CPU computes ``scaled_mm_emulated``'s arithmetic instead,
    whoever calls it: torchao's ``Float8Linear`` calls the kernel from inside its tensor subclass, so the subclass
    is let through (``NotImplemented``) and its own call to the kernel is caught. (torchao's ``emulate`` option is
    no twin: it changes torchao's numbers by about 1e-3 of the logits, against 3e-7 from the kernel.) The same
    arithmetic as ``scaled_mm_emulated``: the two layers then differ only where their scales do."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(t is not torch.Tensor for t in types):
            return NotImplemented  # a tensor subclass (torchao's): let it run, and catch the kernel it calls
        if func is not torch.ops.aten._scaled_mm.default or args[0].device.type != "cpu":
            return func(*args, **kwargs)
        a, b, inv_a, inv_b = args[:4]  # _scaled_mm takes the dequantizing (inverse) scales
        extra = dict(zip(("bias", "scale_result", "out_dtype", "use_fast_accum"), args[4:]), **kwargs)
        out = _dequantized_product(a, inv_a, b, inv_b)
        out = out + extra["bias"] if extra.get("bias") is not None else out
        return out.to(extra.get("out_dtype") or a.dtype)


def scaled_mm_as_measured(kernel: str = "torchao", device: torch.device | str = "cpu"):
    """A context in which ``torch._scaled_mm`` runs as this machine allows: the kernel itself where
    ``kernels.probe(kernel)`` found it native, else ``ScaledMMEmulation``."""
    return nullcontext() if kernels.native(kernel, device) else ScaledMMEmulation()


def torchao_float8(model: nn.Module, **kwargs) -> nn.Module:
    """torchao's ``convert_to_float8_training`` (its default recipe; ``kwargs`` go to it). Run the converted model
    inside ``scaled_mm_as_measured("torchao")`` on a CPU."""
    import logging

    # torchao registers one of its enums with torch the way torch 2.14 deprecates, and torch logs a warning at the
    # import: about torchao's code, nothing to do here
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
    from torchao.float8 import convert_to_float8_training

    return convert_to_float8_training(model, **kwargs)


def check_features(layer: nn.Linear, name: str) -> None:
    """Raise a clear error unless ``layer``'s features are multiples of 16, which ``_scaled_mm`` needs."""
    if layer.in_features % 16 or layer.out_features % 16:
        raise ValueError(f"{name}: {layer.in_features} -> {layer.out_features} features; FP8 matmuls need multiples "
                         "of 16 (pad the layer, or skip it)")


def to_fp8_linears(model: nn.Module, skip: tuple[str, ...] = ()) -> nn.Module:
    """Replace every ``nn.Linear`` of ``model`` (but those whose name ends with one in ``skip``) by an
    ``FP8Linear`` with the same weights, in place. ``_scaled_mm`` needs both dimensions multiples of 16."""
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear) and not isinstance(child, FP8Linear) and not name.endswith(skip):
            check_features(child, name)
            new = FP8Linear(child.in_features, child.out_features, bias=child.bias is not None)
            new.load_state_dict(child.state_dict())
            setattr(model, name, new)
        else:
            to_fp8_linears(child, skip)
    return model
