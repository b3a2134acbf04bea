"""One training loop for the single-process chapters (chapters 02-05).

``fit`` is a flat loop in the shape of nanoGPT's ``train.py``: for each optimizer step, fetch that step's
micro-batches, run forward and backward on each (its loss weighted by its share of the samples), step the
optimizer and the scheduler, log, evaluate, save a checkpoint. Which samples a step reads (a pure function of
(seed, step)) and the checkpoint a run resumes from, with the same numbers as a run never interrupted, are
``resume``'s. ``accumulate`` is the bare gradient-accumulation step of chapter 03.
"""

from __future__ import annotations

import functools
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader
from tqdm import tqdm

from course_lib.resume import StepOrder, load_checkpoint, save_checkpoint, step_generator

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
        raise ValueError(f"cannot split a batch of {n} samples into {micro_batches} micro-batches: "
                         f"choose between 1 and {n}")
    shares = []
    for x, y in zip(inputs.tensor_split(micro_batches), targets.tensor_split(micro_batches)):
        loss = loss_fn(model(x), y) * (len(x) / n)  # this piece's share of the full-batch mean
        loss.backward()  # frees this piece's activations before the next forward
        shares.append(loss.detach())  # a tensor: reading it now (.item()) would wait for the GPU every piece
    return torch.stack(shares).sum().item()


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


@functools.lru_cache(maxsize=8)
def _process(pid: int) -> Any:
    """This process's psutil handle, made once per pid (a forked run has its own): making one reads /proc."""
    import psutil

    return psutil.Process(pid)


def _memory_now(device: torch.device) -> int:
    """Peak CUDA bytes allocated since the last reset on a GPU; the process's resident size on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    try:
        return _process(os.getpid()).memory_info().rss
    except ImportError:  # psutil comes with jupyter; without it, no CPU memory figure
        return 0


def _correct(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Correct predictions, counted per sample (a sequence's share is its fraction of correct tokens)."""
    return (logits.argmax(-1) == targets).float().mean() * len(targets)


@torch.no_grad()
def evaluate(model: nn.Module, loader: DataLoader, loss_fn: LossFn = F.cross_entropy,
             device: torch.device | str = "cpu") -> tuple[float, float]:
    """Mean loss and accuracy over a loader, in eval mode (the model's mode is restored)."""
    was_training = model.training
    model.eval()
    sums, count = torch.zeros(2, device=device), 0
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        out = model(x)
        sums += torch.stack([loss_fn(out, y).float() * len(x), _correct(out, y)])
        count += len(x)
    model.train(was_training)
    loss_sum, correct = sums.tolist()  # one wait for the device, at the end
    return loss_sum / count, correct / count


def _micro_batches(loader: DataLoader, order: StepOrder, start: int, stop: int) -> Iterator:
    """The micro-batches of steps ``start``..``stop - 1``, loaded as ``loader`` loads: its dataset, collate
    function, ``num_workers`` (processes that prepare the next batches while the model trains), ``pin_memory``.

    Workers seed their generators (random augmentation) from (seed, start): a resumed run reads the same
    samples, but augments them in workers unlike an uninterrupted run (the main process uses the global
    generator, which checkpoints restore)."""
    indices = (batch for step in range(start, stop) for batch in order.batches(step))
    workers = loader.num_workers
    return iter(DataLoader(loader.dataset, batch_sampler=indices, num_workers=workers,
                           collate_fn=loader.collate_fn, pin_memory=loader.pin_memory, timeout=loader.timeout,
                           worker_init_fn=loader.worker_init_fn, multiprocessing_context=loader.multiprocessing_context,
                           prefetch_factor=loader.prefetch_factor if workers else None,
                           generator=step_generator(order.seed, -1 - start)))  # apart from epochs'



# ----- the loop ----------------------------------------------------------------------


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
    """Train ``model`` for ``epochs`` passes over ``loader``'s data (at most ``max_steps`` steps); return the ``History``.

    Each optimizer step uses ``accumulation_steps`` consecutive batches (the micro-batches), each loss weighted
    by its share of the step's samples. ``autocast_dtype`` (e.g. ``torch.bfloat16``) runs the forward passes
    under autocast. ``scheduler`` steps once per optimizer step; ``eval_loader`` is evaluated after each epoch.
    With ``checkpoint_path`` the state is saved every ``checkpoint_every`` steps and at the end;
    ``resume=True`` continues from it. ``stop_after`` ends the call after that many steps (an interruption).
    Samples/s count the whole step, from the end of the previous one: waiting for the loader included.
    """
    if accumulation_steps < 1:
        raise ValueError(f"accumulation_steps must be at least 1, got {accumulation_steps}")
    device = torch.device(device) if device is not None else next(model.parameters()).device
    order, history, start = StepOrder.of(loader, accumulation_steps), History(), 0
    if resume and checkpoint_path is not None and Path(checkpoint_path).exists():
        order, saved, start = load_checkpoint(checkpoint_path, model, optimizer, scheduler, order)
        history = History(**saved)
    total = epochs * order.steps_per_epoch if max_steps is None else min(max_steps, epochs * order.steps_per_epoch)
    stop = total if stop_after is None else min(total, start + stop_after)
    show = progress if progress is not None else os.environ.get("COURSE_PROGRESS", "1") != "0"
    bar = tqdm(total=total, initial=start, disable=not show, mininterval=1.0, desc="train")
    amp = (lambda: torch.autocast(device.type, dtype=autocast_dtype)) if autocast_dtype is not None else nullcontext

    model.train()
    t_last = time.perf_counter()
    batches = _micro_batches(loader, order, start, stop)
    try:
        for step in range(start, stop):
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            micro = [next(batches) for _ in range(order.micro_batches(step))]  # waiting for the loader is in the step
            n_step = sum(len(y) for _, y in micro)
            optimizer.zero_grad(set_to_none=True)
            loss_sum, correct = torch.zeros((), device=device), torch.zeros((), device=device)
            for x, y in micro:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                with amp():
                    out = model(x)
                    loss = loss_fn(out, y)
                (loss * (len(x) / n_step)).backward()  # this micro-batch's share of the step's mean loss
                loss_sum += loss.detach() * len(x)      # tensors, not .item(): no wait for the device here
                correct += _correct(out.detach(), y)
            optimizer.step()
            if scheduler is not None:
                scheduler.step()

            loss_value, accuracy = (torch.stack([loss_sum, correct]) / n_step).tolist()  # the step's one sync
            done = step + 1
            history.step.append(done)
            history.loss.append(loss_value)
            history.accuracy.append(accuracy)
            history.samples_per_s.append(n_step / (time.perf_counter() - t_last))
            history.memory_bytes.append(_memory_now(device))
            bar.update(1)
            bar.set_postfix(loss=f"{loss_value:.3f}")
            if eval_loader is not None and done % order.steps_per_epoch == 0:
                # before this step's checkpoint, so a run resumed from it has this entry too
                e_loss, e_acc = evaluate(model, eval_loader, loss_fn, device)
                history.eval_step.append(done)
                history.eval_loss.append(e_loss)
                history.eval_accuracy.append(e_acc)
            if checkpoint_path is not None and (done == stop or (checkpoint_every and done % checkpoint_every == 0)):
                save_checkpoint(checkpoint_path, model, optimizer, scheduler, done, history, order)
            t_last = time.perf_counter()  # the next step's time starts here: evaluating and saving are not in it
    finally:
        del batches  # shuts down the loader's workers now, also after an error
        bar.close()
    return history
