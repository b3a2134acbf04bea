"""One rank running any pipeline schedule written as data (chapter 08): GPipe, 1F1B, interleaved, ZB-H1.

``run_stage`` walks this rank's op list from ``schedules.make_schedule``: ``("F", i)`` and ``("B", i)`` are
``gpipe_1f1b``'s forward and backward of micro-batch ``i`` (receive, compute, send); ``("W", i)`` (zero bubble)
computes the weight gradients its ``B`` left (``split_backward``); ``("F", i, c)`` (interleaved) runs model chunk
``c``, virtual stage ``c p + rank``.

Between two ops a rank posts one batch of messages (``message_batches``): the send of the op just finished and the
receive of the next. It waits only for the receive, so a schedule the simulator can play cannot deadlock here, and
it keeps each sent tensor only until a later message proves that the peer has it (``send_releases``).

A stage without backward (a frozen prefix, ``freeze``) keeps no graph. ``Watch`` is where the experiments plug in.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Sequence

import torch
from torch import nn

from course_lib.parallel import collectives as comm
from course_lib.parallel.pipeline.schedules import Schedule, check_schedule, frozen_prefix, num_chunks, op_triple
from course_lib.parallel.pipeline.split_backward import (WeightGrads, backward_input, backward_weight,
                                                         recording_activations)

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Shape = tuple[tuple[int, ...], torch.dtype]
Link = tuple[int, int]                                 # (peer rank, tag) of one message


def split_sequential(model: nn.Sequential, num_stages: int) -> list[nn.Sequential]:
    """Cut ``model`` into ``num_stages`` consecutive pieces with as equal numbers of modules as possible. The pieces
    share the model's modules (no copy). Real systems balance by measured time or memory per layer; equal counts
    suit a stack of equal blocks."""
    layers = list(model)
    if not 1 <= num_stages <= len(layers):
        raise ValueError(f"cannot cut {len(layers)} modules into {num_stages} stages: "
                         f"choose 1 <= num_stages <= {len(layers)} (or give the model more layers)")
    base, extra = divmod(len(layers), num_stages)
    bounds = [s * base + min(s, extra) for s in range(num_stages + 1)]   # the first stages take one more
    return [nn.Sequential(*layers[a:b]) for a, b in zip(bounds, bounds[1:])]


@torch.no_grad()
def boundary_shapes(stages: Sequence[nn.Module], sample: torch.Tensor) -> list[Shape]:
    """Shape and dtype of the tensor that enters each stage, for one micro-batch ``sample``. A rank must allocate its
    receive buffer before the data arrives, so every rank computes these once from the whole model (cheap next to a
    training step)."""
    shapes, x = [], sample
    for stage in stages:
        shapes.append((tuple(x.shape), x.dtype))
        x = stage(x)
    return shapes


# ----------------------------------------------------------------------------- who sends what to whom, and when

def op_links(op: tuple, rank: int, world: int, chunks: int = 1, frozen: int = 0) -> tuple[Link | None, Link | None]:
    """What one op receives before it runs and sends after: ``(recv, send)``, ``None`` where it has none.
    ``chunks = v``: the op's chunk ``c`` is virtual stage ``c p + rank`` of ``p v``. ``frozen``: the first stages
    run forwards only (``schedules.frozen_prefix``); the first trainable one sends no gradient. One tag per
    (micro-batch, direction, receiving chunk): with one chunk, ``2 i + backward``."""
    kind, i, c = op_triple(op)
    if kind == "W":
        return None, None                        # the weight gradient stays on the rank
    vs, last, bw = c * world + rank, world * chunks - 1, kind == "B"

    def link(other: int, receiver: int) -> Link:  # a message with virtual stage ``other``
        return other % world, (2 * i + bw) * chunks + receiver // world

    if kind == "F":                              # activations flow forward
        return (None if vs == 0 else link(vs - 1, vs)), (None if vs == last else link(vs + 1, vs + 1))
    return (None if vs == last else link(vs + 1, vs)), (None if vs <= frozen else link(vs - 1, vs - 1))  # back


def message_batches(order: Sequence[tuple], rank: int, world: int,
                    chunks: int = 1, frozen: int = 0) -> list[tuple[list[Link], list[Link]]]:
    """The ``(sends, recvs)`` a rank posts together: batch ``k`` holds op ``k - 1``'s send and op ``k``'s receive
    (the last, ``k = len(order)``, only the last op's send). One batch is one ``dist.batch_isend_irecv``: in 1F1B's
    steady state a rank sends an activation to the next rank and receives a gradient from it, and NCCL runs such a
    pair only as one group (posted one by one, both ranks would sit in their send). The sends leave exactly when
    they did one by one."""
    links = [(None, None)] + [op_links(op, rank, world, chunks, frozen) for op in order] + [(None, None)]
    return [([send] if send else [], [recv] if recv else []) for (_, send), (recv, _) in zip(links, links[1:])]


def send_releases(schedule: Schedule, rank: int) -> list[int | None]:
    """For each op of ``rank`` that sends: the first later op whose receive proves the peer has the message (``None``:
    no such op, released at the end of the step; or the op sends nothing). The peer takes our message before it runs
    the op that consumes it; any message it sends us from a later op of its order arrives after that, so once we
    have received it, our send is complete and its tensor can go."""
    world, v, frozen = len(schedule), num_chunks(schedule), frozen_prefix(schedule)
    links = [[op_links(o, q, world, v, frozen) for o in schedule[q]] for q in range(world)]
    # where each message (receiver, tag, sender) is consumed and produced, as positions in the ranks' orders
    consumed = {(q, r[1], r[0]): j for q in range(world) for j, (r, _) in enumerate(links[q]) if r}
    produced = {(q, s[1], s[0]): j for q in range(world) for j, (_, s) in enumerate(links[q]) if s}
    out: list[int | None] = []
    for k, (_, send) in enumerate(links[rank]):
        release = None
        if send is not None:
            took = consumed[(send[0], send[1], rank)]           # the peer's op that receives our message
            release = next((r for r in range(k + 1, len(links[rank])) if (recv := links[rank][r][0]) is not None
                            and recv[0] == send[0] and produced[(send[0], recv[1], rank)] > took), None)
        out.append(release)
    return out


class Watch:
    """What the executor tells an observer; this one ignores it all. The algorithm never reads anything back.

    ``course_lib.experiments.pipeline_meter.Meter`` times and pads the ops, counts memory and messages.
    """

    def begin(self) -> None:
        """The rank starts its ops."""

    def op(self, kind: str, i: int, c: int) -> ContextManager[None]:
        """Around one op's work."""
        return contextlib.nullcontext()

    def kept(self, i: int, c: int, inflight: int) -> None:
        """A forward kept its graph; ``inflight`` graphs are kept now."""

    def freed(self, i: int, c: int) -> None:
        """A backward (its ``W``, when split) freed that graph."""

    def sent(self, nbytes: int, held: int) -> None:
        """A message left; ``held``: sent tensors kept until their peer has them."""

    def finish(self) -> None:
        """The last message has left."""


class Mailbox:
    """One rank's batches of messages (``message_batches``), each sent tensor kept until ``send_releases``."""

    def __init__(self, schedule: Schedule, rank: int, ranks: Sequence[int] | None = None,
                 watch: Watch | None = None):
        world, v = len(schedule), num_chunks(schedule)
        self.batches = message_batches([tuple(o) for o in schedule[rank]], rank, world, v, frozen_prefix(schedule))
        self.ranks = list(ranks) if ranks is not None else list(range(world))   # stage -> process rank
        self.releases = send_releases(schedule, rank)
        self.held: dict[int, tuple[comm.Exchange, torch.Tensor]] = {}   # op -> its send, tensor kept until done
        self.watch = watch or Watch()

    def exchange(self, k: int, outgoing: torch.Tensor | None, into: torch.Tensor | None = None) -> None:
        """Post batch ``k`` (``outgoing``: op ``k - 1``'s result; ``into``: op ``k``'s receive); wait for the receive
        only (the rank idles here), the send completes in the background."""
        sends, recvs = self.batches[k]
        ex = comm.exchange([comm.Message(outgoing, self.ranks[q], tag) for q, tag in sends],
                           [comm.Message(into, self.ranks[q], tag) for q, tag in recvs])
        if sends:
            self.held[k - 1] = (ex, outgoing)
            self.watch.sent(outgoing.nbytes, len(self.held))
        if recvs:
            ex.wait_received()
            for j in [j for j in self.held if self.releases[j] is not None and self.releases[j] <= k]:
                self.held.pop(j)[0].wait()        # returns at once: the peer has the message

    def finish(self, outgoing: torch.Tensor | None) -> None:
        """Post the last batch (the last op's send ``outgoing``) and wait until every send still held has left."""
        self.exchange(len(self.batches) - 1, outgoing)
        for ex, _ in self.held.values():
            ex.wait()
        self.watch.finish()


@dataclass
class MicroBatch:
    """One micro-batch on one model chunk, from its forward until its backward has freed its graph."""

    x: torch.Tensor                                # what entered the chunk (its gradient goes back)
    out: torch.Tensor                              # what left it; on the last virtual stage its loss / m
    activations: set = field(default_factory=set)  # split backward: the forward's activation nodes, for B
    weight_grads: WeightGrads | None = None        # split backward: what B left for W


def run_stage(stage: nn.Module | Sequence[nn.Module], schedule: Schedule, rank: int, in_shape: Shape | Sequence[Shape],
              inputs: Sequence[torch.Tensor] | None = None, targets: Sequence[torch.Tensor] | None = None,
              loss_fn: LossFn | None = None, device: torch.device | str = "cpu", ranks: Sequence[int] | None = None,
              watch: Watch | None = None) -> tuple[list[torch.Tensor], list[float]]:
    """Run ``schedule[rank]``, this rank's ops; gradients accumulate in ``stage``. Returns the last stage's outputs
    and losses (empty elsewhere). ``stage`` is this rank's module, or its ``v`` chunks for an interleaved schedule
    (``in_shape`` then one per chunk). ``inputs`` (rank 0) and ``targets`` with ``loss_fn`` (rank ``p - 1``) hold
    one tensor per micro-batch. Each loss is divided by ``m``, so the summed gradients are those of the whole batch's
    mean loss. ``ranks`` names the process of each stage (default ``0..p-1``): data-parallel pipelines can share one
    group."""
    world, m, split = check_schedule(schedule)
    v, order = num_chunks(schedule), [tuple(o) for o in schedule[rank]]
    chunks = list(stage) if isinstance(stage, (list, tuple)) else [stage]
    shapes = list(in_shape) if v > 1 else [in_shape]
    if len(chunks) != v or len(shapes) != v:
        raise ValueError(f"the schedule has {v} model chunks per rank: pass {v} modules and {v} input shapes")
    if v > 1 and world < 2:
        raise ValueError("interleaving needs at least 2 ranks (a micro-batch goes round them v times)")
    if ranks is not None and len(ranks) != world:
        raise ValueError(f"ranks names the process of each of the {world} stages; got {list(ranks)}")
    if rank == 0 and (inputs is None or len(inputs) != m):
        raise ValueError(f"the first stage needs one input per micro-batch ({m})")
    if rank == world - 1 and (targets is None or loss_fn is None or len(targets) != m):
        raise ValueError(f"the last stage needs loss_fn and one target per micro-batch ({m})")
    watch = watch or Watch()
    trains = any(o[0] != "F" for o in order)          # forwards only (frozen): no graph, nothing kept
    # the inputs whose gradient someone waits for: their backward sends one back
    wants_grad = {op_triple(o)[1:] for o in order
                  if o[0] == "B" and op_links(o, rank, world, v, frozen_prefix(schedule))[1] is not None}
    params = [list(ch.parameters()) for ch in chunks]
    mail = Mailbox(schedule, rank, ranks, watch)
    inflight: dict[tuple[int, int], MicroBatch] = {}   # (micro-batch, chunk) -> its record until freed
    outputs: list[torch.Tensor] = []
    losses: list[torch.Tensor] = []
    outgoing: torch.Tensor | None = None              # what the op just run sends
    watch.begin()
    for k, op in enumerate(order):
        kind, i, c = op_triple(op)
        at_end = c * world + rank == world * v - 1    # the last virtual stage computes the loss
        if kind == "F":
            first = c * world + rank == 0                 # the first virtual stage reads the input
            x = None if first else torch.empty(shapes[c][0], dtype=shapes[c][1], device=device)
            mail.exchange(k, outgoing, into=x)            # wait (idle) for the previous stage
            x = inputs[i].to(device) if first else x.requires_grad_((i, c) in wants_grad)
            with watch.op(kind, i, c), torch.set_grad_enabled(trains), \
                    recording_activations(chunks[c]) if split else contextlib.nullcontext(set()) as activations:
                y = chunks[c](x)
                if at_end:
                    outputs.append(y.detach())
                    y = loss_fn(y, targets[i].to(device)) / m
                    losses.append(y.detach())
                if trains:
                    inflight[(i, c)] = MicroBatch(x, y, activations)
                    watch.kept(i, c, len(inflight))
                outgoing = None if at_end else y.detach().contiguous()
        elif kind == "B":
            mb = inflight[(i, c)]
            grad = None if at_end else torch.empty_like(mb.out)   # None: the loss starts the backward
            mail.exchange(k, outgoing, into=grad)     # wait (idle) for the next stage's gradient
            with watch.op(kind, i, c):
                if split:                             # activations' gradients only; the graph stays for W
                    dx, mb.weight_grads = backward_input(mb.out, grad, mb.x, mb.activations, params[c])
                    mb.activations = set()
                else:                                 # input and weight gradients in one pass
                    mb.out.backward(grad)
                    dx = mb.x.grad
                    del inflight[(i, c)]              # the graph of micro-batch i is freed here
                    watch.freed(i, c)
                outgoing = None if dx is None else dx.contiguous()
        else:                                         # W: the weights' gradients, from what B kept
            mail.exchange(k, outgoing)
            mb = inflight.pop((i, c))
            with watch.op(kind, i, c):
                backward_weight(mb.weight_grads)
                watch.freed(i, c)
            outgoing = None
    mail.finish(outgoing)
    return [o.cpu() for o in outputs], [loss.item() * m for loss in losses]
