"""Each notebook's time at the ``cpu`` profile against its budget (``env.BUDGET_S``: 3 minutes a notebook, 20 for
the course), with the CPU's capability and bf16 speed beside the times (``env.cpu_speed``).

The budgets hold on two idle CPU cores (a laptop), with native bf16 or without. Run it there:

    .venv/bin/course bench --only notebooks          # every notebook, in `course bench`'s table
    .venv/bin/python benchmarks/bench_notebooks.py 02 04    # some, with `course run`'s time table

Set ``BENCH_NOTEBOOKS_PROFILE=smoke`` for the CI profile (about a minute each, budget 90 s). Each row also
gives the CPU time of the notebook's kernel and its processes: on a busy machine the wall time says little,
while the CPU time, with the processes a notebook runs at once, says what two idle cores would take.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from course_lib import env  # noqa: E402
from course_lib.tools import runner  # noqa: E402

BUDGET_S = env.BUDGET_S  # (a notebook, the whole course) in seconds, per profile


def measure(names: list[str] | None = None, profile: str | None = None) -> list[dict]:
    """``course run``'s summary of each chosen notebook (all by default) at ``profile`` (default: cpu)."""
    profile = profile or os.environ.get("BENCH_NOTEBOOKS_PROFILE", "cpu")
    with tempfile.TemporaryDirectory() as tmp:
        return [runner.execute(nb, profile, Path(tmp), progress=sys.stderr) for nb in runner.find_notebooks(names)]


def run() -> dict[str, dict]:
    """For ``course bench``: wall and CPU seconds of every notebook, the wall time against its budget."""
    profile = os.environ.get("BENCH_NOTEBOOKS_PROFILE", "cpu")
    one, total = BUDGET_S[profile]
    cpu = env.cpu_speed()
    out: dict[str, dict] = {"cpu_capability": {"value": cpu.capability, "goal": None},
                            "cpu_bf16_over_fp32_matmul_time": {"value": cpu.bf16_over_fp32, "goal": None}}
    runs = measure(profile=profile)
    for r in runs:
        stem = Path(r["notebook"]).stem
        out[f"{profile}_seconds_{stem}"] = {"value": float("nan") if r["error"] else r["seconds"], "goal": f"<= {one:g}"}
        out[f"{profile}_cpu_seconds_{stem}"] = {"value": r["cpu_seconds"], "goal": None}
    out[f"{profile}_seconds_all"] = {"value": sum(r["seconds"] for r in runs), "goal": f"<= {total:g}"}
    out[f"{profile}_cpu_seconds_all"] = {"value": sum(r["cpu_seconds"] for r in runs), "goal": None}
    return out


if __name__ == "__main__":
    chosen = sys.argv[1:] or None
    profile = os.environ.get("BENCH_NOTEBOOKS_PROFILE", "cpu")
    print(runner.processes_note(profile))
    print(runner.cpu_note())
    note = runner.busy_note()
    if note:
        print(note)
    results = measure(chosen, profile)
    print(runner.summary(results, profile))
    one, total = BUDGET_S[profile]
    wall = sum(r["seconds"] for r in results)
    print(f"[course] budget: {runner.duration(one)} a notebook, {runner.duration(total)} for the course; "
          f"{sum(r['seconds'] > one for r in results)} notebook(s) over, the total {runner.duration(wall)}"
          + (" (over)" if wall > total and not chosen else ""))
