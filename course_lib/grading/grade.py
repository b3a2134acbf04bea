"""Grade a learner's notebook against the instructor's tests (``course grade`` and ``course check``).

The learner's copy is never trusted for its tests. The notebook that runs is
built from the learner's cells, except that:

- every cell that carries one of the exercise's test ids gets the instructor's
  source (hidden tests included when grading); a second copy of it is dropped;
- a test cell the learner deleted is put back after its solution cell;
- a cell that claims to be a graded test with an id the exercise does not
  have is dropped (it could only mislead);
- points always come from the instructor's notebook.

A question owns the cells from just after the previous test cell up to its own
test cell. It scores its points only when all of them ran without an error, a
timeout or a dead kernel.
"""

from __future__ import annotations

import copy
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import nbformat
from nbformat import NotebookNode

from course_lib.grading.exercise import (
    BEGIN_HIDDEN, END_HIDDEN, Exercise, Question, find_exercise, grade_id, is_test_cell, read_notebook,
)
from course_lib.grading.execute import CellRun, run_notebook

STATUSES = ("passed", "failed", "error", "timeout")
_CELL_LINE = re.compile(r"Cell In\[\d+\], line (\d+)")
_MAX_MESSAGE = 400  # characters; a long traceback belongs in the notebook, not the report


@dataclass
class QuestionResult:
    """One question's outcome; ``status`` is one of ``STATUSES``."""

    name: str
    score: float
    max_score: float
    status: str
    message: str = ""


@dataclass
class GradeResult:
    """The grade of one notebook."""

    notebook: str
    exercise: str
    questions: list[QuestionResult] = field(default_factory=list)

    @property
    def score(self) -> float:
        return sum(q.score for q in self.questions)

    @property
    def max_score(self) -> float:
        return sum(q.max_score for q in self.questions)

    def as_dict(self) -> dict:
        """The ``--json`` form: notebook, score, max_score, questions."""
        return {"notebook": self.notebook, "score": self.score, "max_score": self.max_score,
                "questions": [asdict(q) for q in self.questions]}


def points_text(x: float) -> str:
    """Points as people write them: ``3``, ``2.5``."""
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def build_run_notebook(learner: NotebookNode, ex: Exercise,
                       tests: dict[str, str]) -> tuple[NotebookNode, list[str], dict[str, int]]:
    """The notebook to execute, a label per cell for messages, and where each question's test sits."""
    nb = nbformat.v4.new_notebook(metadata=copy.deepcopy(learner.metadata))
    labels: list[str] = []
    test_at: dict[str, int] = {}
    for i, cell in enumerate(learner.cells):
        gid = grade_id(cell)
        if gid in tests:
            if gid in test_at:
                continue  # a duplicated test cell would run the test twice
            cell = _test_cell(ex.question(gid), tests[gid])
            test_at[gid] = len(nb.cells)
        elif is_test_cell(cell):
            continue  # a "test" this exercise does not have
        else:
            cell = copy.deepcopy(cell)
            if cell.cell_type == "code":
                cell.outputs, cell.execution_count = [], None
        nb.cells.append(cell)
        labels.append(_label(i, cell))
    for q in ex.questions:
        if q.name not in test_at:
            at = _insert_position(nb, q, ex, test_at)
            nb.cells.insert(at, _test_cell(q, tests[q.name]))
            labels.insert(at, "the test cell")
            test_at = {k: (v + 1 if v >= at else v) for k, v in test_at.items()}
            test_at[q.name] = at
    # cells after the last test belong to no question: running them could only cost time
    last = max(test_at.values())
    del nb.cells[last + 1:], labels[last + 1:]
    for name, at in test_at.items():
        if labels[at] != "the test cell":
            labels[at] = f"the test ({labels[at]})"
    return nb, labels, test_at


def _label(index: int, cell: NotebookNode) -> str:
    """How a message names a learner's cell: Jupyter shows no numbers, so quote its first line too."""
    first = next((line.strip() for line in cell.source.splitlines() if line.strip()), "")
    return f"cell {index + 1} ({first[:40] + '...' if len(first) > 40 else first!s})" if first else f"cell {index + 1}"


def _test_cell(q: Question, source: str) -> NotebookNode:
    cell = nbformat.v4.new_code_cell(source)
    cell.metadata["nbgrader"] = {"grade": True, "solution": False, "locked": True, "points": q.points,
                                 "grade_id": q.name, "schema_version": 3}
    return cell


def _insert_position(nb: NotebookNode, q: Question, ex: Exercise, test_at: dict[str, int]) -> int:
    """Just after the question's solution cell, else after the previous question's test, else at the end."""
    for i, cell in enumerate(nb.cells):
        if q.solution_id and grade_id(cell) == q.solution_id:
            return i + 1
    before = [p.name for p in ex.questions[: ex.questions.index(q)] if p.name in test_at]
    return test_at[before[-1]] + 1 if before else len(nb.cells)


def _hidden_lines(source: str) -> set[int]:
    """1-based line numbers inside the hidden-test regions of a test cell."""
    hidden, inside = set(), False
    for n, line in enumerate(source.splitlines(), start=1):
        if BEGIN_HIDDEN in line:
            inside = True
        elif END_HIDDEN in line:
            inside = False
        elif inside:
            hidden.add(n)
    return hidden


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _MAX_MESSAGE else text[: _MAX_MESSAGE - 3] + "..."


def _judge(q: Question, cells: list[int], test: int, nb: NotebookNode, labels: list[str],
           runs: list[CellRun]) -> QuestionResult:
    """The first thing that went wrong in a question's cells decides its status."""
    def result(status: str, message: str) -> QuestionResult:
        return QuestionResult(q.name, q.points if status == "passed" else 0, q.points, status, _short(message))

    for i in cells:
        run, label = runs[i], labels[i]
        if run.status == "not_run":
            where = f", in {labels[run.cause]}" if run.cause is not None else ""
            return result("timeout" if "overall limit" in run.evalue else "error", f"not run: {run.evalue}{where}")
        if run.status == "timeout":
            what = "the test" if i == test else label
            return result("timeout", f"{what} {run.evalue} (an endless loop, or too slow?)")
        if run.status == "dead":
            return result("error", f"the kernel died while running {label} (os._exit, a crash, or out of memory); "
                                   "nothing after it can pass")
        if run.status == "error" and i != test:
            return result("error", f"{label} raised {run.ename}: {run.evalue}; "
                                   "every cell of a question must run without an error")
    run = runs[test]
    if run.status != "error":
        return result("passed", "")
    if run.ename == "NotImplementedError":
        return result("error", f"not implemented yet: {run.evalue}")
    if run.ename == "AssertionError":
        m = _CELL_LINE.search(run.traceback)
        kind = "a hidden test" if m and int(m[1]) in _hidden_lines(nb.cells[test].source) else "a test"
        return result("failed", f"{kind} failed: {run.evalue or 'an assert is false'}")
    return result("error", f"the test raised {run.ename}: {run.evalue}")


def score(ex: Exercise, nb: NotebookNode, labels: list[str], test_at: dict[str, int],
          runs: list[CellRun]) -> list[QuestionResult]:
    """One result per question, in the exercise's order."""
    owner: dict[int, list[int]] = {}
    start = 0
    for at in sorted(test_at.values()):
        owner[at] = [i for i in range(start, at + 1) if nb.cells[i].cell_type == "code"]
        start = at + 1
    return [_judge(q, owner[test_at[q.name]], test_at[q.name], nb, labels, runs) for q in ex.questions]


def grade_notebook(path: Path | str, timeout: int = 60, solutions: Path | str | None = None,
                   hidden: bool = True, total_timeout: float | None = None) -> GradeResult:
    """Grade one learner notebook; ``hidden=False`` runs only the visible tests (``course check``)."""
    path = Path(path)
    learner = read_notebook(path)
    ex = find_exercise(learner, path, solutions)
    if hidden:
        tests = {q.name: q.test_source for q in ex.questions}
    else:
        from course_lib.grading.assign import make_exercise

        public = make_exercise(ex.notebook, ex.name)
        tests = {grade_id(c): c.source for c in public.cells if is_test_cell(c)}
    nb, labels, test_at = build_run_notebook(learner, ex, tests)
    runs = run_notebook(nb, cwd=path.resolve().parent, timeout=timeout, total_timeout=total_timeout)
    return GradeResult(notebook=str(path), exercise=ex.name, questions=score(ex, nb, labels, test_at, runs))
