"""What the chapter-08 workers share: the run's configuration, the model, the data, FSDP2 sharding.

Every rank builds the same model from the same seed and reads the same global
batch for a given step (a function of the step number, so a resumed run reads
exactly what an uninterrupted one would), then keeps its own rows of it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch import nn

from course_lib.data import make_tokens
from course_lib.env import seed_everything
from course_lib.models import TinyTransformer


@dataclass
class RunConfig:
    """Sizes of one chapter-08 run; the global batch is split evenly over the ranks."""

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

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "float64"):
            raise ValueError(f"dtype must be 'float32' or 'float64', got {self.dtype!r}")

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
    if cfg.batch % world:
        raise ValueError(f"global batch {cfg.batch} does not split evenly over {world} ranks; "
                         f"choose a multiple of {world}")
    b = cfg.batch // world
    x, y = global_batch(cfg, step, device)
    return x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b]


def mean_over_ranks(value: float, device: torch.device | str = "cpu") -> float:
    """The mean of a scalar over all ranks (uncounted: a report, not training traffic).

    ``device``: where the backend can reduce (NCCL only reduces CUDA tensors).
    """
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def shard_fsdp2(model: TinyTransformer, reshard_after_forward: bool = True,
                mp_policy: object | None = None) -> TinyTransformer:
    """ZeRO-3 with FSDP2: one ``fully_shard`` per block, for the embedding and the head, then the root.

    Order matters: inner modules first, so each gets its own all-gather group
    and the root only collects what is left (here nothing). Passing
    ``reshard_after_forward`` to the root as well overrides FSDP2's heuristic
    of keeping the root's parameters between forward and backward, so every
    parameter is gathered twice per step, as in the paper's stage 3.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs: dict = {"reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        if not isinstance(mp_policy, MixedPrecisionPolicy):
            raise ValueError(f"mp_policy must be a MixedPrecisionPolicy, got {type(mp_policy).__name__}")
        kwargs["mp_policy"] = mp_policy
    parts: list[nn.Module] = [model.embed, *model.blocks, model.head]
    for part in parts:
        fully_shard(part, **kwargs)
    fully_shard(model, **kwargs)
    return model


def gather_per_rank(obj: object) -> list:
    """Every rank's ``obj`` (a small picklable value), in rank order, on every rank."""
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
