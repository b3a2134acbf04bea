"""GPipe and 1F1B as straight-line steps on one rank: read this first (chapter 08).

Rank ``s`` of ``p`` holds stage ``s``, a consecutive piece of the model. A **forward** receives an activation from
rank ``s - 1`` (rank 0 reads the micro-batch instead), runs the stage and sends the output to rank ``s + 1`` (the
last rank turns it into the loss instead). A **backward** receives the output's gradient from rank ``s + 1`` (the
last rank starts from its loss), back-propagates, which adds to the parameters' ``.grad``, and sends the input's
gradient back to rank ``s - 1``. Each micro-batch's loss is divided by ``m``: the summed gradients are those of
the whole batch's mean loss.

``gpipe_step``: all ``m`` forwards, then all ``m`` backwards; every stage holds ``m`` micro-batches' activations.
``one_f_one_b_step``: the same ops in three phases (warm-up, steady, cool-down); stage ``s`` holds at most
``p - s``. Same bubble, ``(p - 1) / (m + p - 1)``. ``executor`` runs any schedule written as data (interleaved,
zero bubble) with the same messages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from course_lib.parallel import collectives as comm


@dataclass
class Pipe:
    """One rank's place in the pipeline: its stage, its neighbours, and what it receives."""

    stage: nn.Module
    rank: int
    world: int
    in_shape: tuple[int, ...]                     # the activation that enters the stage (unused on rank 0)
    dtype: torch.dtype = torch.float32
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None   # the last rank's
    device: torch.device | str = "cpu"

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.world - 1


# ----------------------------------------------------------------------------- the four messages

def recv_forward(pipe: Pipe) -> torch.Tensor | None:
    """The activation from the previous rank (the receive buffer is allocated first: its shape is known)."""
    if pipe.first:
        return None
    x = torch.empty(pipe.in_shape, dtype=pipe.dtype, device=pipe.device)
    dist.recv(x, pipe.rank - 1)
    return x.requires_grad_()                     # we send its gradient back


def send_forward(pipe: Pipe, y: torch.Tensor) -> None:
    """Our output to the next rank (the last rank sends nothing on: it holds the loss)."""
    if not pipe.last:
        dist.send(y.detach().contiguous(), pipe.rank + 1)


def recv_backward(pipe: Pipe, y: torch.Tensor) -> torch.Tensor | None:
    """The gradient of our output ``y`` from the next rank; ``None`` on the last rank (the loss starts it)."""
    if pipe.last:
        return None
    grad = torch.empty_like(y)
    dist.recv(grad, pipe.rank + 1)
    return grad


def send_backward(pipe: Pipe, dx: torch.Tensor | None) -> None:
    """The gradient of our input back to the previous rank (rank 0's input is data: nothing goes back)."""
    if not pipe.first:
        dist.send(dx.contiguous(), pipe.rank - 1)


def send_forward_recv_backward(pipe: Pipe, y: torch.Tensor, y_old: torch.Tensor) -> torch.Tensor | None:
    """Send ``y`` on and receive the gradient of the older output ``y_old``, as ONE batch of messages.

    In the steady state two neighbours each send to the other before receiving: posted one by one, both sit in
    their send (NCCL's and gloo's sends wait for the receiver). One ``batch_isend_irecv`` moves both directions.
    """
    if pipe.last:
        return None
    grad = torch.empty_like(y_old)
    comm.exchange([comm.Message(y.detach().contiguous(), pipe.rank + 1)],
                  [comm.Message(grad, pipe.rank + 1)]).wait()
    return grad


def send_backward_recv_forward(pipe: Pipe, dx: torch.Tensor | None) -> torch.Tensor | None:
    """Send the input's gradient back and receive the next activation, as one batch (the mirror image)."""
    if pipe.first:
        return None
    x = torch.empty(pipe.in_shape, dtype=pipe.dtype, device=pipe.device)
    comm.exchange([comm.Message(dx.contiguous(), pipe.rank - 1)], [comm.Message(x, pipe.rank - 1)]).wait()
    return x.requires_grad_()


# ----------------------------------------------------------------------------- compute

def forward(pipe: Pipe, i: int, x: torch.Tensor | None, inputs: Sequence[torch.Tensor] | None,
            targets: Sequence[torch.Tensor] | None, m: int) -> torch.Tensor:
    """Micro-batch ``i`` through the stage (rank 0 reads ``inputs[i]``, the others ``x``), keeping its graph; the
    last rank returns the loss / ``m``."""
    y = pipe.stage(inputs[i].to(pipe.device) if pipe.first else x)
    return pipe.loss_fn(y, targets[i].to(pipe.device)) / m if pipe.last else y


def backward(x: torch.Tensor | None, y: torch.Tensor, grad: torch.Tensor | None) -> torch.Tensor | None:
    """Back-propagate ``grad`` (``None``: ``y`` is the loss) from ``y``; return the input's gradient."""
    y.backward(grad)                              # frees this micro-batch's saved activations
    return None if x is None else x.grad


# ----------------------------------------------------------------------------- the two schedules

def gpipe_step(pipe: Pipe, m: int, inputs: Sequence[torch.Tensor] | None = None,
               targets: Sequence[torch.Tensor] | None = None) -> list[float]:
    """All forwards, then all backwards; rank 0 passes the ``m`` micro-batches, the last rank their targets.
    Returns the last rank's ``m`` losses (``[]`` elsewhere)."""
    kept = []                                     # (input, output) of every micro-batch: all m at once
    for i in range(m):
        x = recv_forward(pipe)
        y = forward(pipe, i, x, inputs, targets, m)
        send_forward(pipe, y)
        kept.append((x, y))
    losses = [y.detach() for _, y in kept] if pipe.last else []
    for i in range(m):                            # backwards in the same order: micro-batch 0 first
        x, y = kept[i]
        send_backward(pipe, backward(x, y, recv_backward(pipe, y)))
        kept[i] = None                            # drop the graph once used
    return [loss.item() * m for loss in losses]   # one host sync, at the end


def one_f_one_b_step(pipe: Pipe, m: int, inputs: Sequence[torch.Tensor] | None = None,
                     targets: Sequence[torch.Tensor] | None = None) -> list[float]:
    """1F1B (PipeDream-Flush): warm-up forwards, then one forward one backward, then the backwards left.
    Same arguments, result and gradients as ``gpipe_step``; at most ``p - s`` micro-batches kept on rank ``s``."""
    kept, losses = [], []                         # (input, output) of the micro-batches between F and B

    def fwd(i: int, x: torch.Tensor | None) -> torch.Tensor:
        y = forward(pipe, i, x, inputs, targets, m)
        kept.append((x, y))
        losses.extend([y.detach()] if pipe.last else [])
        return y

    # 1. warm-up: p - s - 1 forwards, just enough that the first gradient comes back when the pipe is full
    warmup = min(pipe.world - pipe.rank - 1, m)
    for i in range(warmup):
        send_forward(pipe, fwd(i, recv_forward(pipe)))
    # 2. steady: one forward (the newest micro-batch), one backward (the oldest); at most warmup + 1 kept
    steady = m - warmup
    x = recv_forward(pipe) if steady > 0 else None
    for j in range(steady):
        y = fwd(warmup + j, x)
        grad = send_forward_recv_backward(pipe, y, kept[0][1])
        x_old, y_old = kept.pop(0)
        dx = backward(x_old, y_old, grad)
        if j < steady - 1:
            x = send_backward_recv_forward(pipe, dx)   # the gradient back, the next activation in
        else:
            send_backward(pipe, dx)                    # no forward left to receive
    # 3. cool-down: the warm-up's micro-batches, backward only, draining the pipe
    for _ in range(warmup):
        x_old, y_old = kept.pop(0)
        send_backward(pipe, backward(x_old, y_old, recv_backward(pipe, y_old)))
    return [loss.item() * m for loss in losses]
