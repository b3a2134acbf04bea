"""Pipeline-parallel schedules as data, and a simulator that plays them (chapter 08).

A model cut into ``p`` consecutive *stages* (one per device) trains on a batch split into ``m`` *micro-batches*.
A schedule says, for each stage, the order of its ops: ``("F", i)`` the forward of micro-batch ``i``, ``("B", i)``
its backward and, in zero bubble, ``("W", i)`` the weight-gradient half of the backward split off from ``B``.

- ``gpipe``: all forwards, then all backwards (Huang et al. 2019).
- ``1f1b``: warm-up forwards, one forward one backward, the remaining backwards (PipeDream-Flush, Narayanan et al.
  2021): GPipe's bubble, but stage ``s`` holds at most ``p - s`` micro-batches, not ``m``.
- ``zb-h1``: 1F1B whose postponed ``W`` ops fill the cool-down (Qi et al. 2024, "Zero Bubble Pipeline Parallelism").
- ``interleaved``: device ``d`` holds chunks ``d, d + p, ...`` of ``v p``; ops ``("F", i, c)``; the bubble shrinks
  ``v`` times for ``v`` times the messages (Narayanan et al. 2021, section 2.2).

``simulate`` plays a schedule with fixed op times and the data dependencies between stages: makespan, bubble (idle
share of all stages' time), micro-batches in flight per stage. ``executor`` runs the same schedules on processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

Op = tuple                            # ("F" | "B" | "W", micro-batch index[, model chunk])
Schedule = list[list[Op]]             # one op list per stage (per device when interleaved)
KINDS = ("gpipe", "1f1b", "zb-h1", "interleaved")


def _check_sizes(num_stages: int, num_microbatches: int, chunks: int = 1, stage: int | None = None) -> None:
    for name, value in (("num_stages", num_stages), ("num_microbatches", num_microbatches), ("chunks", chunks)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer; got {value!r}")
    if stage is not None and not 0 <= stage < num_stages:
        raise ValueError(f"stage must be in [0, {num_stages}); got {stage}")


def gpipe_order(num_stages: int, num_microbatches: int, stage: int) -> list[Op]:
    """GPipe (all-forward-all-backward) order of one stage: F0..F(m-1), then B0..B(m-1)."""
    _check_sizes(num_stages, num_microbatches)
    return [("F", i) for i in range(num_microbatches)] + [("B", i) for i in range(num_microbatches)]


def one_f_one_b_order(num_stages: int, num_microbatches: int, stage: int) -> list[Op]:
    """1F1B order of one stage in three phases (PipeDream-Flush, Narayanan et al. 2021): ``min(p - s - 1, m)``
    warm-up forwards, just enough that its first backward arrives when the pipe is full; then one forward, one
    backward, in turn; then the backwards left. Each backward frees a micro-batch's activations, so at most
    ``p - s`` are alive at once."""
    _check_sizes(num_stages, num_microbatches, stage=stage)
    p, m = num_stages, num_microbatches
    warmup = min(p - stage - 1, m)
    order: list[Op] = [("F", i) for i in range(warmup)]         # warm-up: fill the pipe
    for j in range(m - warmup):                                  # steady: one forward, one backward
        order += [("F", warmup + j), ("B", j)]
    order += [("B", j) for j in range(m - warmup, m)]            # cool-down: drain the pipe
    return order


def zero_bubble_h1_order(num_stages: int, num_microbatches: int, stage: int) -> list[Op]:
    """ZB-H1 order of one stage (Qi et al. 2024): ``B`` (the input gradient, which the stage before waits for) runs
    as in 1F1B; ``W`` (the weight gradient) waits for nobody. Stage ``s`` runs the ``W`` of its ``k``-th backward
    after its ``(k + s)``-th ``B``: later stages keep more ``W`` in reserve, which fills the cool-down exactly when
    ``t_f = t_B = t_W`` (idle time ``(p - 1) t_f`` per stage for ``m >= p``, a third of 1F1B's; the simulator
    checks). Every stage holds ``min(p, m)`` micro-batches (1F1B's first stage's most)."""
    order: list[Op] = []
    backwards: list[int] = []
    for op, i in one_f_one_b_order(num_stages, num_microbatches, stage):
        order.append((op, i))
        if op == "B":
            backwards.append(i)
            if len(backwards) > stage:
                order.append(("W", backwards[-1 - stage]))
    return order + [("W", j) for j in backwards[max(0, len(backwards) - stage):]]   # flush the reserve


def interleaved_order(num_stages: int, num_microbatches: int, stage: int, chunks: int = 2) -> list[Op]:
    """Interleaved 1F1B order of one device holding ``chunks`` model chunks (Narayanan et al. 2021, 2.2).
    Micro-batches go in groups of ``p``: the forwards of one group on chunk 0, then on chunk 1, ..., then the next
    group; backwards the same, chunks in reverse. Device ``d`` runs ``2 (p - d - 1) + (v - 1) p`` warm-up forwards
    (enough to stay busy until its first backward can arrive), then alternates, then drains."""
    _check_sizes(num_stages, num_microbatches, chunks, stage)
    p, m, v = num_stages, num_microbatches, chunks
    if m % p:
        raise ValueError(f"interleaved 1F1B sends micro-batches in groups of p = {p}: use a number of "
                         f"micro-batches that is a multiple of {p} (got {m})")

    def nth(k: int, backward: bool) -> tuple[int, int]:
        """The micro-batch and chunk of this device's k-th forward (or backward)."""
        group, pos = divmod(k, p * v)
        chunk = pos // p
        return group * p + pos % p, (v - 1 - chunk) if backward else chunk

    total = m * v
    # with one chunk this is 1F1B's p - d - 1; with more, each chunk's forward must reach the last device
    warmup = min(total, (p - stage - 1) if v == 1 else 2 * (p - stage - 1) + (v - 1) * p)
    order: list[Op] = [("F", *nth(k, False)) for k in range(warmup)]
    for k in range(total - warmup):
        order += [("F", *nth(warmup + k, False)), ("B", *nth(k, True))]
    order += [("B", *nth(k, True)) for k in range(total - warmup, total)]
    return order


def make_schedule(kind: str, num_stages: int, num_microbatches: int, chunks: int = 2) -> Schedule:
    """The per-stage op lists of a schedule: ``kind`` is ``"gpipe"``, ``"1f1b"``, ``"zb-h1"`` or
    ``"interleaved"`` (then ``chunks`` model chunks per device, and ops ``(op, micro-batch, chunk)``)."""
    if kind not in KINDS:
        raise ValueError(f"unknown schedule kind {kind!r}; choose one of {', '.join(KINDS)}")
    _check_sizes(num_stages, num_microbatches)
    order = {"gpipe": gpipe_order, "1f1b": one_f_one_b_order, "zb-h1": zero_bubble_h1_order,
             "interleaved": lambda p, m, s: interleaved_order(p, m, s, chunks)}[kind]
    return [order(num_stages, num_microbatches, s) for s in range(num_stages)]


def bubble_formula(num_stages: int, num_microbatches: int, chunks: int = 1) -> float:
    """The idle share of a GPipe or 1F1B pipeline with uniform stages: (p - 1) / (m + p - 1); with ``chunks = v``
    per device (interleaved 1F1B) the idle time is ``v`` times shorter: (p - 1) / (v m + p - 1)."""
    _check_sizes(num_stages, num_microbatches, chunks)
    return (num_stages - 1) / (chunks * num_microbatches + num_stages - 1)


def zb_h1_bubble_formula(num_stages: int, num_microbatches: int, t_forward: float = 1.0,
                         t_backward: float = 2.0, t_weight: float | None = None) -> float:
    """ZB-H1's idle share (Qi et al. 2024, section 3; chapter 08's notation): each stage idles
    ``(p - 1)(t_f + t_B - t_W)``, 1F1B ``(p - 1)(t_f + t_B + t_W)``; ``t_B + t_W = t_backward`` (default half each).
    Holds for ``m >= p`` and ``t_W <= t_f`` (the reserve of ``W`` must be there, and fit, to fill the drain)."""
    _check_sizes(num_stages, num_microbatches)
    t_w = t_backward / 2 if t_weight is None else t_weight
    idle = (num_stages - 1) * (t_forward + (t_backward - t_w) - t_w)
    return idle / (idle + num_microbatches * (t_forward + t_backward))


def op_triple(o: Op) -> tuple[str, int, int]:
    """``(op, micro-batch, chunk)`` of any op: plain schedules have one chunk, 0."""
    return (o[0], o[1], o[2] if len(o) == 3 else 0)


def num_chunks(schedule: Schedule) -> int:
    """Model chunks per device: 1, or ``v`` for an interleaved schedule."""
    return 1 + max((op_triple(o)[2] for order in schedule for o in order), default=0)


def frozen_prefix(schedule: Schedule) -> int:
    """How many leading stages run forwards only: a frozen prefix, which needs no backward (``freeze``)."""
    forward_only = [bool(order) and all(o[0] == "F" for o in order) for order in schedule]
    return (forward_only + [False]).index(False)


def check_schedule(schedule: Schedule) -> tuple[int, int, bool]:
    """Check that every stage runs every op exactly once; return ``(p, m, has_w)``. A frozen prefix (its stages
    run forwards only, ``freeze``) is allowed on plain schedules; a ``ValueError`` names what is missing or repeated."""
    if not schedule or not all(isinstance(order, (list, tuple)) for order in schedule):
        raise ValueError("a schedule is a non-empty list with one list of (op, micro-batch) pairs per stage")
    for s, order in enumerate(schedule):
        bad = [o for o in order if not isinstance(o, (list, tuple)) or len(o) not in (2, 3)
               or o[0] not in ("F", "B", "W") or not all(isinstance(x, int) and x >= 0 for x in o[1:])]
        if bad:
            raise ValueError(f"stage {s}: ops must be (op, micro-batch) pairs, or (op, micro-batch, chunk) "
                             f"triples, with op in ('F', 'B', 'W') and integers >= 0; got {bad[:3]}")
    has_w = any(o[0] == "W" for order in schedule for o in order)
    m, v, frozen = 1 + max((o[1] for order in schedule for o in order), default=-1), num_chunks(schedule), \
        frozen_prefix(schedule)
    if frozen and (frozen == len(schedule) or v > 1):
        raise ValueError("a frozen prefix (stages that run forwards only) needs a trainable last stage and "
                         "one model chunk per stage")
    ops = ("F", "B", "W") if has_w else ("F", "B")
    for s, order in enumerate(schedule):
        order = [op_triple(o) for o in order]        # JSON gives lists; compare as tuples
        expected = sorted((op, i, c) for op in (("F",) if s < frozen else ops) for i in range(m) for c in range(v))
        if sorted(order) != expected:
            missing = sorted(set(expected) - set(order))
            repeated = sorted({o for o in order if order.count(o) > 1})
            raise ValueError(f"{'frozen ' if s < frozen else ''}stage {s} must run each of {ops} once for "
                             f"micro-batches 0..{m - 1}{f' and chunks 0..{v - 1}' if v > 1 else ''}; "
                             f"missing {missing[:4]}, repeated {repeated[:4]}")
    return len(schedule), m, has_w


def inflight_counts(order: Sequence[Op]) -> list[int]:
    """Micro-batches (chunks, when interleaved) whose activations one stage holds after each op: a forward stores
    them, its backward frees them (its ``W`` when split: the weight gradient still needs them). A frozen stage
    (forwards only) keeps none: its forwards run without a graph."""
    if order and all(o[0] == "F" for o in order):
        return [0] * len(order)
    release = "W" if any(o[0] == "W" for o in order) else "B"
    counts, alive = [], 0
    for o in order:
        alive += 1 if o[0] == "F" else (-1 if o[0] == release else 0)
        counts.append(alive)
    return counts


@dataclass
class OpTiming:
    """When one op ran on one stage (for Gantt charts)."""

    stage: int
    op: str
    microbatch: int
    start: float
    end: float
    chunk: int = 0


@dataclass
class SimResult:
    """What ``simulate`` measured: time, idle share and memory of one schedule."""

    num_stages: int
    num_microbatches: int
    makespan: float
    bubble_fraction: float            # idle time of all stages / (p * makespan)
    peak_inflight: list[float]        # most micro-batches alive at once, per stage (interleaved: chunks alive / v)
    busy: list[float]                 # time each stage spent computing
    timings: list[OpTiming] = field(repr=False, default_factory=list)


def simulate(schedule: Schedule, t_forward: float = 1.0, t_backward: float = 2.0,
             t_weight: float | None = None, t_comm: float = 0.0) -> SimResult:
    """Play ``schedule`` with fixed op times and return makespan, bubble and in-flight counts. Every op starts as
    soon as its stage is free and its inputs exist: ``F(s, i)`` needs ``F(s-1, i)``; ``B(s, i)`` needs ``B(s+1, i)``
    and ``F(s, i)``; ``W(s, i)`` needs ``B(s, i)``; a message takes ``t_comm``. ``t_backward = 2 t_forward`` is the
    usual estimate (two matmuls per forward matmul); split, ``W`` takes ``t_weight`` (default half: for ``y = x A``,
    ``dy A^T`` and ``x^T dy`` cost the same FLOPs). Times are a whole stage's: an interleaved device's chunk ``c``
    (virtual stage ``c p + d``) takes ``1/v`` of them."""
    p, m, has_w = check_schedule(schedule)
    v = num_chunks(schedule)
    if min(t_forward, t_backward, t_comm) < 0 or t_forward + t_backward <= 0:
        raise ValueError("op times must be non-negative and t_forward + t_backward positive")
    t_w = (t_backward / 2 if t_weight is None else t_weight) if has_w else 0.0
    if not 0 <= t_w <= t_backward:
        raise ValueError(f"t_weight must be within [0, t_backward={t_backward}]; got {t_weight}")
    duration = {"F": t_forward / v, "B": (t_backward - t_w) / v, "W": t_w / v}
    end: dict[tuple[str, int, int], float] = {}     # (op, virtual stage, micro-batch) -> finish time
    clock, nxt, timings = [0.0] * p, [0] * p, []
    last = p * v - 1                                 # the last virtual stage

    def ready_at(op: str, s: int, i: int) -> float | None:
        """When the inputs of ``op`` on virtual stage ``s`` exist; ``None`` if not yet played."""
        deps = {"F": [("F", s - 1, i, t_comm)] if s > 0 else [],
                "B": [("F", s, i, 0.0)] + ([("B", s + 1, i, t_comm)] if s < last else []),
                "W": [("B", s, i, 0.0)]}[op]
        if any(d[:3] not in end for d in deps):
            return None
        return max([0.0] + [end[d[:3]] + d[3] for d in deps])

    progress = True
    while progress:                                  # each sweep plays every op whose inputs exist
        progress = False
        for s in range(p):
            while nxt[s] < len(schedule[s]):
                op, i, c = op_triple(schedule[s][nxt[s]])
                ready = ready_at(op, c * p + s, i)
                if ready is None:
                    break                            # wait for another stage
                start = max(clock[s], ready)
                clock[s] = end[(op, c * p + s, i)] = start + duration[op]
                timings.append(OpTiming(s, op, i, start, clock[s], c))
                nxt[s] += 1
                progress = True
    for s in (s for s in range(p) if nxt[s] < len(schedule[s])):
        raise ValueError(f"the schedule deadlocks: stage {s} waits forever at {schedule[s][nxt[s]]} "
                         "(an op is ordered before an op it depends on)")
    makespan = max(clock)
    busy = [sum(duration[o[0]] for o in order) for order in schedule]
    bubble = 1.0 - sum(busy) / (p * makespan)
    peak = [max(inflight_counts(order)) for order in schedule]
    if v > 1:  # count whole-stage activations: one chunk's are 1/v of a stage's
        peak = [c / v for c in peak]
    return SimResult(p, m, makespan, bubble, peak, busy, sorted(timings, key=lambda t: (t.stage, t.start)))
