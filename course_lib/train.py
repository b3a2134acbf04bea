"""One training loop for every chapter (chapters 02-09).

``fit`` trains with optional gradient accumulation and autocast, shows a
progress bar, keeps a history (loss, accuracy, samples/s, memory) and can save
and resume its whole state, so an interrupted run continues to the same numbers.
``accumulate`` is the bare gradient-accumulation step of chapter 03.
"""

from __future__ import annotations

import os
import random
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader
from tqdm import tqdm

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def accumulate(model: nn.Module, loss_fn: LossFn, inputs: torch.Tensor, targets: torch.Tensor,
               micro_batches: int) -> float:
    """Leave in ``.grad`` the gradient of the full batch's mean loss, computed in ``micro_batches`` pieces.

    Each piece's mean loss is weighted by its share of the samples (n_i / N),
    so an uneven split (10 samples in 3 pieces: 4, 3, 3) is still exact.
    Gradients add onto what ``.grad`` holds: zero them first. Returns the full
    batch's mean loss. ``loss_fn`` must return a mean over the samples it gets.
    """
    n = len(inputs)
    if not 1 <= micro_batches <= n:
        raise ValueError(
            f"cannot split a batch of {n} samples into {micro_batches} micro-batches: "
            f"choose between 1 and {n}"
        )
    total = 0.0
    for x, y in zip(inputs.tensor_split(micro_batches), targets.tensor_split(micro_batches)):
        loss = loss_fn(model(x), y) * (len(x) / n)  # this piece's share of the full-batch mean
        loss.backward()  # frees this piece's activations before the next forward
        total += loss.item()
    return total


@dataclass
class History:
    """What ``fit`` measured, one entry per optimizer step (and per evaluation)."""

    step: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    accuracy: list[float] = field(default_factory=list)
    samples_per_s: list[float] = field(default_factory=list)
    memory_bytes: list[int] = field(default_factory=list)
    eval_step: list[int] = field(default_factory=list)
    eval_loss: list[float] = field(default_factory=list)
    eval_accuracy: list[float] = field(default_factory=list)

    def as_dict(self) -> dict[str, list]:
        return {k: list(v) for k, v in self.__dict__.items()}


def _memory_now(device: torch.device) -> int:
    """Peak CUDA bytes allocated since the last reset on a GPU; the process's resident size on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    try:
        import psutil

        return psutil.Process(os.getpid()).memory_info().rss
    except ImportError:  # psutil comes with jupyter; without it, no CPU memory figure
        return 0


def _accuracy(logits: torch.Tensor, targets: torch.Tensor) -> float:
    return (logits.argmax(-1) == targets).float().mean().item()


@torch.no_grad()
def evaluate(model: nn.Module, loader: DataLoader, loss_fn: LossFn = F.cross_entropy,
             device: torch.device | str = "cpu") -> tuple[float, float]:
    """Mean loss and accuracy over a loader, in eval mode (the model's mode is restored)."""
    was_training = model.training
    model.eval()
    loss_sum = correct = count = 0.0
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        out = model(x)
        loss_sum += loss_fn(out, y).item() * len(x)
        correct += (out.argmax(-1) == y).float().sum().item() * (len(x) / y.numel())
        count += len(x)
    model.train(was_training)
    return loss_sum / count, correct / count


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
                    scheduler: object | None, progress: dict, history: History,
                    loader_state: torch.Tensor | None) -> None:
    """Write everything a run needs to continue exactly: weights, optimizer, scheduler, RNGs, position."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save({
        "model": model.state_dict(), "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "progress": progress, "history": history.as_dict(), "rng": _rng_state(), "loader": loader_state,
    }, tmp)
    os.replace(tmp, path)  # atomic: a run killed while saving keeps the previous checkpoint


# ----- the loop ----------------------------------------------------------------------


def _groups(it: Iterator, k: int) -> Iterator[list]:
    """Consecutive groups of up to ``k`` batches: one optimizer step each."""
    group: list = []
    for batch in it:
        group.append(batch)
        if len(group) == k:
            yield group
            group = []
    if group:
        yield group


def fit(
    model: nn.Module,
    loader: DataLoader,
    optimizer: torch.optim.Optimizer,
    loss_fn: LossFn = F.cross_entropy,
    epochs: int = 1,
    max_steps: int | None = None,
    accumulation_steps: int = 1,
    autocast_dtype: torch.dtype | None = None,
    scheduler: object | None = None,
    eval_loader: DataLoader | None = None,
    device: torch.device | str | None = None,
    checkpoint_path: str | Path | None = None,
    checkpoint_every: int = 0,
    resume: bool = False,
    progress: bool | None = None,
    stop_after: int | None = None,
) -> History:
    """Train ``model``; return its ``History``.

    Each optimizer step uses ``accumulation_steps`` consecutive batches of
    ``loader`` (the micro-batches), each loss weighted by its share of the
    step's samples. ``autocast_dtype`` (e.g. ``torch.bfloat16``) runs the
    forward pass under autocast. With ``checkpoint_path``, the state is saved
    every ``checkpoint_every`` steps and at the end; ``resume=True`` continues
    from it. ``stop_after`` ends the call after that many steps (to simulate
    an interruption). ``scheduler`` steps once per optimizer step.
    """
    if accumulation_steps < 1:
        raise ValueError(f"accumulation_steps must be at least 1, got {accumulation_steps}")
    device = torch.device(device) if device is not None else next(model.parameters()).device
    if progress is None:
        progress = os.environ.get("COURSE_PROGRESS", "1") != "0"
    history, step, start_epoch, skip = History(), 0, 0, 0
    generator = getattr(loader, "generator", None)
    if resume and checkpoint_path is not None and Path(checkpoint_path).exists():
        ckpt = torch.load(checkpoint_path, weights_only=False)
        load_model_state(model, ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        if scheduler is not None and ckpt["scheduler"] is not None:
            scheduler.load_state_dict(ckpt["scheduler"])
        _set_rng_state(ckpt["rng"])
        history = History(**ckpt["history"])
        step, start_epoch, skip = ckpt["progress"]["step"], ckpt["progress"]["epoch"], ckpt["progress"]["batches"]
        if generator is not None and ckpt["loader"] is not None:
            generator.set_state(ckpt["loader"])
    total = max_steps or epochs * -(-len(loader) // accumulation_steps)
    bar = tqdm(total=total, initial=step, disable=not progress, mininterval=1.0, desc="train")
    def amp() -> object:
        # A fresh context per forward pass. (An autocast object is itself callable, as a
        # decorator, so it cannot be told apart from a factory by ``callable``.)
        return torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype is not None else nullcontext()

    done_this_call = 0
    model.train()
    for epoch in range(start_epoch, epochs):
        # The loader's shuffling generator at the start of the epoch: saved so a resume replays the same order.
        epoch_state = generator.get_state() if generator is not None else None
        batches = iter(loader)
        for _ in range(skip):
            next(batches)
        consumed = skip
        skip = 0
        for group in _groups(batches, accumulation_steps):
            if max_steps is not None and step >= max_steps:
                break
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            t0 = time.perf_counter()
            n_total = sum(len(x) for x, _ in group)
            optimizer.zero_grad(set_to_none=True)
            loss_sum = correct = 0.0
            for x, y in group:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                with amp():
                    out = model(x)
                    loss = loss_fn(out, y)
                (loss * (len(x) / n_total)).backward()
                loss_sum += loss.item() * len(x)
                correct += _accuracy(out.detach().float(), y) * len(x)
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dt = time.perf_counter() - t0
            step += 1
            consumed += len(group)
            done_this_call += 1
            history.step.append(step)
            history.loss.append(loss_sum / n_total)
            history.accuracy.append(correct / n_total)
            history.samples_per_s.append(n_total / dt)
            history.memory_bytes.append(_memory_now(device))
            bar.update(1)
            bar.set_postfix(loss=f"{history.loss[-1]:.3f}")
            at_end = consumed >= len(loader)
            if at_end and eval_loader is not None:
                # Evaluate before any checkpoint of this step, so a run resumed from it has this entry too.
                loss, acc = evaluate(model, eval_loader, loss_fn, device)
                history.eval_step.append(step)
                history.eval_loss.append(loss)
                history.eval_accuracy.append(acc)
            stopping = stop_after is not None and done_this_call >= stop_after
            if checkpoint_path is not None and (stopping or (checkpoint_every and step % checkpoint_every == 0)):
                # Mid-epoch: the generator as the epoch began, to replay its order and skip what was done.
                # At the end of an epoch: the generator as it is now, so the next epoch's order follows.
                if at_end:
                    # Run the loader to its end first: RandomSampler draws once more from the generator as it
                    # stops, and the uninterrupted run's next epoch starts after that draw.
                    next(batches, None)
                loader_state = epoch_state if not at_end else (generator.get_state() if generator is not None else None)
                save_checkpoint(checkpoint_path, model, optimizer, scheduler,
                                {"step": step, "epoch": epoch + at_end, "batches": 0 if at_end else consumed},
                                history, loader_state)
            if stopping:
                bar.close()
                return history
        if max_steps is not None and step >= max_steps:
            break
    bar.close()
    if checkpoint_path is not None:
        save_checkpoint(checkpoint_path, model, optimizer, scheduler,
                        {"step": step, "epoch": epochs, "batches": 0}, history,
                        generator.get_state() if generator is not None else None)
    return history
