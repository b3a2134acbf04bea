"""Profiler traces: record a step, read its Chrome-trace JSON back, measure and draw overlap (chapters 07, 09, 11).

``torch.profiler`` records every op a process runs, with its thread, start and duration, and writes them as a
Chrome-trace JSON file (one per rank), which Perfetto (https://ui.perfetto.dev: "Open trace file") and
``chrome://tracing`` (the "Load" button) draw as one row per thread. The course reads the same file back
(``load_spans``), so its figures are drawn from the trace's own events:

- ``profile_steps`` profiles a few calls of a step with a ``schedule`` (``wait``, ``warmup``, ``active``): the
  warm-up calls run under the profiler but are thrown away, so the recorded step has warm caches, and only
  the active step is written (a step or two keeps a file at ~100 kB);
- ``StepTrace`` is one rank's step: its phases (the ``record_function`` ranges ``forward``, ``backward``, ...),
  the backward's ops, and the collectives with their real durations. On gloo each collective runs on one of
  gloo's worker threads as an event ``gloo:all_reduce`` (or ``gloo:reduce_scatter``...) from when the thread
  starts it to when it is done, partner included; on NCCL it is a GPU kernel named ``nccl...``;
- ``overlap_fraction``: the share of the collectives' time that falls inside the backward (the time a
  collective costs nothing, if the cores or the GPU have room for both), and ``draw_steps`` the picture.
"""

from __future__ import annotations

import gzip
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

from course_lib.memory import _quiet_native_stderr  # the profiler's start and stop lines on fd 2, silenced

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("forward", "backward", "sync", "optimizer")  # the record_function names a profiled step may mark


def traces_dir(chapter: str) -> Path:
    """Where a chapter's trace files go: ``$COURSE_TRACES/<chapter>``, else ``build/traces/<chapter>``."""
    return Path(os.environ.get("COURSE_TRACES", ROOT / "build" / "traces")) / chapter


def profile_steps(step: Callable[[], object], path: str | Path, warmup: int = 1, device: str = "cpu",
                  memory: bool = False, on_ready: Callable[[object], None] | None = None) -> Path:
    """Run ``step`` ``warmup + 1`` times under ``torch.profiler``; write the last one's Chrome trace to ``path``.

    ``memory=True`` also records allocations, shapes and Python stacks (what ``torch.profiler``'s memory
    timeline needs; the file grows about tenfold, so give it a ``.json.gz`` name). ``on_ready(prof)`` is
    called with the profiler while the active step's events are still there (after the schedule's cycle the
    profiler clears them). On CUDA the GPU's kernels are recorded too. The profiler slows each op down by a
    few microseconds: the trace orders and overlaps events truthfully; their durations are a little long.
    """
    import warnings

    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])

    def ready(prof) -> None:
        prof.export_chrome_trace(str(path))  # a name ending in .gz is written gzipped
        if on_ready is not None:
            on_ready(prof)

    with warnings.catch_warnings(), _quiet_native_stderr():
        warnings.simplefilter("ignore")  # "events are cleared at the end of each cycle": what we want here
        with profile(activities=activities, schedule=schedule(wait=0, warmup=warmup, active=1),
                     on_trace_ready=ready, profile_memory=memory, record_shapes=memory, with_stack=memory) as prof:
            for _ in range(warmup + 1):
                step()
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
                prof.step()
    return path


# ----- reading a trace ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Span:
    """One complete event of a trace: an op, a ``record_function`` range, a collective or a kernel."""

    name: str
    cat: str
    tid: int | str
    start: float   # microseconds, on the machine's clock (the same for every process of one machine)
    dur: float     # microseconds

    @property
    def end(self) -> float:
        return self.start + self.dur


def load_spans(path: str | Path) -> list[Span]:
    """The complete events (``"ph": "X"``) of a Chrome-trace JSON file (``.json`` or ``.json.gz``), by start."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    spans = [Span(e["name"], e.get("cat", ""), e.get("tid", 0), float(e["ts"]), float(e.get("dur", 0.0)))
             for e in events if e.get("ph") == "X"]
    return sorted(spans, key=lambda s: s.start)


def union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Overlapping or touching ``(start, end)`` intervals merged: the time at least one of them covers."""
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def covered(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length of the union of ``intervals``."""
    return sum(b - a for a, b in union(intervals))


def overlap(a: Iterable[tuple[float, float]], b: Iterable[tuple[float, float]]) -> float:
    """Length of the time covered by both ``a`` and ``b`` (each a set of intervals, merged first)."""
    ua, ub = union(a), union(b)
    total, j = 0.0, 0
    for s, e in ua:
        while j < len(ub) and ub[j][1] <= s:
            j += 1
        k = j
        while k < len(ub) and ub[k][0] < e:
            total += min(e, ub[k][1]) - max(s, ub[k][0])
            k += 1
    return total


@dataclass(frozen=True)
class Collective:
    """One collective's run: what it was, when this rank asked for it, and when it ran (microseconds)."""

    kind: str       # "all_reduce", "reduce_scatter", "all_gather", "barrier", ...
    queued: float   # when the calling thread handed it over (the c10d op); a kernel's start on a GPU
    start: float    # when gloo's worker thread (or the GPU) began it
    end: float      # when it was done, the partner ranks' part included


_C10D_KIND = {"allreduce_": "all_reduce", "_reduce_scatter_base_": "reduce_scatter",
              "reduce_scatter_tensor_coalesced_": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
              "_allgather_base_": "all_gather", "allgather_": "all_gather", "allgather_into_tensor_coalesced_":
              "all_gather", "broadcast_": "broadcast", "barrier": "barrier", "alltoall_base_": "all_to_all"}


def _kernel_kind(name: str) -> str:
    flat = name.lower().replace("_", "")
    for key, kind in (("allreduce", "all_reduce"), ("reducescatter", "reduce_scatter"), ("allgather", "all_gather"),
                      ("broadcast", "broadcast"), ("sendrecv", "send_recv")):
        if key in flat:
            return kind
    return "nccl"


def collectives(spans: Sequence[Span]) -> list[Collective]:
    """The collectives of one rank's trace, each named by the call that queued it.

    gloo's worker-thread events say only ``gloo:all_reduce`` (gloo runs a reduce-scatter as an all-reduce, for
    one): the calling thread's ``c10d::`` op says what was asked for. gloo runs the work in the order it was
    queued, so the i-th ``c10d::`` op is the i-th ``gloo:`` event. On a GPU the NCCL kernels name themselves.
    """
    kernels = [s for s in spans if s.cat == "kernel" and "nccl" in s.name.lower()]
    if kernels:
        return [Collective(_kernel_kind(k.name), k.start, k.start, k.end) for k in kernels]
    runs = [s for s in spans if s.name.startswith("gloo:")]
    calls = [s for s in spans if s.name.startswith("c10d::") and s.name[6:] in _C10D_KIND]
    if len(calls) != len(runs):  # cannot pair them: name each by gloo's event
        return [Collective(r.name[5:], r.start, r.start, r.end) for r in runs]
    return [Collective(_C10D_KIND[c.name[6:]], c.start, r.start, r.end) for c, r in zip(calls, runs)]


@dataclass
class StepTrace:
    """One rank's profiled step, read from its trace file (``read_step``)."""

    rank: int
    phases: dict[str, tuple[float, float]]                       # record_function name -> (start, end), us
    ops: list[Span] = field(default_factory=list)                 # the backward's ops (autograd nodes, kernels)
    collectives: list[Collective] = field(default_factory=list)   # barriers left out

    @property
    def start(self) -> float:
        return min([a for a, _ in self.phases.values()] + [c.queued for c in self.collectives])

    @property
    def end(self) -> float:
        return max([b for _, b in self.phases.values()] + [c.end for c in self.collectives])

    def of(self, kind: str) -> list[Collective]:
        return [c for c in self.collectives if c.kind == kind]

    def comm_us(self, kind: str) -> float:
        """Microseconds during which at least one collective of ``kind`` ran."""
        return covered((c.start, c.end) for c in self.of(kind))

    def overlap_fraction(self, kind: str, phase: str = "backward") -> float:
        """Share of the ``kind`` collectives' time that falls inside ``phase`` (nan: there were none)."""
        total = self.comm_us(kind)
        if total == 0:
            return float("nan")
        return overlap(((c.start, c.end) for c in self.of(kind)), [self.phases[phase]]) / total

    def queued_in(self, kind: str, phase: str = "backward") -> int:
        """How many ``kind`` collectives this rank queued while ``phase`` ran."""
        a, b = self.phases[phase]
        return sum(a <= c.queued < b for c in self.of(kind))


def read_step(path: str | Path, rank: int, phases: Sequence[str] = PHASES) -> StepTrace:
    """The phases, backward ops and collectives of the one step recorded in ``path``.

    On a GPU the phases are read from the GPU's own copy of each range (``gpu_user_annotation``: from the
    first kernel launched inside it to the last one's end) and the ops are kernels; on the CPU, from the
    ranges on the calling thread, and the ops are autograd's nodes (``autograd::engine::evaluate_function``).
    """
    spans = load_spans(path)
    gpu = any(s.cat == "kernel" for s in spans)
    wanted = "gpu_user_annotation" if gpu else "user_annotation"
    found = {s.name: (s.start, s.end) for s in spans if s.cat == wanted and s.name in phases}
    if "backward" not in found:
        raise ValueError(f"{path}: no 'backward' range; mark the step's parts with record_function({list(phases)})")
    a, b = found["backward"]
    if gpu:
        ops = [s for s in spans if s.cat == "kernel" and "nccl" not in s.name.lower() and a <= s.start < b]
    else:
        ops = [s for s in spans if s.name.startswith("autograd::engine::evaluate_function") and a <= s.start < b]
    return StepTrace(rank, found, ops, [c for c in collectives(spans) if c.kind != "barrier"])


def mean_overlap(ranks: Sequence[StepTrace], kind: str, phase: str = "backward") -> float:
    """The ranks' overlap fractions of ``kind``, weighted by each rank's time in ``kind`` (nan: none ran)."""
    total = sum(r.comm_us(kind) for r in ranks)
    if total == 0:
        return float("nan")
    return sum(r.comm_us(kind) * r.overlap_fraction(kind, phase) for r in ranks) / total


# ----- drawing ------------------------------------------------------------------------------------------------

COLOURS = {"forward": "tab:blue", "backward": "tab:orange", "sync": "tab:red", "optimizer": "tab:green",
           "op": "peru", "all_reduce": "tab:purple", "reduce_scatter": "tab:purple", "all_gather": "tab:cyan"}


def draw_steps(steps: Mapping[str, Sequence[StepTrace]], title: str, kinds: Sequence[str] = ("all_reduce",)):
    """One panel per variant (``{"naive": [rank 0, rank 1], ...}``), on one time axis per panel, in ms.

    Each rank gets two lanes: its step (the phases as long bars, the backward's ops as short ticks above) and
    its collectives of ``kinds`` (one bar each, from when gloo's thread or the GPU began it to its end; a
    thin line before the bar reaches back to when the rank queued it). Time 0 is the earliest event of the
    panel's ranks: the ranks of one machine share a clock, so their rows line up. Each panel's title gives
    the share of the first kind's time inside the backward (``mean_overlap``).
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig, axes = plt.subplots(len(steps), 1, figsize=(10, 0.9 + 1.25 * sum(len(v) for v in steps.values())),
                             squeeze=False)
    for ax, (variant, ranks) in zip(axes[:, 0], steps.items()):
        t0 = min(r.start for r in ranks)
        labels = []
        for i, r in enumerate(ranks):
            y = 2 * i
            for name, (a, b) in r.phases.items():
                ax.broken_barh([((a - t0) / 1e3, (b - a) / 1e3)], (y - 0.35, 0.5),
                               facecolors=COLOURS.get(name, "tab:gray"), alpha=0.8)
            ax.broken_barh([((s.start - t0) / 1e3, s.dur / 1e3) for s in r.ops], (y + 0.2, 0.2),
                           facecolors=COLOURS["op"], edgecolor="black", linewidth=0.3)
            for c in r.collectives:
                if c.kind not in kinds:
                    continue
                ax.broken_barh([((c.start - t0) / 1e3, (c.end - c.start) / 1e3)], (y + 0.65, 0.6),
                               facecolors=COLOURS.get(c.kind, "tab:gray"), edgecolor="white", linewidth=0.5)
                ax.plot([(c.queued - t0) / 1e3, (c.start - t0) / 1e3], [y + 0.95] * 2, color="black", lw=0.8)
            labels += [(y, f"rank {r.rank} step"), (y + 0.95, f"rank {r.rank} collectives")]
        frac = mean_overlap(ranks, kinds[0])
        ax.set_yticks([y for y, _ in labels], [text for _, text in labels], fontsize=8)
        ax.set_ylim(2 * len(ranks) - 0.4, -0.6)
        ax.set_title(f"{variant}: {frac:.0%} of the {kinds[0].replace('_', '-')} time inside the backward",
                     fontsize=10)
        ax.grid(alpha=0.3, axis="x")
    axes[-1, 0].set_xlabel("time since the first rank's step began (ms, profiled)")
    drawn = {k for v in steps.values() for r in v for k in r.phases}
    handles = [Patch(color=COLOURS[k], label=k) for k in PHASES if k in drawn]
    handles += [Patch(color=COLOURS["op"], label="backward op")]
    handles += [Patch(color=COLOURS.get(k, "tab:gray"), label=k.replace("_", "-")) for k in kinds]
    handles += [Patch(facecolor="none", edgecolor="none", label="line: queued, waiting")]
    fig.legend(handles=handles, loc="upper center", ncol=len(handles), fontsize=8, bbox_to_anchor=(0.5, 1.02))
    fig.suptitle(title, y=1.06)
    fig.tight_layout()
    return fig
