"""The notebook a learner's kernel runs: the learner's cells, with the instructor's tests in place of theirs.

In place of every test cell (the learner's copy is never used; a deleted one
is put back after its solution cell; a made-up one is dropped) runs a
*producer*: the instructor's inputs and answers sections of that test
(hidden ones too when grading), ending with ``wire.dump(got, ...)``. A
question owns the cells from just after the previous test cell up to its own
test cell. A message names a learner's cell as Jupyter numbers it, counting
code cells only, and by its first line.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass

import nbformat
from nbformat import NotebookNode

from course_lib.tools.grading.checker import reseed_source
from course_lib.tools.grading.exercise import Exercise, Question, grade_id, is_test_cell

TEST_LABEL = "the test cell"
_IMPORT = re.compile(r"^(?:import|from\s+\S+\s+import)\s", re.M)  # at the top level



@dataclass
class Producer:
    """The source that replaces a test cell in the kernel, and which part each of its lines comes from."""

    source: str
    lines: dict[int, str]   # line number -> "visible" or "hidden"


def producer(q: Question, hidden: bool, answers_path: str, torch_too: bool) -> Producer:
    """Inputs and answers of ``q`` (the hidden ones when ``hidden``), then ``got`` saved to ``answers_path``."""
    out: list[str] = [reseed_source(torch_too), "from course_lib.tools.grading.checks import raised"]
    lines: dict[int, str] = {}
    parts = [("visible", q.visible)] + ([("hidden", q.hidden)] if hidden and q.hidden is not None else [])
    for kind, part in parts:
        if kind == "hidden":
            out.append(reseed_source(torch_too))
        for section in (part.inputs, part.answers):
            for line in section.source.splitlines():
                out.append(line)
                lines[len(out)] = kind
    out.append(f"from course_lib.tools.grading.wire import dump as _course_dump; _course_dump(got, {answers_path!r})")
    return Producer("\n".join(out), lines)


def build_run_notebook(learner: NotebookNode, ex: Exercise,
                       tests: dict[str, str]) -> tuple[NotebookNode, list[str], dict[str, int]]:
    """The notebook to execute, a label per cell for messages, and where each question's test sits."""
    nb = nbformat.v4.new_notebook(metadata=copy.deepcopy(learner.metadata))
    labels: list[str] = []
    test_at: dict[str, int] = {}
    number = 0  # Jupyter's count: code cells only
    for cell in learner.cells:
        number += cell.get("cell_type") == "code"
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
        labels.append(_label(number, cell))
    for q in ex.questions:
        if q.name not in test_at:
            at = _insert_position(nb, q, ex, test_at)
            nb.cells.insert(at, _test_cell(q, tests[q.name]))
            labels.insert(at, TEST_LABEL)
            test_at = {k: (v + 1 if v >= at else v) for k, v in test_at.items()}
            test_at[q.name] = at
    # cells after the last test belong to no question: running them could only cost time
    last = max(test_at.values())
    del nb.cells[last + 1:], labels[last + 1:]
    for at in test_at.values():
        labels[at] = TEST_LABEL
    return nb, labels, test_at


def _label(number: int, cell: NotebookNode) -> str:
    """How a message names a learner's cell: ``code cell N`` (the ``N``-th code cell, as a run from the top
    numbers it) and its first line; a plain cell that imports is ``your imports cell``."""
    if cell.get("cell_type") != "code":
        return "a markdown cell"
    first = next((line.strip() for line in cell.source.splitlines() if line.strip()), "")
    where = f"code cell {number}" + (f" ({first[:40] + '...' if len(first) > 40 else first})" if first else "")
    return f"your imports cell, {where}" if is_imports_cell(cell) else where


def is_imports_cell(cell: NotebookNode) -> bool:
    """Whether ``cell`` is a plain code cell (neither a solution nor a test) with an import statement."""
    return cell.get("cell_type") == "code" and not grade_id(cell) and bool(_IMPORT.search(cell.source))


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


def owned_cells(nb: NotebookNode, test_at: dict[str, int]) -> dict[int, list[int]]:
    """Test cell position -> the code cells of its question (from after the previous test up to it)."""
    owner: dict[int, list[int]] = {}
    start = 0
    for at in sorted(test_at.values()):
        owner[at] = [i for i in range(start, at + 1) if nb.cells[i].cell_type == "code"]
        start = at + 1
    return owner
