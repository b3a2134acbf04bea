"""The run chapters 09-12 compare their methods on: its sizes, the model, the batches, and the single-process reference.

Every rank builds the same model from the same seed and reads the same global
batch for a given step (a function of the step number, so a resumed run reads
exactly what an uninterrupted one would), then keeps its own rows of it. The
reference trains that model on the whole batch in one process: what every
distributed method (``dp_methods``, tensor and context parallelism) must equal.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import torch

from course_lib.data import make_tokens
from course_lib.env import seed_everything
from course_lib.models import TinyTransformer, lm_loss


@dataclass
class RunConfig:
    """Sizes of one chapter-09 run; the global batch is split evenly over the ranks."""

    vocab: int = 64
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    seq_len: int = 32
    batch: int = 8          # global batch: the same whatever the world size
    steps: int = 6
    lr: float = 3e-3
    seed: int = 0
    dtype: str = "float32"  # "float64" makes rounding negligible, for exact-equality checks
    accumulation: int = 1   # micro-batches per step on each rank (its rows of the batch, split evenly)
    bucket_mb: float = 0.25  # ZeroOptimizer's bucket cap, MiB: small against these models' gradients

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "float64"):
            raise ValueError(f"dtype must be 'float32' or 'float64', got {self.dtype!r}")
        if self.accumulation < 1 or self.bucket_mb <= 0:
            raise ValueError(f"need accumulation >= 1 and bucket_mb > 0, got {self.accumulation}, {self.bucket_mb}")

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "RunConfig":
        return cls(**json.loads(text))


def build_model(cfg: RunConfig, device: torch.device | str = "cpu") -> TinyTransformer:
    """The tiny transformer, seeded: every rank (and the single-process reference) gets the same weights."""
    seed_everything(cfg.seed)
    return TinyTransformer(vocab=cfg.vocab, d_model=cfg.d_model, n_heads=cfg.n_heads, n_layers=cfg.n_layers,
                           max_len=cfg.seq_len).to(device=device, dtype=getattr(torch, cfg.dtype))


def global_batch(cfg: RunConfig, step: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch of ``step`` (inputs, targets), identical on every rank and in every run."""
    x, y = make_tokens(cfg.batch, cfg.seq_len, vocab=cfg.vocab, seed=cfg.seed * 100_003 + step)
    return x.to(device), y.to(device)


def local_batch(cfg: RunConfig, step: int, rank: int, world: int,
                device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of the global batch of ``step``."""
    if cfg.batch % (world * cfg.accumulation):
        raise ValueError(f"global batch {cfg.batch} does not split evenly over {world} ranks x "
                         f"{cfg.accumulation} micro-batches; choose a multiple of {world * cfg.accumulation}")
    b = cfg.batch // world
    x, y = global_batch(cfg, step, device)
    return x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b]


def reference(cfg: RunConfig) -> tuple[list[float], list[torch.Tensor]]:
    """Single-process Adam on the whole batch: losses and final parameters (what every method must equal)."""
    model = build_model(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    losses = []
    for step in range(cfg.steps):
        x, y = global_batch(cfg, step)
        opt.zero_grad()
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]
