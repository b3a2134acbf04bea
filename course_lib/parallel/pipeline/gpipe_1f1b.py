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


def exchange(pipe: Pipe, send_y: torch.Tensor | None = None, send_dx: torch.Tensor | None = None,
             recv_x: bool = False, grad_of: torch.Tensor | None = None) -> tuple[torch.Tensor | None, ...]:
    """Post one batch of messages with the neighbours and wait for it; return ``(x, grad)`` received.

    Sends our output ``send_y`` on and our input's gradient ``send_dx`` back; receives (``recv_x``) the next
    activation from ``s - 1`` and (``grad_of``) the gradient of that output from ``s + 1``; what has no neighbour
    is skipped. One batch: in the steady state two neighbours each send to the other before receiving; posted one
    by one, both would sit in their send (NCCL's and gloo's sends wait for the receiver). ``batch_isend_irecv``
    moves both directions."""
    prev, nxt = pipe.rank - 1, pipe.rank + 1
    sends = ([comm.Message(send_y.detach().contiguous(), nxt)] if send_y is not None and not pipe.last else []) + \
        ([comm.Message(send_dx.contiguous(), prev)] if send_dx is not None and not pipe.first else [])
    # receive buffers are allocated first: their shapes are known (our input, our output)
    x = torch.empty(pipe.in_shape, dtype=pipe.dtype, device=pipe.device) if recv_x and not pipe.first else None
    grad = torch.empty_like(grad_of) if grad_of is not None and not pipe.last else None
    recvs = ([comm.Message(x, prev)] if x is not None else []) + ([comm.Message(grad, nxt)] if grad is not None else [])
    comm.exchange(sends, recvs).wait()
    return (None if x is None else x.requires_grad_()), grad   # x: we send its gradient back


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


def gpipe_step(pipe: Pipe, m: int, inputs: Sequence[torch.Tensor] | None = None,
               targets: Sequence[torch.Tensor] | None = None) -> list[float]:
    """All forwards, then all backwards; rank 0 passes the ``m`` micro-batches, the last rank their targets.
    Returns the last rank's ``m`` losses (``[]`` elsewhere)."""
    kept = []                                     # (input, output) of every micro-batch: all m at once
    for i in range(m):
        x, _ = exchange(pipe, recv_x=True)
        y = forward(pipe, i, x, inputs, targets, m)
        exchange(pipe, send_y=y)
        kept.append((x, y))
    losses = [y.detach() for _, y in kept] if pipe.last else []
    for i in range(m):                            # backwards in the same order: micro-batch 0 first
        x, y = kept[i]
        _, grad = exchange(pipe, grad_of=y)
        exchange(pipe, send_dx=backward(x, y, grad))
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
        x, _ = exchange(pipe, recv_x=True)
        exchange(pipe, send_y=fwd(i, x))
    # 2. steady: one forward (the newest micro-batch), one backward (the oldest); at most warmup + 1 kept
    steady = m - warmup
    x = exchange(pipe, recv_x=True)[0] if steady > 0 else None
    for j in range(steady):
        y = fwd(warmup + j, x)
        _, grad = exchange(pipe, send_y=y, grad_of=kept[0][1])    # our output on, the oldest's gradient in
        dx = backward(*kept.pop(0), grad)
        x, _ = exchange(pipe, send_dx=dx, recv_x=j < steady - 1)  # its gradient back, the next activation in
    # 3. cool-down: the warm-up's micro-batches, backward only, draining the pipe
    for _ in range(warmup):
        x_old, y_old = kept.pop(0)
        _, grad = exchange(pipe, grad_of=y_old)
        exchange(pipe, send_dx=backward(x_old, y_old, grad))
    return [loss.item() * m for loss in losses]
