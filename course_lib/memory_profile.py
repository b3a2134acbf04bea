"""The profiler's memory timeline, by kind of tensor, beside the course's exact count (chapter 11).

``torch.profiler.profile(profile_memory=True, record_shapes=True, with_stack=True)`` records every allocation
and free with the op that made it. From those records and the autograd graph, the profiler's memory profile
(``torch.profiler._memory_profiler``) files each tensor under one category: parameter, optimizer state, input,
temporary, activation, gradient, autograd detail (autograd's own buffers, such as a gradient on its way), or
unknown. ``export_memory_timeline(path.json)`` writes, for every moment something changed, the bytes alive in
each category (the profiler marks that call deprecated, in favour of the GPU-only ``memory_history``; on a CPU
it is the one there is). ``memory_by_category`` records one step and reads that file back; ``saved_by_kind``
splits what autograd saves into float tensors and the rest (integer ids, boolean masks), which the profiler
files under "input" rather than "activation": no gradient flows through them.

On a GPU, ``cuda_snapshot`` records the CUDA allocator's own history of the step
(``torch.cuda.memory._record_memory_history``) and renders it offline as an HTML page (``torch.cuda._memory_viz``).
"""

from __future__ import annotations

import json
import pickle
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch

from course_lib.trace import profile_steps

# The profiler's categories, in the order of its exported sizes (``_memory_profiler._CATEGORY_TO_INDEX``);
# the exported rows have one leading 0 before them.
CATEGORIES = ("parameter", "optimizer_state", "input", "temporary", "activation", "gradient", "autograd_detail",
              "unknown")


@dataclass
class CategoryTimeline:
    """Bytes alive in each category after every change, over one profiled step."""

    seconds: list[float]                    # since the step's first record
    bytes: dict[str, list[int]]             # category -> bytes alive, one entry per moment in ``seconds``
    phases: dict[str, tuple[float, float]]  # a record_function range -> (start, end), same clock as ``seconds``

    def at(self, t: float) -> dict[str, int]:
        """Bytes per category at time ``t`` (the last change at or before it)."""
        i = max([0] + [k for k, s in enumerate(self.seconds) if s <= t])
        return {c: v[i] for c, v in self.bytes.items()}

    def peak(self, category: str | None = None) -> int:
        """The highest bytes of one category, or of all together (``None``)."""
        if category is not None:
            return max(self.bytes[category])
        return max(sum(v[i] for v in self.bytes.values()) for i in range(len(self.seconds)))


def _phases_ns(prof, names: Iterable[str]) -> dict[str, tuple[int, int]]:
    """The record_function ranges of the profiled step, in the clock the memory records use (nanoseconds)."""
    wanted, out = set(names), {}
    for e in prof.profiler.kineto_results.events():
        if e.name() in wanted:
            out[e.name()] = (e.start_ns(), e.start_ns() + e.duration_ns())
    return out


def memory_by_category(step: Callable[[], object], path: str | Path, device: torch.device | str = "cpu",
                       phases: Sequence[str] = ("forward", "backward", "optimizer")) -> CategoryTimeline:
    """Profile ``step`` (one warm-up, then one recorded call) and return its memory timeline by category.

    Writes the step's Chrome trace to ``path`` (``.json.gz``: with shapes and stacks it is ~10x a plain trace)
    and the category timeline beside it (``<stem>_memory.json``: ``[times in us, [bytes per category]]``).
    Only the device's own allocations count (``device``: "cpu" or "cuda:0").
    """
    path = Path(path)
    memory_json = path.with_name(path.name.split(".")[0] + "_memory.json")
    dev = str(torch.device(device)) if torch.device(device).type == "cpu" else f"cuda:{torch.device(device).index or 0}"
    spans: dict[str, tuple[int, int]] = {}

    def export(prof) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "export_memory_timeline is deprecated": on a CPU it is all there is
            prof.export_memory_timeline(str(memory_json), device=dev)
        spans.update(_phases_ns(prof, phases))

    profile_steps(step, path, device=dev, memory=True, on_ready=export)
    times, sizes = json.loads(memory_json.read_text())
    if not times:
        raise RuntimeError(f"the profiler recorded no allocation on {dev} during the step")
    t0 = min(t for t in times if t > 0) if any(t > 0 for t in times) else 0  # microseconds
    return CategoryTimeline(
        seconds=[(t - t0) / 1e6 for t in times],
        bytes={c: [row[i + 1] for row in sizes] for i, c in enumerate(CATEGORIES)},
        phases={k: ((a / 1e3 - t0) / 1e6, (b / 1e3 - t0) / 1e6) for k, (a, b) in spans.items()})


def saved_by_kind(fn: Callable[[], object], exclude: Iterable[torch.Tensor] = ()) -> dict[str, int]:
    """Bytes autograd saves while ``fn()`` runs, split into ``float`` tensors and ``other`` (ids, masks).

    Counted as ``memory.saved_activation_bytes`` counts (by storage, without ``exclude``'s storages), so the two
    parts add up to it.
    """
    excluded = {t.untyped_storage()._cdata for t in exclude}
    seen: dict[int, tuple[str, int]] = {}
    keep: list[torch.Tensor] = []  # hold each saved tensor so that no storage is freed and its key reused

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage()._cdata
        if key not in excluded:
            seen[key] = ("float" if t.is_floating_point() else "other", t.untyped_storage().nbytes())
            keep.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return {kind: sum(n for k, n in seen.values() if k == kind) for kind in ("float", "other")}


def draw(timeline: CategoryTimeline, exact: dict[str, int], title: str, unit: int = 2**20):
    """The timeline as stacked areas (MiB), the exact count of the same step beside it as one stacked bar."""
    import matplotlib.pyplot as plt

    shown = [c for c in CATEGORIES if max(timeline.bytes[c]) > 0]
    colours = dict(zip(CATEGORIES, ("darkgreen", "goldenrod", "black", "mediumpurple", "red", "mediumblue",
                                    "royalblue", "grey")))
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [4, 1]}, sharey=True)
    ms = [s * 1e3 for s in timeline.seconds]
    ax.stackplot(ms, *[[b / unit for b in timeline.bytes[c]] for c in shown], step="post",
                 labels=[c.replace("_", " ") for c in shown], colors=[colours[c] for c in shown], alpha=0.85)
    for name, (a, b) in timeline.phases.items():
        ax.axvline(a * 1e3, color="black", ls=":", lw=0.8)
        ax.text(a * 1e3, 1.0, f" {name}", transform=ax.get_xaxis_transform(), va="top", fontsize=8)
    ax.set(title=title, xlabel="time in the step (ms, profiled)", ylabel="bytes alive (MiB)")
    ax.grid(alpha=0.3)
    fig.legend(*ax.get_legend_handles_labels(), loc="lower center", ncol=len(shown), fontsize=8,
               bbox_to_anchor=(0.45, -0.08))
    bottom = 0.0  # stacked in the timeline's order; the four parts never all exist at once (see the text)
    parts = {"parameter": "params", "optimizer_state": "optimizer", "activation": "activations", "gradient": "grads"}
    for category, key in parts.items():
        bx.bar(["memory.measure"], [exact[key] / unit], bottom=[bottom], color=colours[category], alpha=0.85)
        bx.text(0, bottom + exact[key] / unit / 2, f"{key} {exact[key] / unit:.2f}", ha="center", va="center",
                fontsize=7, color="white")
        bottom += exact[key] / unit
    bx.set(title="exact count, same step")
    fig.tight_layout()
    return fig


def cuda_snapshot(step: Callable[[], object], out_dir: str | Path, name: str = "step") -> dict[str, object]:
    """GPU only: the CUDA allocator's history over one call of ``step``, saved and rendered offline.

    Writes ``<name>_snapshot.pickle`` (drop it on https://pytorch.org/memory_viz) and ``<name>_snapshot.html``
    (the same viewer, rendered by ``torch.cuda._memory_viz.trace_plot``, with the data inside the page). Returns
    the curve of allocated bytes, from the snapshot's own alloc and free events, and CUDA's peak for the step.
    """
    from torch.cuda._memory_viz import trace_plot

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=100_000, stacks="python")
    try:
        step()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    peak = torch.cuda.max_memory_allocated() - base
    (out / f"{name}_snapshot.pickle").write_bytes(pickle.dumps(snapshot))
    (out / f"{name}_snapshot.html").write_text(trace_plot(snapshot))
    events = snapshot["device_traces"][torch.cuda.current_device()]
    live, curve, times = 0, [], []
    for e in events:
        if e["action"] == "alloc":
            live += e["size"]
        elif e["action"] == "free_completed":
            live -= e["size"]
        else:
            continue
        curve.append(live)
        times.append(e.get("time_us", 0) / 1e6)
    return {"seconds": times, "live_bytes": curve, "peak_bytes": peak, "snapshot_peak": max([0, *curve])}
