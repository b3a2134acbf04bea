"""Small models (every chapter, 00 to 13).

- ``ResNet``: a CIFAR-style residual network whose normalisation layer is an argument
  (``norm_layer(channels) -> nn.Module``), so chapter 04 can swap BatchNorm for GroupNorm or MABN.
- ``NFResNet``: the same layout with no normalisation layer (a normaliser-free ResNet, Brock et al.
  2021a): scaled weight standardisation and residual branches scaled by alpha and 1/beta (chapter 04).
- ``MLP``: the simplest model with no normalisation, for exact-gradient checks.
- ``TinyTransformer``: a decoder-only language model whose blocks form an
  ``nn.Sequential`` (checkpointing, pipeline stages and sharding cut it there).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

NormLayer = Callable[[int], nn.Module]


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a residual connection (He et al. 2016)."""

    def __init__(self, cin: int, cout: int, stride: int, norm_layer: NormLayer):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.norm1 = norm_layer(cout)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.norm2 = norm_layer(cout)
        self.relu2 = nn.ReLU()
        self.shortcut: nn.Module = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), norm_layer(cout))
                                    if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu1(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return self.relu2(out + self.shortcut(x))


class ResNet(nn.Module):
    """A CIFAR ResNet: a 3x3 stem, three stages (width, 2x, 4x; stride 1, 2, 2), pooling, a linear head.

    With ``blocks=(1, 1, 1)`` it has 7 convolutions and one linear layer in the main path.
    """

    def __init__(self, width: int = 16, blocks: tuple[int, int, int] = (1, 1, 1), num_classes: int = 10,
                 norm_layer: NormLayer = nn.BatchNorm2d, in_channels: int = 3):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, width, 3, 1, 1, bias=False), norm_layer(width), nn.ReLU())
        layers: list[nn.Module] = []
        cin = width
        for stage, count in enumerate(blocks):
            cout = width * 2**stage
            for i in range(count):
                layers.append(BasicBlock(cin, cout, 2 if (stage > 0 and i == 0) else 1, norm_layer))
                cin = cout
        self.layers = nn.Sequential(*layers)
        self.pool, self.flatten, self.fc = nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes)
        self.in_channels = in_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4 or x.shape[1] != self.in_channels:
            raise ValueError(f"ResNet expects images of shape (batch, {self.in_channels}, H, W); got {tuple(x.shape)}")
        return self.fc(self.flatten(self.pool(self.layers(self.stem(x)))))


# ----- a normaliser-free ResNet (chapter 04) ----------------------------------------------

# relu(z) of z ~ N(0, 1) has variance (1 - 1/pi) / 2: this gain brings it back to 1 (Brock et al. 2021a).
RELU_GAIN = math.sqrt(2 / (1 - 1 / math.pi))


class ScaledStdConv2d(nn.Conv2d):
    """``nn.Conv2d`` with scaled weight standardisation (Brock et al. 2021a, "Characterizing signal propagation
    to close the performance gap in unnormalized ResNets"): each filter is used as
    ``gain * (W - mean(W)) / (std(W) * sqrt(fan_in))``, over its fan-in, with a learned per-filter ``gain``
    (initially 1). A zero-mean filter of squared norm 1 maps inputs of unit variance to outputs of unit
    variance, at every step of training, not only at initialisation. Costs a mean and a variance over the
    weights each forward: nothing per activation.
    """

    def __init__(self, *args: object, eps: float = 1e-4, **kwargs: object):
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.gain = nn.Parameter(torch.ones(self.out_channels))
        self.eps = eps  # floor on var * fan_in, as in the authors' code: a filter of equal weights stays finite

    def standardized_weight(self) -> torch.Tensor:
        fan_in = self.weight[0].numel()
        mean = self.weight.mean(dim=(1, 2, 3), keepdim=True)
        var = self.weight.var(dim=(1, 2, 3), unbiased=False, keepdim=True)
        scale = torch.rsqrt(torch.clamp(var * fan_in, min=self.eps)) * self.gain.view(-1, 1, 1, 1)
        return (self.weight - mean) * scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._conv_forward(x, self.standardized_weight(), self.bias)


class NFBlock(nn.Module):
    """A pre-activation residual block without normalisation: ``x + alpha * f(x / beta)``.

    ``beta`` is the expected standard deviation of ``x`` (tracked by ``NFResNet``), so the branch ``f``
    (scaled ReLU, 3x3 conv, scaled ReLU, 3x3 conv) sees unit variance and returns about unit variance;
    ``alpha`` (0.2 in the paper) is how much variance each block adds. Where the shape changes, the
    shortcut is a 1x1 conv of the same unit-variance input, which resets the variance to 1 + alpha^2.
    """

    def __init__(self, cin: int, cout: int, stride: int, alpha: float, beta: float):
        super().__init__()
        self.alpha, self.beta = alpha, beta
        self.conv1 = ScaledStdConv2d(cin, cout, 3, stride, 1)
        self.conv2 = ScaledStdConv2d(cout, cout, 3, 1, 1)
        self.shortcut = ScaledStdConv2d(cin, cout, 1, stride) if stride != 1 or cin != cout else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(x) * (RELU_GAIN / self.beta)  # ReLU is positively homogeneous: relu(x / beta) * gain
        shortcut = x if self.shortcut is None else self.shortcut(out)
        out = self.conv2(F.relu(self.conv1(out)) * RELU_GAIN)
        return shortcut + self.alpha * out

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}, beta={self.beta:.4f}"


class NFResNet(nn.Module):
    """``ResNet``'s layout (stem, three stages, pooling, ``fc``) with no normalisation layer: a normaliser-free
    ResNet (NF-ResNet, Brock et al. 2021a) with ``ScaledStdConv2d`` convolutions and ``NFBlock`` blocks.

    The expected variance of the residual stream starts at 1 after the stem and grows by ``alpha^2`` a block
    (each branch adds about ``alpha^2``), reset to 1 + ``alpha^2`` after a block with a projection shortcut;
    each block divides its input by the square root of what it expects (``beta``). ``expected_var`` lists the
    values; the tests measure them at initialisation. No batch statistics: a sample's output does not depend
    on its batch-mates, as with GroupNorm. Train it with ``agc.adaptive_clip_`` at high learning rates.
    """

    def __init__(self, width: int = 16, blocks: tuple[int, int, int] = (1, 1, 1), num_classes: int = 10,
                 alpha: float = 0.2, in_channels: int = 3):
        super().__init__()
        self.stem = ScaledStdConv2d(in_channels, width, 3, 1, 1)
        layers: list[nn.Module] = []
        self.expected_var: list[float] = []  # of each block's input, then of the last block's output
        cin, var = width, 1.0
        for stage, count in enumerate(blocks):
            cout = width * 2**stage
            for i in range(count):
                block = NFBlock(cin, cout, 2 if (stage > 0 and i == 0) else 1, alpha, math.sqrt(var))
                layers.append(block)
                self.expected_var.append(var)
                var = (1.0 if block.shortcut is not None else var) + alpha**2
                cin = cout
        self.expected_var.append(var)
        self.layers = nn.Sequential(*layers)
        self.pool, self.flatten, self.fc = nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes)
        self.in_channels = in_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4 or x.shape[1] != self.in_channels:
            raise ValueError(f"NFResNet expects images of shape (batch, {self.in_channels}, H, W); got {tuple(x.shape)}")
        # the last block's output is a residual stream, not yet activated: the scaled ReLU first, as a block does
        return self.fc(self.flatten(self.pool(F.relu(self.layers(self.stem(x))) * RELU_GAIN)))


class MLP(nn.Module):
    """Flatten, then Linear-ReLU layers, then a linear head. No normalisation, no randomness."""

    def __init__(self, in_features: int = 3 * 32 * 32, hidden: tuple[int, ...] = (256, 256), num_classes: int = 10):
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        prev = in_features
        for h in hidden:
            layers += [nn.Linear(prev, h), nn.ReLU()]
            prev = h
        layers.append(nn.Linear(prev, num_classes))
        self.net = nn.Sequential(*layers)
        self.in_features = in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x[0].numel() != self.in_features:
            raise ValueError(f"MLP expects {self.in_features} features per sample; got shape {tuple(x.shape)} "
                             f"({x[0].numel()} per sample)")
        return self.net(x)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention, written out op by op so every saved tensor is visible.

    ``fused=True`` computes the same function with one call of ``F.scaled_dot_product_attention`` (chapter
    11): a fused kernel that never stores the ``(B, H, T, T)`` attention matrix; the backward pass recomputes
    it block by block from ``q``, ``k``, ``v`` and one log-sum-exp per row.
    """

    def __init__(self, d_model: int, n_heads: int, max_len: int, dropout: float = 0.0, fused: bool = False):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
        self.n_heads, self.fused, self.dropout = n_heads, fused, dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)  # head-major: see forward
        self.proj = nn.Linear(d_model, d_model)
        # p = 0 would still save a mask in training; leave the op out instead.
        self.attn_drop: nn.Module = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        # kept with fused=True too (its kernel masks inside, is_causal=True): code that cuts the layer up reads it
        self.register_buffer("mask", torch.ones(max_len, max_len).tril().bool(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hd = x.shape[-1] // self.n_heads
        # qkv's 3C outputs are stored head by head, [q_0 k_0 v_0 | q_1 k_1 v_1 | ...] (Megatron-LM's layout):
        # any contiguous block of them is whole heads, so tensor parallelism splits it with no reordering.
        # The heads (-1) and T are read from qkv's output, so the same forward runs one rank's heads (chapter 10).
        # (B, T, 3C) -> three (B, H, T, hd); contiguous so matmul saves these, not hidden copies
        qkv = self.qkv(x)
        B, T = qkv.shape[:2]
        qkv = qkv.view(B, T, -1, 3, hd)
        q, k, v = (qkv[..., i, :].transpose(1, 2).contiguous() for i in range(3))
        if self.fused:
            # saves q, k, v, the output and a (B, H, T) log-sum-exp: linear in T
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                               dropout_p=self.dropout if self.training else 0.0)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))      # (B, H, T, T): the O(T^2) memory
            att = att.masked_fill(~self.mask[:T, :T], float("-inf")).softmax(dim=-1)
            y = self.attn_drop(att) @ v                                  # (B, H, T, hd)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d_model: int, n_heads: int, max_len: int, dropout: float = 0.0, fused: bool = False):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, max_len, dropout, fused)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Embedding(nn.Module):
    """Token plus learned position embeddings: (B, T) integers -> (B, T, d_model)."""

    def __init__(self, vocab: int, d_model: int, max_len: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d_model), nn.Embedding(max_len, d_model)
        self.max_len = max_len

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if idx.dim() != 2 or idx.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"expected integer token ids of shape (batch, seq_len); got {tuple(idx.shape)} {idx.dtype}")
        if idx.shape[1] > self.max_len:
            raise ValueError(f"sequence length {idx.shape[1]} exceeds max_len={self.max_len}")
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))


class Head(nn.Module):
    """Final LayerNorm and the linear map to vocabulary logits."""

    def __init__(self, d_model: int, vocab: int):
        super().__init__()
        self.ln, self.out = nn.LayerNorm(d_model), nn.Linear(d_model, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


class TinyTransformer(nn.Module):
    """A decoder-only language model: ``embed``, ``blocks`` (an ``nn.Sequential``), ``head``.

    ``as_sequential()`` returns the same modules as one flat ``nn.Sequential``, the form checkpointing and
    pipeline parallelism cut into pieces. ``fused=True`` gives every block's attention the fused kernel (chapter 11).
    """

    def __init__(self, vocab: int = 64, d_model: int = 64, n_heads: int = 4, n_layers: int = 2,
                 max_len: int = 64, dropout: float = 0.0, fused: bool = False):
        super().__init__()
        self.embed = Embedding(vocab, d_model, max_len)
        self.blocks = nn.Sequential(*[TransformerBlock(d_model, n_heads, max_len, dropout, fused)
                                      for _ in range(n_layers)])
        self.head = Head(d_model, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(idx)))

    def as_sequential(self) -> nn.Sequential:
        return nn.Sequential(self.embed, *self.blocks, self.head)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position: logits (B, T, V), targets (B, T)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def count_params(model: nn.Module, trainable_only: bool = False) -> int:
    """Number of parameters (each shared parameter counted once)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
