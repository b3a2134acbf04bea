"""Activation checkpointing: segment plans, a checkpointed sequential forward, selective checkpointing (chapter 05).

Storing against recomputing (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost",
https://arxiv.org/abs/1604.06174): cut a chain of ``n`` blocks into ``k`` segments and keep only each segment's
input during the forward pass. The backward pass reruns one segment at a time to get its activations back. What
is alive at once is about ``k`` segment inputs plus one segment's ``n / k`` blocks of activations, so the peak
goes as ``n/k + k``, lowest near ``k = sqrt(n)``; the price is one extra forward of every checkpointed block.

- ``segment_plan``, ``best_segments``, ``chen_peak_units``: the arithmetic;
- ``CheckpointedSequential`` (via ``checkpointed_sequential``): the segmented forward written with
  ``torch.utils.checkpoint.checkpoint``, the teaching twin of ``torch.utils.checkpoint.checkpoint_sequential``;
- ``Checkpointed`` and ``checkpoint_blocks``: wrap each block of a model, fully or selectively
  (``create_selective_checkpoint_contexts`` with a policy that saves chosen ops and recomputes the rest);
- ``count_forward_calls`` and ``chain``: what the chapter measures with (its times: ``timing.fastest_times``);
- ``predict_longest`` and ``longest_fitting``: the search for the longest sequence that fits a memory budget,
  predicted from three short steps, then checked.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from contextlib import contextmanager
from typing import Callable, Collection, Iterable, Iterator, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from course_lib.timing import fastest_times  # noqa: F401 (the planner and older notebooks import it from here)

aten = torch.ops.aten

# What nn.Linear becomes at the kernel level: addmm (with bias) or mm. A selective policy keeps these outputs:
# they are the expensive ops (most of a transformer block's FLOPs) and their outputs grow only linearly with the
# sequence length.
LINEAR_OPS: frozenset = frozenset({aten.mm.default, aten.addmm.default})
# The attention core's batched matmuls (q @ k^T, att @ v). Their outputs and the softmax between them are
# (batch, heads, T, T): quadratic in T. Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
# Transformer Models", https://arxiv.org/abs/2205.05198) recompute exactly this part and keep the rest.
ATTENTION_OPS: frozenset = frozenset({aten.bmm.default, aten.baddbmm.default})

# ----- the arithmetic --------------------------------------------------------------


def segment_plan(n: int, segments: int) -> list[range]:
    """Split blocks ``0 .. n-1`` into ``segments`` consecutive ranges whose sizes differ by at most one.

    The larger segments come first: during the backward pass the inputs of the earlier segments are still held while
    a segment is recomputed, so the early segments can afford to be the longer ones. (PyTorch's
    ``checkpoint_sequential`` instead gives every segment ``n // segments`` blocks and the remainder to the last
    one.)
    """
    if n < 1:
        raise ValueError(f"need at least one block to checkpoint, got n={n}")
    if not 1 <= segments <= n:
        raise ValueError(f"segments must be between 1 and the number of blocks ({n}), got {segments}")
    size, extra = divmod(n, segments)
    plan, start = [], 0
    for i in range(segments):
        stop = start + size + (1 if i < extra else 0)
        plan.append(range(start, stop))
        start = stop
    return plan


def chen_peak_units(n: int, k: int) -> float:
    """Chen et al.'s cost model: ``n/k + k`` block-outputs alive at the peak (``k`` inputs, one segment)."""
    if not 1 <= k <= n:
        raise ValueError(f"k must be between 1 and n={n}, got {k}")
    return n / k + k


def best_segments(n: int) -> int:
    """The number of segments that minimises ``n/k + k`` (an integer next to ``sqrt(n)``; ties go to fewer)."""
    if n < 1:
        raise ValueError(f"need at least one block, got n={n}")
    return min(range(1, n + 1), key=lambda k: (chen_peak_units(n, k), k))


def recomputed_blocks(n: int, segments: int) -> int:
    """Blocks run a second time in one backward pass of ``checkpointed_sequential(n blocks, segments)``.

    Every segment but the last is checkpointed (the last one's activations are needed first in the backward pass, so
    recomputing them would buy nothing).
    """
    return n - len(segment_plan(n, segments)[-1])


# ----- a checkpointed sequential forward, by hand -------------------------------------


class CheckpointedSequential(nn.Module):
    """Run ``blocks`` in segments; all but the last under ``checkpoint(..., use_reentrant=False)``.

    The blocks are the same module objects (same parameters), only the forward changes.
    """

    def __init__(self, blocks: nn.Sequential, segments: int):
        super().__init__()
        self.plan = segment_plan(len(blocks), segments)  # raises on segments outside 1..n
        self.blocks = blocks

    def _run(self, span: range) -> Callable[[torch.Tensor], torch.Tensor]:
        def run(x: torch.Tensor) -> torch.Tensor:
            for i in span:
                x = self.blocks[i](x)
            return x
        return run

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():  # nothing is saved without grad: checkpointing would only cost time
            return self.blocks(x)
        *checkpointed, last = self.plan
        for span in checkpointed:
            # Keeps only ``x`` (the segment's input); the activations inside are dropped and rebuilt in the
            # backward pass. use_reentrant=False: the implementation PyTorch recommends (works with
            # torch.autograd.grad, inputs that do not require grad, keyword arguments). The RNG state is stashed
            # and restored, so dropout draws the same mask twice.
            x = checkpoint(self._run(span), x, use_reentrant=False)
        return self._run(last)(x)


def checkpointed_sequential(blocks: nn.Sequential, segments: int) -> nn.Module:
    """``blocks`` as one module whose forward checkpoints ``segments - 1`` of ``segments`` balanced segments.

    ``segments=1`` is the plain forward; ``segments=len(blocks)`` checkpoints every block but the last.
    """
    if not isinstance(blocks, nn.Sequential):
        raise ValueError(f"expected an nn.Sequential of blocks, got {type(blocks).__name__}")
    return CheckpointedSequential(blocks, segments)


# ----- checkpointing each block: full or selective ------------------------------------

Policy = Callable[..., CheckpointPolicy]


def save_ops_policy(save_ops: Collection = LINEAR_OPS) -> Policy:
    """A selective-checkpoint policy: keep the outputs of ``save_ops``, recompute every other op.

    Saving a matmul's output spares its recomputation (the expensive part); pointwise ops (GELU, softmax, masking,
    scaling) cost few FLOPs to redo, though each still reads and writes its whole tensor.
    """
    ops = frozenset(save_ops)

    def policy(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in ops else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


class Checkpointed(nn.Module):
    """One module run under ``checkpoint``: fully (keep only its input) or selectively (``policy``)."""

    def __init__(self, module: nn.Module, policy: Policy | None = None):
        super().__init__()
        self.module = module
        self.policy = policy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return self.module(x)
        if self.policy is None:
            return checkpoint(self.module, x, use_reentrant=False)
        return checkpoint(self.module, x, use_reentrant=False,
                          context_fn=functools.partial(create_selective_checkpoint_contexts, self.policy),
                          # route the tensors the policy keeps through saved-tensor hooks around the
                          # call (what memory.saved_activation_bytes listens to); the future default
                          respect_saved_tensors_hooks=True)


CHECKPOINT_MODES = ("none", "full", "selective")


def checkpoint_blocks(blocks: nn.Sequential, mode: str, save_ops: Collection = LINEAR_OPS) -> nn.Sequential:
    """A new ``nn.Sequential`` of the same blocks, each checkpointed as ``mode`` says.

    ``"none"``: the blocks as they are; ``"full"``: each block keeps only its input; ``"selective"``: each block
    also keeps the outputs of ``save_ops``. Apply it as ``model.blocks = checkpoint_blocks(model.blocks, "full")``.
    """
    if mode not in CHECKPOINT_MODES:
        raise ValueError(f"unknown checkpoint mode {mode!r}: choose one of {', '.join(CHECKPOINT_MODES)}")
    if mode == "none":
        return nn.Sequential(*blocks)
    policy = save_ops_policy(save_ops) if mode == "selective" else None
    return nn.Sequential(*[Checkpointed(b, policy) for b in blocks])


# ----- what the chapter measures with --------------------------------------------------


@contextmanager
def count_forward_calls(modules: Iterable[nn.Module]) -> Iterator[Counter]:
    """Count the forward calls of each module inside the ``with`` block: ``counter[i]`` for the i-th module.

    A forward *pre*-hook counts a call when it starts: recomputation may stop early, as soon as the last tensor the
    backward needs is rebuilt, before the block returns (non-reentrant checkpoint's ``early_stop``).
    """
    counter: Counter = Counter()
    handles = []
    for i, m in enumerate(modules):
        handles.append(m.register_forward_pre_hook(lambda mod, args, i=i: counter.update([i])))
    try:
        yield counter
    finally:
        for h in handles:
            h.remove()


def chain(n: int, width: int) -> nn.Sequential:
    """The chapter's chain: ``n`` blocks of Linear then ReLU, each ``width`` wide.

    Each block keeps exactly one activation for backward, its ReLU output (which is also the next Linear's input),
    so one block's activation and one segment input are the same size: the unit in which ``n/k + k`` counts.
    """
    if n < 1 or width < 1:
        raise ValueError(f"a chain needs n >= 1 blocks and width >= 1, got n={n}, width={width}")
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(n)])


# ----- the longest sequence that fits -------------------------------------------------


def fit_parabola(lengths: Sequence[float], peaks: Sequence[float]) -> tuple[float, float, float]:
    """``(a, b, c)`` of the parabola ``a + b T + c T^2`` through three measured ``(length, peak)`` points."""
    if len(lengths) != 3 or len(peaks) != 3 or len(set(lengths)) != 3:
        raise ValueError(f"need peaks at three different lengths, got lengths {list(lengths)} and {len(peaks)} peaks")
    (t1, t2, t3), (p1, p2, p3) = lengths, peaks
    # Newton's divided differences: the exact interpolating parabola, no least squares
    d12, d23 = (p2 - p1) / (t2 - t1), (p3 - p2) / (t3 - t2)
    c = (d23 - d12) / (t3 - t1)
    b = d12 - c * (t1 + t2)
    return p1 - b * t1 - c * t1 * t1, b, c


def predict_longest(lengths: Sequence[int], peaks: Sequence[float], budget: float, step: int = 1) -> int:
    """The longest multiple of ``step`` at which the parabola through three measured ``(length, peak)`` points
    stays within ``budget`` (0 if none does).

    A transformer step's memory is ``a + b T + c T^2`` in the sequence length T: the weights and their
    gradients do not grow with T, most activations grow like T, the attention matrices like T^2. Three
    peaks fix the three coefficients, as long as the peak falls at the same moment of the step at all
    three lengths and beyond; when it does not, the prediction is off, so it is where
    ``longest_fitting`` starts its search, not the answer.
    """
    if step < 1:
        raise ValueError(f"step must be at least 1 token, got {step}")
    a, b, c = fit_parabola(lengths, peaks)
    if c > 0:
        disc = b * b - 4 * c * (a - budget)
        if disc < 0:
            return 0
        longest = (-b + math.sqrt(disc)) / (2 * c)
    elif b > 0:  # no quadratic part: a line
        longest = (budget - a) / b
    else:
        raise ValueError(f"the peaks {list(peaks)} do not grow with the length: measure at longer lengths")
    return max(0, int(longest // step) * step)


def longest_fitting(fits: Callable[[int], bool], guess: int, step: int, limit: int) -> tuple[int, list[int]]:
    """The largest multiple of ``step`` up to ``limit`` for which ``fits`` holds, searched from ``guess``.

    ``fits`` must turn false once and stay false (memory grows with the length). From the guess it
    steps outwards by 1, 2, 4, ... steps until the answer is bracketed, then bisects: a right guess
    costs two calls (the guess fits, one step more does not), each one a real training step.
    Returns ``(length, the lengths tried in order)``; the length is 0 if not even ``step`` fits.
    """
    if step < 1 or limit < step:
        raise ValueError(f"need 1 <= step <= limit, got step={step}, limit={limit}")
    top = limit // step  # work in units of step: 1 .. top
    tried: list[int] = []
    known: dict[int, bool] = {}

    def ok(u: int) -> bool:
        if u not in known:
            known[u] = fits(u * step)
            tried.append(u * step)
        return known[u]

    g = min(max(1, guess // step), top)
    if ok(g):  # step up by 1, 2, 4, ... until a length does not fit (or the limit is passed)
        lo, d = g, 1
        while lo + d <= top and ok(lo + d):
            lo, d = lo + d, 2 * d
        hi = min(lo + d, top + 1)  # top + 1 stands for "past the limit"
    else:  # step down likewise until one fits
        hi, d = g, 1
        while hi - d >= 1 and not ok(hi - d):
            hi, d = hi - d, 2 * d
        lo = max(hi - d, 0)  # 0 stands for "nothing fits"
    while hi - lo > 1:  # invariant: lo fits (or is 0), hi does not (or is past the limit)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo * step, tried
