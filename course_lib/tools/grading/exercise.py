"""What an exercise is: the questions of a ``solutions/`` notebook, and finding them for a learner's copy.

The authoring convention (nbgrader's cell metadata, so nbgrader can grade the
same files):

- a *solution cell* has ``{"solution": true, "grade": false, "grade_id": "qN_<name>"}``
  and holds a typed function whose body sits between ``### BEGIN SOLUTION``
  and ``### END SOLUTION``; the first line inside may be ``# HINT: <sentence>``;
- the *test cell* right after it has ``{"grade": true, "solution": false,
  "points": P, "grade_id": "qN_<name>_test"}``: the visible tests, then the
  hidden ones between ``### BEGIN HIDDEN TESTS`` and ``### END HIDDEN TESTS``
  (last in the cell). Each of the two is written in three sections::

      <inputs: build the test's inputs; never call the learner's code>
      ### ANSWERS
      <call the learner's functions; put what the checks need in the dict ``got``>
      ### CHECKS
      <asserts on ``got``; references computed here>

  Run top to bottom (in Jupyter, or by nbgrader) the cell is an ordinary test.
  The grader instead runs the inputs and answers in the learner's kernel and
  sends ``got`` out as plain data (``course_lib.tools.grading.wire``), then runs the
  inputs again and the checks in its own process, which never runs learner
  code. A test cell's ``metadata.course.forbid`` may list what the answer must
  not call (``"course_lib.memory.zero_memory"``, see ``course_lib.tools.grading.forbid``).

A question is named by its test cell's ``grade_id`` and owns the cells after
the previous test cell, up to and including its own. Code cells that are
neither solution nor test cells (the imports) run in both places, in order:
the learner's copy in the kernel, the instructor's in the grader.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
from nbformat import NotebookNode

ROOT = Path(__file__).resolve().parents[3]
EXERCISES = ROOT / "exercises"
BEGIN_SOLUTION, END_SOLUTION = "BEGIN SOLUTION", "END SOLUTION"
BEGIN_HIDDEN, END_HIDDEN = "BEGIN HIDDEN TESTS", "END HIDDEN TESTS"
ANSWERS, CHECKS = "### ANSWERS", "### CHECKS"   # section markers, each alone on its line
HINT = re.compile(r"^\s*#\s*HINT:\s*(?P<hint>.+?)\s*$")
HEADING = re.compile(r"^#{2,6}\s+(?P<text>.+?)\s*#*\s*$", re.M)  # a question's heading; "#" titles the notebook
POINTS = re.compile(r"\s*\(\s*[\d.]+\s+points?\s*\)", re.I)       # "(2 points)": the grade shows them anyway
META_KEY = "course"  # notebook metadata the generated exercises carry: {"exercise": "<stem>"}


class GradingError(ValueError):
    """A notebook cannot be graded (not JSON, not a notebook, not an exercise of this course)."""


@dataclass(frozen=True)
class Section:
    """Source of one section of a test cell, and the 1-based cell line it starts at (for tracebacks)."""

    source: str
    line: int

    def code(self, filename: str):
        """Compiled, with line numbers as in the test cell."""
        return compile("\n" * (self.line - 1) + self.source, filename, "exec")


@dataclass(frozen=True)
class Part:
    """The visible tests or the hidden tests of a test cell: inputs, answers, checks."""

    inputs: Section
    answers: Section
    checks: Section


@dataclass(frozen=True)
class Question:
    """One graded question: its test cell and the solution cell it checks."""

    name: str                 # the test cell's grade_id, e.g. "q1_param_bytes_test"
    points: float
    test_source: str          # the instructor's test cell, hidden tests included
    solution_id: str | None   # grade_id of the solution cell before it, if any
    hint: str | None          # the solution's "# HINT:" line, if any
    visible: Part | None = None
    hidden: Part | None = None
    forbid: tuple[str, ...] = ()   # dotted names the learner's code must not use for this question
    title: str = ""           # its heading in the notebook ("Question 1: ..."), else its name

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

    def steps(self) -> list[tuple[str, object]]:
        """The instructor's notebook in order, as the grader replays it: ``("setup", source)`` for a plain
        code cell, ``("question", Question)`` for a test cell (solution cells are the learner's: skipped)."""
        out: list[tuple[str, object]] = []
        for cell in self.notebook.cells:
            if is_test_cell(cell):
                out.append(("question", self.question(grade_id(cell))))
            elif cell.get("cell_type") == "code" and not is_solution_cell(cell) and cell.source.strip():
                out.append(("setup", cell.source))
        return out


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


def stub_hints(source: str) -> list[str | None]:
    """The messages of ``raise NotImplementedError("...")`` stubs (the hints of a generated exercise)."""
    import ast

    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    return [node.exc.args[0].value for node in ast.walk(tree)
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)
            and getattr(node.exc.func, "id", None) == "NotImplementedError" and node.exc.args
            and isinstance(node.exc.args[0], ast.Constant) and isinstance(node.exc.args[0].value, str)]


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


def _sections(lines: list[tuple[int, str]], where: str) -> Part:
    """Split numbered lines at the ``### ANSWERS`` and ``### CHECKS`` markers."""
    marks = {ANSWERS: [], CHECKS: []}
    for k, (_, line) in enumerate(lines):
        if line.strip() in marks:
            marks[line.strip()].append(k)
    if len(marks[ANSWERS]) != 1 or len(marks[CHECKS]) != 1 or marks[ANSWERS][0] > marks[CHECKS][0]:
        raise GradingError(f"{where}: write the tests as inputs, then a line '{ANSWERS}', the calls of the "
                           f"learner's functions (filling the dict `got`), then a line '{CHECKS}' and the "
                           "asserts; each marker once, in that order")
    a, c = marks[ANSWERS][0], marks[CHECKS][0]

    def section(chunk: list[tuple[int, str]], start: int) -> Section:
        return Section("\n".join(line for _, line in chunk), chunk[0][0] if chunk else start)

    first = lines[0][0] if lines else 1
    return Part(section(lines[:a], first), section(lines[a + 1:c], lines[a][0] + 1),
                section(lines[c + 1:], lines[c][0] + 1))


def split_test(source: str, where: str) -> tuple[Part, Part | None]:
    """The visible and the hidden part of a test cell (``None`` when it has no hidden tests)."""
    visible: list[tuple[int, str]] = []
    hidden: list[tuple[int, str]] | None = None
    inside, closed = False, False
    for n, line in enumerate(source.splitlines(), start=1):
        if BEGIN_HIDDEN in line:
            inside, hidden = True, []
        elif END_HIDDEN in line:
            inside, closed = False, True
        elif inside:
            hidden.append((n, line))  # type: ignore[union-attr]
        elif closed and line.strip() and not line.strip().startswith("#"):
            raise GradingError(f"{where}: the hidden tests must come last in the test cell")
        elif not closed:
            visible.append((n, line))
    parts = (_sections(visible, f"{where} (visible tests)"),
             _sections(hidden, f"{where} (hidden tests)") if hidden is not None else None)
    for part, kind in zip(parts, ("visible", "hidden")):
        for name in ("inputs", "answers", "checks"):
            if part is not None:
                try:
                    getattr(part, name).code(where)
                except SyntaxError as exc:
                    raise GradingError(f"{where}: the {kind} tests' {name} are not valid Python "
                                       f"(line {exc.lineno}: {exc.msg})") from None
    return parts


def _forbidden(cell: NotebookNode, where: str) -> tuple[str, ...]:
    names = cell.get("metadata", {}).get(META_KEY, {}).get("forbid", [])
    if not isinstance(names, list) or not all(isinstance(n, str) and "." in n for n in names):
        raise GradingError(f"{where}: metadata.{META_KEY}.forbid must be a list of dotted names, got {names!r}")
    return tuple(names)


def parse_exercise(nb: NotebookNode, path: Path) -> Exercise:
    """Read the questions of a solutions notebook; raise ``GradingError`` where it breaks the convention."""
    ex = Exercise(name=path.stem, path=path, notebook=nb)
    seen: set[str] = set()
    last_solution: NotebookNode | None = None
    heading = ""  # the last heading since the previous test cell
    for i, cell in enumerate(nb.cells):
        where = f"{path.name}, cell {i + 1}"
        source = cell.get("source", "")
        _check_regions(source, BEGIN_SOLUTION, END_SOLUTION, where)
        _check_regions(source, BEGIN_HIDDEN, END_HIDDEN, where)
        gid = grade_id(cell)
        if cell.get("cell_type") == "markdown":
            found_headings = HEADING.findall(source)
            heading = POINTS.sub("", found_headings[-1]).strip() if found_headings else heading
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
            found = found or (stub_hints(last_solution.source) if last_solution is not None else [])
            visible, hidden = split_test(source, where)
            ex.questions.append(Question(
                name=gid, points=points, test_source=source,
                solution_id=grade_id(last_solution) if last_solution is not None else None,
                hint=next((h for h in found if h), None), visible=visible, hidden=hidden,
                forbid=_forbidden(cell, where), title=heading or gid))
            last_solution, heading = None, ""
        elif cell.get("cell_type") == "code" and source.strip():
            try:
                compile(source, where, "exec")
            except SyntaxError as exc:
                raise GradingError(f"{where}: the grader replays this cell in plain Python, which it is not "
                                   f"(line {exc.lineno}: {exc.msg}); no IPython magics here") from None
    if not ex.questions:
        raise GradingError(f"{path} has no graded test cell (nbgrader metadata with \"grade\": true)")
    return ex


def read_notebook(path: Path) -> NotebookNode:
    """Read a notebook file, with an error that says what is wrong when it is not one."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such notebook: {path}")
    return notebook_from_bytes(path.read_bytes(), path)


def notebook_from_bytes(data: bytes, path: Path) -> NotebookNode:
    """A notebook from the bytes of the file ``path`` (named in errors)."""
    text = data.decode("utf-8", errors="replace")
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


def exercise_dir(override: Path | str | None = None, public: bool = False) -> Path:
    """The folder the exercises are read from: the solutions; with ``public`` (``course check``), the
    generated ``exercises/`` when there are no solutions (the learner's copy of the course)."""
    sol = solutions_dir(override)
    if sol.is_dir() and any(sol.glob("*.ipynb")):
        return sol
    if public and override is None and any(EXERCISES.glob("*.ipynb")):
        return EXERCISES
    raise GradingError(
        f"no solutions notebooks in {sol}: this looks like the learner's copy of the course (`course release`), "
        "which has only the visible tests. Grade from the instructor's repository, or set COURSE_SOLUTIONS "
        "to the folder of the solutions notebooks")


def load_exercise(name: str, directory: Path | str | None = None, public: bool = False) -> Exercise:
    """Parse ``<solutions>/<name>.ipynb`` (with ``public``, possibly ``exercises/<name>.ipynb``)."""
    path = exercise_dir(directory, public) / f"{name}.ipynb"
    return parse_exercise(read_notebook(path), path)


class Catalog:
    """Every exercise of the solutions folder (``public``: possibly the generated ``exercises/``), read into
    memory at once, so that what a learner's code does later cannot change them."""

    def __init__(self, directory: Path | str | None = None, public: bool = False) -> None:
        self.folder = exercise_dir(directory, public)
        self.exercises = {p.stem: parse_exercise(read_notebook(p), p) for p in sorted(self.folder.glob("*.ipynb"))}

    def find(self, nb: NotebookNode, path: Path) -> Exercise:
        """The exercise a learner's notebook is a copy of: by its metadata, else by its file name, else by its
        cells. A submission may be renamed (``alice_01_memory_anatomy.ipynb``), so a file name that contains
        an exercise's name matches it (the longest wins)."""
        known = sorted(self.exercises)
        meta = nb.metadata.get(META_KEY)
        tagged = meta.get("exercise") if isinstance(meta, dict) else None
        inside = [k for k in known if k in Path(path).stem]
        ids = {grade_id(c) for c in nb.cells} - {None}
        if tagged in known:
            name = tagged
        elif inside:
            name = max(inside, key=len)
        else:
            overlap = {k: len(ids & self.exercises[k].cell_ids()) for k in known}
            name = max(overlap, key=overlap.get, default=None)
            if name is None or overlap[name] == 0:
                raise GradingError(
                    f"{path} is not an exercise of this course: neither its name, its metadata nor its cells "
                    f"match one of {', '.join(known) or '(no solutions notebooks found)'}. "
                    "Keep the exercise's file name (for example 01_memory_anatomy.ipynb).")
        ex = self.exercises[name]
        if not ex.cell_ids() & ids:
            raise GradingError(
                f"{path} is named like exercise {name} but none of its cells is one of that exercise's "
                "(no matching nbgrader grade_id): start again from a fresh copy of exercises/" + name + ".ipynb")
        return ex


def find_exercise(nb: NotebookNode, path: Path, directory: Path | str | None = None,
                  public: bool = False) -> Exercise:
    """The exercise a learner's notebook is a copy of (see ``Catalog.find``)."""
    return Catalog(directory, public).find(nb, path)
