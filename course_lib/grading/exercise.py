"""What an exercise is: the questions of a ``solutions/`` notebook, and finding them for a learner's copy.

The authoring convention (nbgrader's cell metadata, so nbgrader can grade the
same files):

- a *solution cell* has ``{"solution": true, "grade": false, "grade_id": "qN_<name>"}``
  and holds a typed function whose body sits between ``### BEGIN SOLUTION``
  and ``### END SOLUTION``; the first line inside may be ``# HINT: <sentence>``;
- the *test cell* right after it has ``{"grade": true, "solution": false,
  "points": P, "grade_id": "qN_<name>_test"}``: visible asserts, then hidden
  ones between ``### BEGIN HIDDEN TESTS`` and ``### END HIDDEN TESTS``.

A question is named by its test cell's ``grade_id`` and owns the cells after
the previous test cell, up to and including its own.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
from nbformat import NotebookNode

ROOT = Path(__file__).resolve().parents[2]
BEGIN_SOLUTION, END_SOLUTION = "BEGIN SOLUTION", "END SOLUTION"
BEGIN_HIDDEN, END_HIDDEN = "BEGIN HIDDEN TESTS", "END HIDDEN TESTS"
HINT = re.compile(r"^\s*#\s*HINT:\s*(?P<hint>.+?)\s*$")
META_KEY = "course"  # notebook metadata the generated exercises carry: {"exercise": "<stem>"}


class GradingError(ValueError):
    """A notebook cannot be graded (not JSON, not a notebook, not an exercise of this course)."""


@dataclass(frozen=True)
class Question:
    """One graded question: its test cell and the solution cell it checks."""

    name: str                 # the test cell's grade_id, e.g. "q1_param_bytes_test"
    points: float
    test_source: str          # the instructor's test cell, hidden tests included
    solution_id: str | None   # grade_id of the solution cell before it, if any
    hint: str | None          # the solution's "# HINT:" line, if any

    @property
    def is_implementation(self) -> bool:
        """Whether the learner writes code for it (a solution cell belongs to it)."""
        return self.solution_id is not None


@dataclass
class Exercise:
    """A ``solutions/`` notebook and its questions, in notebook order."""

    name: str
    path: Path
    notebook: NotebookNode
    questions: list[Question] = field(default_factory=list)

    @property
    def max_score(self) -> float:
        return sum(q.points for q in self.questions)

    def question(self, name: str) -> Question:
        return next(q for q in self.questions if q.name == name)

    def cell_ids(self) -> set[str]:
        """Every nbgrader grade_id in the notebook (solution and test cells)."""
        return {i for i in (grade_id(c) for c in self.notebook.cells) if i}


def nbgrader_meta(cell: NotebookNode) -> dict:
    meta = cell.get("metadata", {}).get("nbgrader", {})
    return meta if isinstance(meta, dict) else {}


def grade_id(cell: NotebookNode) -> str | None:
    return nbgrader_meta(cell).get("grade_id") or None


def is_test_cell(cell: NotebookNode) -> bool:
    meta = nbgrader_meta(cell)
    return cell.get("cell_type") == "code" and bool(meta.get("grade")) and not meta.get("solution")


def is_solution_cell(cell: NotebookNode) -> bool:
    return cell.get("cell_type") == "code" and bool(nbgrader_meta(cell).get("solution"))


def region_lines(source: str, begin: str, end: str) -> list[list[str]]:
    """The lines inside each ``begin``/``end`` region of ``source`` (markers excluded)."""
    regions: list[list[str]] = []
    current: list[str] | None = None
    for line in source.splitlines():
        if begin in line:
            current = []
        elif end in line and current is not None:
            regions.append(current)
            current = None
        elif current is not None:
            current.append(line)
    return regions


def hints(source: str) -> list[str | None]:
    """The ``# HINT:`` sentence of each solution region (``None`` where the first line is not a hint)."""
    out: list[str | None] = []
    for lines in region_lines(source, BEGIN_SOLUTION, END_SOLUTION):
        first = next((l for l in lines if l.strip()), "")
        m = HINT.match(first)
        out.append(m["hint"] if m else None)
    return out


def _check_regions(source: str, begin: str, end: str, where: str) -> None:
    depth = 0
    for line in source.splitlines():
        if begin in line:
            depth += 1
        elif end in line:
            depth -= 1
        if depth not in (0, 1):
            raise GradingError(f"{where}: '{begin}' and '{end}' are unbalanced or nested")
    if depth:
        raise GradingError(f"{where}: '{begin}' has no matching '{end}'")


def parse_exercise(nb: NotebookNode, path: Path) -> Exercise:
    """Read the questions of a solutions notebook; raise ``GradingError`` where it breaks the convention."""
    ex = Exercise(name=path.stem, path=path, notebook=nb)
    seen: set[str] = set()
    last_solution: NotebookNode | None = None
    for i, cell in enumerate(nb.cells):
        where = f"{path.name}, cell {i + 1}"
        source = cell.get("source", "")
        _check_regions(source, BEGIN_SOLUTION, END_SOLUTION, where)
        _check_regions(source, BEGIN_HIDDEN, END_HIDDEN, where)
        gid = grade_id(cell)
        if gid:
            if gid in seen:
                raise GradingError(f"{where}: grade_id {gid!r} is used twice; each cell needs its own")
            seen.add(gid)
        if BEGIN_SOLUTION in source and not is_solution_cell(cell):
            raise GradingError(f"{where}: a solution region outside a solution cell; add nbgrader metadata "
                               '{"solution": true, "grade": false, "grade_id": "qN_<name>"}')
        if BEGIN_HIDDEN in source and not is_test_cell(cell):
            raise GradingError(f"{where}: hidden tests outside a graded test cell")
        if is_solution_cell(cell):
            if not gid:
                raise GradingError(f"{where}: the solution cell has no grade_id")
            last_solution = cell
        elif is_test_cell(cell):
            points = nbgrader_meta(cell).get("points")
            if not gid:
                raise GradingError(f"{where}: the test cell has no grade_id")
            if not isinstance(points, (int, float)) or isinstance(points, bool) or points <= 0:
                raise GradingError(f"{where}: test cell {gid!r} needs positive 'points', got {points!r}")
            found = hints(last_solution.source) if last_solution is not None else []
            ex.questions.append(Question(
                name=gid, points=points, test_source=source,
                solution_id=grade_id(last_solution) if last_solution is not None else None,
                hint=next((h for h in found if h), None)))
            last_solution = None
    if not ex.questions:
        raise GradingError(f"{path} has no graded test cell (nbgrader metadata with \"grade\": true)")
    return ex


def read_notebook(path: Path) -> NotebookNode:
    """Read a notebook file, with an error that says what is wrong when it is not one."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such notebook: {path}")
    text = path.read_text(encoding="utf-8", errors="replace")
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise GradingError(
            f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}): the file is "
            "cut short or is not a notebook. Save it again from Jupyter (File > Save) and resubmit."
        ) from None
    if not isinstance(raw, dict) or not isinstance(raw.get("cells"), list) or "nbformat" not in raw:
        raise GradingError(f"{path} is JSON but not a Jupyter notebook (it has no 'cells' and 'nbformat')")
    try:
        return nbformat.reads(text, as_version=4)
    except Exception as exc:  # nbformat raises several types for malformed notebooks
        raise GradingError(f"{path} is not a readable Jupyter notebook: {exc}") from None


def solutions_dir(override: Path | str | None = None) -> Path:
    """Where the instructor notebooks are: ``override``, else ``$COURSE_SOLUTIONS``, else ``solutions/``."""
    return Path(override or os.environ.get("COURSE_SOLUTIONS") or ROOT / "solutions")


def load_exercise(name: str, directory: Path | str | None = None) -> Exercise:
    """Parse ``<solutions>/<name>.ipynb``."""
    path = solutions_dir(directory) / f"{name}.ipynb"
    return parse_exercise(read_notebook(path), path)


def find_exercise(nb: NotebookNode, path: Path, directory: Path | str | None = None) -> Exercise:
    """The exercise a learner's notebook is a copy of: by its metadata, else by its file name.

    A submission may be renamed (``alice_01_memory_anatomy.ipynb``), so a file
    name that contains an exercise's name matches it (the longest wins).
    """
    known = sorted(p.stem for p in solutions_dir(directory).glob("*.ipynb"))
    meta = nb.metadata.get(META_KEY)
    tagged = meta.get("exercise") if isinstance(meta, dict) else None
    inside = [k for k in known if k in Path(path).stem]
    if tagged in known:
        name = tagged
    elif inside:
        name = max(inside, key=len)
    else:
        name = _by_cell_ids(nb, known, directory)
        if name is None:
            raise GradingError(
                f"{path} is not an exercise of this course: neither its name, its metadata nor its cells "
                f"match one of {', '.join(known) or '(no solutions notebooks found)'}. "
                "Keep the exercise's file name (for example 01_memory_anatomy.ipynb)."
            )
    ex = load_exercise(name, directory)
    if not ex.cell_ids() & {grade_id(c) for c in nb.cells}:
        raise GradingError(
            f"{path} is named like exercise {name} but none of its cells is one of that exercise's "
            "(no matching nbgrader grade_id): start again from a fresh copy of exercises/" + name + ".ipynb"
        )
    return ex


def _by_cell_ids(nb: NotebookNode, known: list[str], directory: Path | str | None) -> str | None:
    """The exercise sharing the most grade_ids with ``nb`` (a renamed copy whose metadata was lost)."""
    ids = {grade_id(c) for c in nb.cells} - {None}
    if not ids:
        return None
    overlap = {name: len(ids & load_exercise(name, directory).cell_ids()) for name in known}
    best = max(overlap, key=overlap.get, default=None)
    return best if best is not None and overlap[best] > 0 else None
