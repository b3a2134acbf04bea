"""The course's plots (every chapter).

Each function draws on a new figure, labels its axes with units, and returns
the figure. ``save`` writes it where the runner collects figures for the
report (``$COURSE_FIGURES``, else ``build/figures``) and returns nothing.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import Patch


def figures_dir() -> Path:
    return Path(os.environ.get("COURSE_FIGURES", Path("build") / "figures"))


def save(fig: Figure, name: str) -> None:
    """Save ``fig`` as ``<figures dir>/<name>.png``, where the runner's report finds it.

    It returns nothing, so that as a cell's last line it leaves no ``PosixPath(...)``
    under the figure (Jupyter shows the figure itself once, at the end of the cell).
    """
    path = figures_dir() / f"{name}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")


def curves(series: Mapping[str, tuple[Sequence[float], Sequence[float]]], title: str, xlabel: str, ylabel: str,
           logx: bool = False, logy: bool = False, marker: str = "o") -> Figure:
    """Several labelled ``(x, y)`` curves on one axis."""
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for label, (x, y) in series.items():
        ax.plot(x, y, marker=marker, label=label)
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(alpha=0.3)
    if len(series) > 1:
        ax.legend()
    fig.tight_layout()
    return fig


def stacked_bars(parts: Mapping[str, Mapping[str, float]], title: str, ylabel: str) -> Figure:
    """One stacked bar per configuration: ``{config: {part: value}}`` (e.g. params/grads/optimizer/activations).

    ``ylabel`` names the unit, and it must match the divisor: "MiB" for 2**20 bytes, "MB" for 1e6.
    """
    fig, ax = plt.subplots(figsize=(6, 3.8))
    configs = list(parts)
    names = list(dict.fromkeys(k for p in parts.values() for k in p))
    bottom = [0.0] * len(configs)
    for name in names:
        values = [parts[c].get(name, 0.0) for c in configs]
        ax.bar(configs, values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set(title=title, ylabel=ylabel)
    ax.legend()
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return fig


def gantt(timings: Sequence, num_stages: int, title: str, time_unit: str = "time units",
          colors: Mapping[str, str] | None = None, row_label: str | None = None,
          notes: Sequence[str] = ()) -> Figure:
    """A pipeline Gantt chart: one row per stage (stage 0 on top), one bar per op, its micro-batch written in it.

    ``timings`` holds objects with ``stage, op, microbatch, start, end`` (and ``chunk``)
    attributes (``pipeline.OpTiming``) or tuples in that order; ``op`` is ``"F"``,
    ``"B"`` or ``"W"``. In an interleaved schedule a bar reads ``3b``: micro-batch 3 on
    the device's second model chunk, drawn lighter. The legend names every colour and
    shade drawn, what the bars' labels mean, and any ``notes``. ``row_label`` names a
    row (default ``"stage"``, or ``"device"`` when a row holds several chunks). White
    space between bars is the bubble (chapter 08).
    """
    colors = dict(colors or {"F": "tab:blue", "B": "tab:orange", "W": "tab:green"})
    rows = [(t.stage, t.op, t.microbatch, t.start, t.end, getattr(t, "chunk", 0)) if hasattr(t, "stage")
            else (*tuple(t), 0)[:6] for t in timings]
    chunks = 1 + max((r[5] for r in rows), default=0)
    split = any(r[1] == "W" for r in rows)
    names = {"F": "forward (F)", "B": "input gradient (B)" if split else "backward (B)",
             "W": "weight gradient (W)"}

    def shade(chunk: int) -> float:                  # chunk 0 full colour, the last one lightest
        return 1.0 - 0.45 * chunk / max(chunks - 1, 1)

    fig, ax = plt.subplots(figsize=(11.5, 0.5 * num_stages + 1.6))  # room for the legend beside the chart
    for stage, op, mb, start, end, chunk in rows:
        ax.broken_barh([(start, end - start)], (stage - 0.4, 0.8), facecolors=colors.get(op, "tab:gray"),
                       alpha=shade(chunk), edgecolor="white", linewidth=0.5)
        if end - start > 0:
            label = f"{mb}{'abcdefgh'[chunk % 8]}" if chunks > 1 else str(mb)
            ax.text((start + end) / 2, stage, label, ha="center", va="center", fontsize=7, color="white")
    # one swatch per (op, chunk) drawn, in the order F, B, W and chunk a, b, ...
    drawn = {(r[1], r[5]) for r in rows}
    order = [o for o in ("F", "B", "W") if any(d[0] == o for d in drawn)]
    order += sorted({d[0] for d in drawn} - set(order))
    handles = [Patch(facecolor=colors.get(op, "tab:gray"), alpha=shade(c),
                     label=names.get(op, op) + (f", chunk {'abcdefgh'[c % 8]}" if chunks > 1 else ""))
               for op in order for c in range(chunks) if (op, c) in drawn]
    key = "number in a bar: micro-batch" + (", letter: the device's chunk" if chunks > 1 else "")
    handles += [Patch(facecolor="none", edgecolor="none", label=text) for text in (key, *notes)]
    row = row_label or ("device" if chunks > 1 else "stage")
    ax.set_yticks(range(num_stages), [f"{row} {s}" for s in range(num_stages)])
    ax.set_ylim(num_stages - 0.5, -0.5)  # stage 0 on top, as data flows down the page
    ylabel = {"stage": "pipeline stage", "device": f"device ({chunks} model chunks each)" if chunks > 1
              else "device"}.get(row, row)
    ax.set(title=title, xlabel=f"time ({time_unit})", ylabel=ylabel)
    ax.grid(alpha=0.3, axis="x")
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    return fig
