"""FP8 formats and their scaling, by hand (chapter 06).

Two 8-bit floating-point formats (Micikevicius et al. 2022, "FP8 Formats for Deep Learning"): e4m3 (4 exponent
bits, 3 mantissa bits, largest finite value 448, no infinities) for weights and activations, and e5m2 (5 exponent
bits, 2 mantissa bits, largest 57,344) for gradients, whose range is wider and whose precision matters less.
Eight bits hold too little range for a tensor as it comes: the recipe multiplies it by a scale so that its
largest magnitude (its *amax*) lands near the format's largest value, casts, and keeps the scale to undo it.

- ``dynamic_scale``: the scale from this tensor's own amax (one extra reduction per tensor per step);
- ``DelayedScaler``: the scale from the amaxes of earlier steps (Transformer Engine's recipe), cheaper and stale;
- ``quantize_blocks``: a scale per block of a matrix (per row, or 1 x 128 / 128 x 128 tiles as DeepSeek-V3 does),
  so that one outlier spoils only its block.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Format:
    name: str
    dtype: torch.dtype
    max: float            # largest finite value
    min_normal: float     # smallest normal value; below it precision falls off (subnormals)
    min_subnormal: float  # smallest non-zero value; anything below half of it becomes 0
    mantissa_bits: int

    @property
    def bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()  # host: only its size is read


def _format(name: str, dtype: torch.dtype, mantissa_bits: int) -> Format:
    info = torch.finfo(dtype)
    return Format(name, dtype, float(info.max), float(info.tiny), float(info.tiny) * 2.0 ** -mantissa_bits,
                  mantissa_bits)


FORMATS: dict[str, Format] = {
    "e4m3": _format("e4m3", torch.float8_e4m3fn, 3),
    "e5m2": _format("e5m2", torch.float8_e5m2, 2),
    "bf16": _format("bf16", torch.bfloat16, 7),
    "fp16": _format("fp16", torch.float16, 10),
}


def get_format(name: str) -> Format:
    """The format called ``name``, or a ValueError that lists the known ones."""
    if name not in FORMATS:
        raise ValueError(f"unknown format {name!r}: choose one of {', '.join(FORMATS)}")
    return FORMATS[name]


def _check_finite(x: torch.Tensor) -> None:
    if not torch.isfinite(x).all():
        bad = int((~torch.isfinite(x)).sum())
        raise ValueError(f"the tensor holds {bad} inf or NaN value(s): an amax (and so a scale) cannot be taken "
                         "from it. Find where they come from (a diverged step, a division by zero) first; "
                         "a loss scaler skips such steps (chapter 05)")


def amax(x: torch.Tensor, check: bool = True) -> torch.Tensor:
    """The largest magnitude of ``x``, as a 0-d float32 tensor on x's device. ``check``: first raise a clear error
    on inf or NaN (reading that answer waits for the device: ``check=False`` in a GPU's hot loop)."""
    if check:
        _check_finite(x)
    return x.detach().abs().max().float()


def dynamic_scale(x: torch.Tensor, fmt: str, margin: float = 1.0, check: bool = True) -> torch.Tensor:
    """The scale that maps ``x``'s amax to ``fmt``'s largest value (divided by ``margin``): ``x * scale`` fits."""
    f = get_format(fmt)
    a = amax(x, check)
    # an all-zero tensor: any scale works; 1 keeps it finite
    return torch.where(a > 0, f.max / (a * margin), torch.ones_like(a))


def quantize(x: torch.Tensor, fmt: str, scale: torch.Tensor | float = 1.0, check: bool = True) -> torch.Tensor:
    """``x * scale`` cast to ``fmt``, clamped to its range (a cast alone turns e4m3 overflow into NaN). ``check``:
    first raise a clear error on a scale that is not finite and positive (a host sync, as in ``amax``)."""
    f = get_format(fmt)
    scale = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    if check and (not bool(torch.isfinite(scale).all()) or bool((scale <= 0).any())):
        raise ValueError(f"the scale must be finite and positive, got {scale.flatten()[:4].tolist()}: a scale of "
                         "zero would map every value to 0, and dequantizing divides by it")
    return (x.float() * scale).clamp(-f.max, f.max).to(f.dtype)


def dequantize(q: torch.Tensor, scale: torch.Tensor | float = 1.0) -> torch.Tensor:
    """Back to float32: ``q / scale``."""
    return q.float() / torch.as_tensor(scale, dtype=torch.float32, device=q.device)


def qdq(x: torch.Tensor, fmt: str, scale: torch.Tensor | float = 1.0) -> torch.Tensor:
    """Quantize and dequantize: ``x`` as the format holds it, in float32."""
    return dequantize(quantize(x, fmt, scale), scale)


def cast_stats(x: torch.Tensor, fmt: str, scale: torch.Tensor | float = 1.0) -> dict[str, float]:
    """How ``x`` fares in ``fmt`` at ``scale``: relative error (norm), and the shares of non-zero values that
    became zero (underflow) or were clamped at the format's largest value (overflow)."""
    f = get_format(fmt)
    scaled = x.float() * torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    back = qdq(x, fmt, scale)
    nonzero = x != 0
    n = max(int(nonzero.sum()), 1)
    return {"rel_error": float((back - x).norm() / x.float().norm().clamp_min(1e-30)),
            "underflow": int((nonzero & (back == 0)).sum()) / n,
            "overflow": int((scaled.abs() > f.max).sum()) / n}


class DelayedScaler:
    """Transformer Engine's delayed scaling: the scale for this step from the largest amax of the last
    ``history`` steps, and this step's amax recorded for the next ones. It saves nothing by itself on a CPU; on
    a GPU the amax is fused into the cast kernel instead of being a reduction that must finish before the cast.
    The cost is staleness: a tensor whose magnitude jumps overflows until the history catches up."""

    def __init__(self, fmt: str, history: int = 16, margin: float = 1.0):
        if history < 1:
            raise ValueError(f"history must be at least 1 step, got {history}")
        self.fmt, self.margin = get_format(fmt).name, margin
        self.amaxes: deque[float] = deque(maxlen=history)

    def scale(self) -> float:
        """The scale to use now: from the history's largest amax (1.0 before any step)."""
        if not self.amaxes or max(self.amaxes) == 0:
            return 1.0
        return get_format(self.fmt).max / (max(self.amaxes) * self.margin)

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, float]:
        """Cast ``x`` with the current (delayed) scale, then record its amax."""
        s = self.scale()
        q = quantize(x, self.fmt, s)
        self.amaxes.append(float(amax(x)))
        return q, s


def quantize_blocks(x: torch.Tensor, fmt: str, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A 2-D ``x`` cast with one dynamic scale per ``block`` (rows x columns) tile; returns the FP8 tensor and the
    scales, one per tile. ``(1, x.shape[1])`` is per-row scaling; DeepSeek-V3 uses (1, 128) for activations and
    (128, 128) for weights. The shape must divide into whole tiles."""
    if x.dim() != 2 or x.shape[0] % block[0] or x.shape[1] % block[1]:
        raise ValueError(f"a {tuple(x.shape)} tensor does not split into whole {block} tiles")
    f = get_format(fmt)
    _check_finite(x)
    r, c = x.shape[0] // block[0], x.shape[1] // block[1]
    tiles = x.float().reshape(r, block[0], c, block[1])
    a = tiles.abs().amax(dim=(1, 3), keepdim=True)
    scales = torch.where(a > 0, f.max / a, torch.ones_like(a))
    q = (tiles * scales).clamp(-f.max, f.max).to(f.dtype).reshape(x.shape)
    return q, scales.reshape(r, c)


def dequantize_blocks(q: torch.Tensor, scales: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The inverse of ``quantize_blocks``."""
    r, c = scales.shape
    tiles = q.float().reshape(r, block[0], c, block[1])
    return (tiles / scales.reshape(r, 1, c, 1)).reshape(q.shape)
