"""What makes a run resumable with the same numbers as one never interrupted (chapters 02-05, used by ``train.fit``).

Which samples an optimizer step reads is a pure function of (seed, step) (``StepOrder``), so a run resumes
from the step index alone, without replaying or skipping any batch; the checkpoint (``save_checkpoint``,
``load_checkpoint``) holds everything else: weights, optimizer, scheduler, the RNGs, the steps done.
"""

from __future__ import annotations

import functools
import os
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, RandomSampler, SequentialSampler


def step_generator(seed: int, index: int) -> torch.Generator:
    """A generator seeded by the pair (seed, index), as chapter 09's ``experiment.global_batch`` seeds each step's batch."""
    return torch.Generator().manual_seed((seed * 100_003 + index) % 2**63)


@functools.lru_cache(maxsize=2)
def epoch_order(n: int, seed: int, epoch: int, shuffle: bool = True) -> torch.Tensor:
    """The order of the ``n`` samples in ``epoch``: a permutation drawn from a generator seeded by (seed, epoch)."""
    if not shuffle:
        return torch.arange(n)  # host: a sampler's index
    return torch.randperm(n, generator=step_generator(seed, epoch))  # host: a sampler's index


@dataclass(frozen=True)
class StepOrder:
    """Which samples each optimizer step reads, as a pure function of the step index.

    Epoch e is ``epoch_order(n, seed, e)`` cut into batches of ``batch_size`` (a short last one, or none with
    ``drop_last``); step s takes the next ``accumulation_steps`` batches of its epoch (fewer at its end).
    """

    n: int
    batch_size: int
    accumulation_steps: int
    shuffle: bool
    drop_last: bool
    seed: int

    @property
    def batches_per_epoch(self) -> int:
        return self.n // self.batch_size if self.drop_last else -(-self.n // self.batch_size)

    @property
    def steps_per_epoch(self) -> int:
        return -(-self.batches_per_epoch // self.accumulation_steps)

    def micro_batches(self, step: int) -> int:
        """How many micro-batches ``step`` has: ``accumulation_steps``, fewer at the end of an epoch."""
        done_in_epoch = step % self.steps_per_epoch * self.accumulation_steps
        return min(self.accumulation_steps, self.batches_per_epoch - done_in_epoch)

    def batches(self, step: int) -> list[list[int]]:
        """The sample indices of each micro-batch of ``step``."""
        epoch, j = divmod(step, self.steps_per_epoch)
        order, first = epoch_order(self.n, self.seed, epoch, self.shuffle), j * self.accumulation_steps
        b = self.batch_size
        return [order[i * b:(i + 1) * b].tolist() for i in range(first, first + self.micro_batches(step))]

    @classmethod
    def of(cls, loader: DataLoader, accumulation_steps: int) -> "StepOrder":
        """The order of a loader from ``data.make_loader``: its dataset size, batch size, shuffling and seed."""
        if not isinstance(loader.sampler, (RandomSampler, SequentialSampler)) or loader.batch_size is None:
            raise ValueError(f"fit orders the samples itself and cannot follow a {type(loader.sampler).__name__} "
                             "or a custom batch_sampler: build the loader with course_lib.data.make_loader")
        # make_loader seeds the loader's generator; without one, draw a seed (checkpoints keep it)
        seed = (loader.generator.initial_seed() if loader.generator is not None
                else int(torch.randint(2**31, ())))  # host
        order = cls(len(loader.dataset), loader.batch_size, accumulation_steps,
                    isinstance(loader.sampler, RandomSampler), loader.drop_last, seed)
        if order.batches_per_epoch == 0:
            raise ValueError(f"{order.n} samples make no batch of {order.batch_size} (drop_last={order.drop_last})")
        return order


# ----- checkpoints --------------------------------------------------------------------


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def load_model_state(model: nn.Module, state: dict) -> None:
    """Load a state dict, or raise an error that names the missing and unexpected keys."""
    own = set(model.state_dict())
    missing, unexpected = sorted(own - set(state)), sorted(set(state) - own)
    if missing or unexpected:
        raise ValueError(
            "this checkpoint was saved from a different model.\n"
            f"  missing keys (in the model, not in the checkpoint): {missing[:10]}{' ...' if len(missing) > 10 else ''}\n"
            f"  unexpected keys (in the checkpoint, not in the model): {unexpected[:10]}{' ...' if len(unexpected) > 10 else ''}\n"
            "Build the model with the same architecture and sizes as the run that saved it."
        )
    model.load_state_dict(state)


def save_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: object | None, step: int, history: Any, order: StepOrder) -> None:
    """Write what a run needs to continue exactly: weights, optimizer, scheduler, RNGs, steps done, data order
    and ``history`` (a dataclass of lists, as ``train.History``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save({
        "model": model.state_dict(), "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict() if scheduler is not None else None, "step": step,
        "order": asdict(order), "history": asdict(history), "rng": _rng_state(),
    }, tmp)
    os.replace(tmp, path)  # atomic: a run killed while saving keeps the previous checkpoint


def load_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: object | None,
            order: StepOrder) -> tuple[StepOrder, dict, int]:
    """Load a checkpoint into the run's objects; return its data order (and seed), history (a dict) and steps done."""
    ckpt = torch.load(path, weights_only=False)
    load_model_state(model, ckpt["model"])
    saved = StepOrder(**ckpt["order"])
    if asdict(saved) | {"seed": 0} != asdict(order) | {"seed": 0}:
        raise ValueError(f"the checkpoint's run read its data as {saved}, this loader as {order}: resume with "
                         "the same dataset size, batch size, shuffling and accumulation_steps")
    optimizer.load_state_dict(ckpt["optimizer"])
    if scheduler is not None and ckpt["scheduler"] is not None:
        scheduler.load_state_dict(ckpt["scheduler"])
    _set_rng_state(ckpt["rng"])  # dropout masks (and augmentation in the main process) continue as they would have
    return saved, ckpt["history"], ckpt["step"]
