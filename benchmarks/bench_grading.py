"""Grading a class: 30 submissions of chapter 03's exercise with ``-j 2`` (``course grade FOLDER -j 2``).

Ten solutions, ten untouched exercises and ten with one wrong answer, each in
its own sandboxed kernel. The figures: the wall time of the whole class and
per notebook, and the machine's load average over the last minute before
and after (a shared machine's load stretches the wall time; the kernels run
under their own user ids in their own namespaces, where the grader's CPU
clock does not follow them). The goal is what a class of 30 may take on two
cores.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import adversarial  # noqa: E402  (writes submissions from the exercise)

STEM = "03_gradient_accumulation"
STUDENTS = 30
JOBS = 2


def _class(folder: Path) -> None:
    """A third right, a third untouched, a third right but for question 1."""
    solution = _solution_cells()
    wrong = {**solution, "q1_plan_micro_batches": "def plan_micro_batches(batch_size, max_micro_batch):\n"
                                                  "    return [max_micro_batch] * (batch_size // max_micro_batch)"}
    for i in range(STUDENTS):
        cells = (solution, {}, wrong)[i % 3]
        adversarial.Attack(f"student{i:02d}", STEM, honest=0, what="", cells=cells).write(folder)


def _solution_cells() -> dict[str, str]:
    import nbformat

    nb = nbformat.read(ROOT / "solutions" / f"{STEM}.ipynb", as_version=4)
    return {c.metadata["nbgrader"]["grade_id"]: adversarial.solution_source(STEM, c.metadata["nbgrader"]["grade_id"])
            for c in nb.cells if c.metadata.get("nbgrader", {}).get("solution")}


def run() -> dict[str, dict]:
    from course_lib.tools.grading import classroom, isolation

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "class"
        _class(folder)
        load_before = os.getloadavg()[0]
        start = time.perf_counter()
        subs = classroom.grade_folder(folder, jobs=JOBS)
        wall = time.perf_counter() - start
        load_after = os.getloadavg()[0]
    graded = [s for s in subs if s.result is not None]
    scores = sorted({s.result.score for s in graded})
    print(f"[bench] grading: {len(graded)}/{len(subs)} graded, scores {scores}, isolation {isolation.detect()}, "
          f"{wall:.0f} s wall, load {load_before:.1f} -> {load_after:.1f}", file=sys.stderr)
    return {
        f"grading_{STUDENTS}_submissions_j{JOBS}_seconds": {"value": wall, "goal": "<= 300"},
        "grading_seconds_per_notebook": {"value": wall / STUDENTS, "goal": None},
        "grading_load_average_before": {"value": load_before, "goal": None},
        "grading_load_average_after": {"value": load_after, "goal": None},
        "grading_notebooks_graded": {"value": len(graded), "goal": f">= {STUDENTS}"},
    }
