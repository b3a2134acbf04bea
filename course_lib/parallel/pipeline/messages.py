"""Who sends what to whom in a pipeline schedule, and when a sent tensor may go (chapter 08).

``op_links`` gives one op's receive and send: its peer rank and a tag (micro-batch, direction, receiving
chunk). ``message_batches`` groups them as ``executor.run_stage`` posts them, one batch between two
ops. ``send_releases`` finds, for each send, the first later receive that proves the peer has taken it,
so that the executor can free the sent tensor there; ``peak_sends_held`` is how many it then keeps at once.
"""

from __future__ import annotations

from typing import Sequence

from course_lib.parallel.pipeline.schedules import Schedule, frozen_prefix, num_chunks


def _tag(microbatch: int, backward: bool, chunk: int = 0, chunks: int = 1) -> int:
    """One tag per (micro-batch, direction, receiving chunk): with one chunk, 2 i + backward."""
    return (2 * microbatch + int(backward)) * chunks + chunk


Link = tuple[int, int]  # (peer rank, tag) of one message


def op_links(op: tuple, rank: int, world: int, chunks: int = 1,
             frozen: int = 0) -> tuple[Link | None, Link | None]:
    """What one op receives before it runs and sends after: ``(recv, send)``, ``None`` where it has none.

    ``chunks = v``: the op's chunk ``c`` is virtual stage ``c p + rank`` of ``p v``. ``frozen``: the
    first stages run forwards only (``pipeline.frozen_prefix``); the first trainable one sends no gradient.
    """
    kind, i, c = op[0], op[1], (op[2] if len(op) == 3 else 0)
    if kind == "W":
        return None, None                        # the weight gradient stays on the rank
    vs, last, bw = c * world + rank, world * chunks - 1, kind == "B"

    def link(other: int, receiver: int) -> Link:  # a message with virtual stage ``other``
        return other % world, _tag(i, bw, receiver // world, chunks)

    if kind == "F":                              # activations flow forward
        return (None if vs == 0 else link(vs - 1, vs)), (None if vs == last else link(vs + 1, vs + 1))
    return (None if vs == last else link(vs + 1, vs)), (None if vs <= frozen else link(vs - 1, vs - 1))  # back


def message_batches(order: Sequence[tuple], rank: int, world: int,
                    chunks: int = 1, frozen: int = 0) -> list[tuple[list[Link], list[Link]]]:
    """The ``(sends, recvs)`` a rank posts together between ops: batch ``k`` runs before op ``k``.

    Batch ``k`` holds op ``k-1``'s send and op ``k``'s receive; the last one
    (``k = len(order)``) only the last op's send. One batch is one
    ``dist.batch_isend_irecv``: in 1F1B's steady state a rank sends an
    activation to the next rank and receives a gradient from it, and NCCL
    runs such a pair only as one group (posted one by one, both ranks would
    sit in their send). The sends leave exactly when they did one by one.
    """
    links = [op_links(op, rank, world, chunks, frozen) for op in order]
    batches = []
    for k in range(len(order) + 1):
        send = links[k - 1][1] if k > 0 else None
        recv = links[k][0] if k < len(order) else None
        batches.append(([send] if send else [], [recv] if recv else []))
    return batches


def peak_sends_held(schedule: Schedule, rank: int) -> int:
    """The most sent tensors ``rank`` keeps alive at once under ``send_releases``: the schedule's bound.

    1F1B (``p >= 2``): ``min(p, m)`` on stage 0 (its warm-up's activations) and
    ``min(p - s + 1, m)`` on a later stage ``s`` (its cool-down's gradients),
    whatever ``m`` (chapter 08 checks this for p = 2..8, m = 1..24); GPipe: ``m``.
    """
    world, v, frozen = len(schedule), num_chunks(schedule), frozen_prefix(schedule)
    rel = send_releases(schedule, rank)
    sends = [k for k, o in enumerate(schedule[rank]) if op_links(o, rank, world, v, frozen)[1]]
    # before op r: every send up to op r - 1 that op r's receive (or a later one) has not yet proven delivered
    return max([0] + [sum(1 for j in sends if j < r and (rel[j] is None or rel[j] >= r))
                      for r in range(1, len(schedule[rank]) + 1)])


def send_releases(schedule: Schedule, rank: int) -> list[int | None]:
    """For each op of ``rank`` that sends: the first later op whose receive proves the peer has the message.

    The peer takes our message before it runs the op that consumes it; any
    message it sends us from a later op of its order arrives after that, so
    once we have received it, our send is complete and its tensor can go.
    ``None``: no such op (released at the end of the step), or the op sends nothing.
    """
    world, v, frozen = len(schedule), num_chunks(schedule), frozen_prefix(schedule)
    order = schedule[rank]
    links = [[op_links(o, q, world, v, frozen) for o in schedule[q]] for q in range(world)]
    # where each message (peer, tag, sender) is consumed and produced, as positions in the ranks' orders
    consumed = {(q, link[1], link[0]): j for q in range(world) for j, (link, _) in enumerate(links[q]) if link}
    produced = {(q, link[1], link[0]): j for q in range(world) for j, (_, link) in enumerate(links[q]) if link}
    out: list[int | None] = []
    for k, (_, send) in enumerate(links[rank]):
        release = None
        if send is not None:
            peer, tag = send
            took = consumed[(peer, tag, rank)]            # the peer's op that receives our message
            for r in range(k + 1, len(order)):
                recv = links[rank][r][0]
                if recv is not None and recv[0] == peer and produced[(peer, recv[1], rank)] > took:
                    release = r
                    break
        out.append(release)
    return out
