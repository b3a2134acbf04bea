"""Run ``benchmarks/`` and print one table of ratios (``course bench``).

Each ``benchmarks/bench_*.py`` defines ``run() -> dict[name, {"value", "goal"}]``
where ``goal`` is a string like ``"<= 1.2"`` (or ``None`` for a plain figure).
All are measured in the same process, one after the other, so their ratios
compare like with like on whatever machine runs them.
"""

from __future__ import annotations

import importlib.util
import operator
import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks"
_OPS = {"<=": operator.le, ">=": operator.ge, "<": operator.lt, ">": operator.gt}


def meets(value: float, goal: str | None) -> bool | None:
    """Whether ``value`` meets a goal such as ``"<= 1.2"``; ``None`` when there is no goal."""
    if not goal:
        return None
    op, bound = goal.split()
    return _OPS[op](value, float(bound))


def run_all(only: list[str] | None = None) -> dict[str, dict]:
    """Import and run every benchmark module (or those named in ``only``)."""
    table: dict[str, dict] = {}
    for path in sorted(BENCH_DIR.glob("bench_*.py")):
        if only and path.stem not in only and path.stem.removeprefix("bench_") not in only:
            continue
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)  # type: ignore[union-attr]
        start = time.perf_counter()
        for name, entry in module.run().items():
            table[name] = {"value": entry["value"], "goal": entry.get("goal")}
        print(f"[bench] {path.stem}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    return table


def format_table(table: dict[str, dict]) -> str:
    """A fixed-width table: name, value, goal, met."""
    rows = [("benchmark", "value", "goal", "met")]
    for name, e in table.items():
        ok = meets(e["value"], e["goal"])
        rows.append((name, f"{e['value']:.3f}" if isinstance(e["value"], float) else str(e["value"]),
                     e["goal"] or "-", "-" if ok is None else ("yes" if ok else "NO")))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows)
