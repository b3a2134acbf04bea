"""The model chapter 08's workers cut into stages, its batch, and the sequential step the stages must equal.

Every rank builds the same ``TinyTransformer`` from the same seed and reads the
same batch, keeps its own stages, and also computes the whole model's step on
the whole batch: the reference it compares its own stages' gradients with
(the model is small, so every rank can afford it).
"""

from __future__ import annotations

import argparse
import copy
from dataclasses import dataclass

import torch
from torch import nn

from course_lib.data import make_tokens
from course_lib.parallel.pipeline.executor import split_sequential
from course_lib.env import seed_everything
from course_lib.models import TinyTransformer, lm_loss


def add_model_args(parser: argparse.ArgumentParser, microbatch_size: int = 2, seed: bool = True) -> None:
    """The model's sizes, the micro-batch and the ops' padding: the options every chapter-08 worker shares."""
    parser.add_argument("--microbatch-size", type=int, default=microbatch_size, help="sequences per micro-batch")
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--d-model", type=int, default=32)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=0, help="transformer blocks (0: 2p - 2)")
    parser.add_argument("--t-forward-ms", type=float, default=20.0, help="pad each forward to this (0: no padding)")
    parser.add_argument("--t-backward-ms", type=float, default=40.0, help="pad each backward to this")
    if seed:
        parser.add_argument("--seed", type=int, default=0)


def tiny_model(a: argparse.Namespace, stages: int, seed: int | None = None) -> TinyTransformer:
    """The chapter's ``TinyTransformer`` at ``add_model_args``'s sizes, seeded (``a.seed`` unless ``seed``), the
    same on every rank: ``--layers`` blocks, or two modules per stage (of ``stages``, virtual ones included)."""
    seed_everything(a.seed if seed is None else seed)
    return TinyTransformer(vocab=a.vocab, d_model=a.d_model, n_heads=a.heads,
                           n_layers=a.layers if a.layers > 0 else max(1, 2 * stages - 2), max_len=a.seq_len)


def tokens(a: argparse.Namespace, m: int, seed: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of ``m`` micro-batches (inputs, targets), the same on every rank for a seed (``a.seed`` unless given)."""
    return make_tokens(m * a.microbatch_size, a.seq_len, vocab=a.vocab, seed=a.seed if seed is None else seed)


def op_pads(a: argparse.Namespace, split: bool = False, scale: float = 1.0) -> dict[str, float] | None:
    """Seconds each op is padded to, ``scale`` times ``--t-forward-ms`` and ``--t-backward-ms`` (``None``: no
    padding, with ``--t-forward-ms 0``). A split backward (``split``, ZB-H1) is half input gradient (``B``), half
    weight gradient (``W``)."""
    if a.t_forward_ms <= 0:
        return None
    t_f, t_b = a.t_forward_ms / 1e3, a.t_backward_ms / 1e3
    return {op: scale * t for op, t in {"F": t_f, "B": t_b / (2 if split else 1), "W": t_b / 2}.items()}


def micro_batches(x: torch.Tensor, m: int) -> list[torch.Tensor]:
    """``x`` cut into ``m`` micro-batches, separate tensors as a data loader hands them out (not views of ``x``)."""
    return [c.clone() for c in x.chunk(m)]


def my_chunks(pieces: list, rank: int, world: int, v: int) -> list:
    """Rank ``d``'s share of ``p v`` virtual stages: ``d, d + p, ..., d + (v - 1) p``."""
    return [pieces[c * world + rank] for c in range(v)]


@dataclass
class Staged:
    """The model cut into stages, its batch, and the sequential reference step on the whole batch."""

    stages: list[nn.Sequential]      # the model's pieces (its own modules), one per stage, virtual ones included
    refs: list[nn.Sequential]        # the reference's pieces, holding the sequential step's gradients
    x: torch.Tensor
    y: torch.Tensor
    xs: list[torch.Tensor]           # the micro-batches, separate tensors as a data loader hands them out
    ys: list[torch.Tensor]
    logits: torch.Tensor             # the reference's output on the whole batch
    loss: float                      # and its mean loss


def staged(a: argparse.Namespace, num_stages: int, m: int, frozen: int = 0) -> Staged:
    """The same model and batch of ``m`` micro-batches on every rank, cut into ``num_stages`` stages, the first
    ``frozen`` of them frozen (in the reference too), and the reference's step: the whole batch's mean loss."""
    model = tiny_model(a, num_stages)
    stages = split_sequential(model.as_sequential(), num_stages)
    for stage in stages[:frozen]:                 # pipeline.freeze.freeze: no gradients, in the reference's copy too
        stage.requires_grad_(False)
    reference = copy.deepcopy(model)
    x, y = tokens(a, m)
    logits = reference(x)
    loss = lm_loss(logits, y)
    loss.backward()
    return Staged(stages, split_sequential(reference.as_sequential(), num_stages), x, y, micro_batches(x, m),
                  micro_batches(y, m), logits.detach(), loss.item())
