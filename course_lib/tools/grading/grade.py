"""Grade a learner's notebook against the instructor's tests (``course grade`` and ``course check``).

Nothing the learner's kernel says about a test is believed; only what its
answers are. The notebook that runs is built from the learner's cells, except
that in place of every test cell (the learner's copy is never used; a
deleted one is put back after its solution cell; a made-up one is dropped)
runs a *producer*: the instructor's inputs and answers sections of that test
(hidden ones too when grading), ending with ``wire.dump(got, ...)``. The kernel
runs in a ``Sandbox``. Then, in this process, the answers are decoded as plain
data and the instructor's checks run on them (``checker.Checker``); the
learner's source is read for what the question forbids (``forbid``).

A question owns the cells from just after the previous test cell up to its own
test cell. It scores its points only when all of them ran without an error, a
timeout or a dead kernel, its answers could be read, every check passed, and
nothing it forbids is used.
"""

from __future__ import annotations

import copy
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import nbformat
from nbformat import NotebookNode

from course_lib.tools.grading import forbid, wire
from course_lib.tools.grading.checker import Checker, Verdict, reseed_source, uses_torch
from course_lib.tools.grading.exercise import (
    Exercise, Question, find_exercise, grade_id, is_test_cell, notebook_from_bytes,
)
from course_lib.tools.grading.execute import CellRun, run_notebook
from course_lib.tools.grading.isolation import Limits, Sandbox, detect, limit_reason
from course_lib.tools.grading.limits import Overtime, time_limit

STATUSES = ("passed", "failed", "error", "timeout", "rejected")
DECODE_TIMEOUT: float = 30  # seconds to decode one question's answers (linear in their size: a 64 MiB file takes ~2)
_CELL_LINE = re.compile(r"Cell In\[\d+\], line (\d+)")
_MAX_MESSAGE = 400  # characters; a long traceback belongs in the notebook, not the report


@dataclass
class QuestionResult:
    """One question's outcome; ``status`` is one of ``STATUSES``; ``hidden``: what failed is a hidden test."""

    name: str
    score: float
    max_score: float
    status: str
    message: str = ""
    hidden: bool = False


@dataclass
class GradeResult:
    """The grade of one notebook."""

    notebook: str
    exercise: str
    questions: list[QuestionResult] = field(default_factory=list)
    isolation: str = ""

    @property
    def score(self) -> float:
        return sum(q.score for q in self.questions)

    @property
    def max_score(self) -> float:
        return sum(q.max_score for q in self.questions)

    def as_dict(self) -> dict:
        """The ``--json`` form: notebook, score, max_score, questions."""
        return {"notebook": self.notebook, "score": self.score, "max_score": self.max_score,
                "questions": [{k: v for k, v in asdict(q).items() if k != "hidden"} for q in self.questions]}


def points_text(x: float) -> str:
    """Points as people write them: ``3``, ``2.5``."""
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


# ----- the notebook the kernel runs --------------------------------------------------------------


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
    for at in test_at.values():
        labels[at] = "the test cell"
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


def owned_cells(nb: NotebookNode, test_at: dict[str, int]) -> dict[int, list[int]]:
    """Test cell position -> the code cells of its question (from after the previous test up to it)."""
    owner: dict[int, list[int]] = {}
    start = 0
    for at in sorted(test_at.values()):
        owner[at] = [i for i in range(start, at + 1) if nb.cells[i].cell_type == "code"]
        start = at + 1
    return owner


# ----- scoring -----------------------------------------------------------------------------------


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _MAX_MESSAGE else text[: _MAX_MESSAGE - 3] + "..."


def _result(q: Question, status: str, message: str, hidden: bool = False) -> QuestionResult:
    return QuestionResult(q.name, q.points if status == "passed" else 0, q.points, status, _short(message), hidden)


def _judge_cells(q: Question, cells: list[int], test: int, labels: list[str], runs: list[CellRun],
                 prod: Producer, limits: Limits) -> QuestionResult | None:
    """The first thing that went wrong in a question's cells in the kernel, if anything did."""
    for i in cells:
        run, label = runs[i], labels[i]
        limit = run.limit or (limit_reason(run.ename, run.evalue, limits) if run.status == "error" else "")
        if limit:
            return _result(q, "error", f"{'the test' if i == test else label} {limit}")
        if run.status == "not_run":
            where = f", in {labels[run.cause]}" if run.cause is not None else ""
            return _result(q, "timeout" if "overall limit" in run.evalue else "error", f"not run: {run.evalue}{where}")
        if run.status == "timeout":
            what = "the test" if i == test else label
            return _result(q, "timeout", f"{what} {run.evalue} (an endless loop, or too slow?)")
        if run.status == "dead":
            return _result(q, "error", f"the kernel died while running {label} (os._exit, a crash, or out of "
                                       "memory); nothing after it can pass")
        if run.status == "error" and i != test:
            return _result(q, "error", f"{label} raised {run.ename}: {run.evalue}; "
                                       "every cell of a question must run without an error")
    run = runs[test]
    if run.status != "error":
        return None
    m = _CELL_LINE.search(run.traceback)
    hidden = bool(m) and prod.lines.get(int(m[1])) == "hidden"
    inputs = "the hidden tests' inputs" if hidden else "the test's inputs"
    if run.ename == "NotImplementedError":
        return _result(q, "error", f"not implemented yet: {run.evalue}")
    if run.ename == "WireError":
        return _result(q, "error", f"your answer cannot be sent to the grader: {run.evalue}", hidden)
    return _result(q, "error", f"your code raised {run.ename} on {inputs}: {run.evalue}", hidden)


class _Answers:
    """Reads each question's answers file right after its test cell ran, while the kernel (and, in a
    namespace, its folder) still exists; ``decoded()`` turns them into values afterwards."""

    def __init__(self, sandbox: Sandbox, test_at: dict[str, int]) -> None:
        self.sandbox, self.question = sandbox, {at: name for name, at in test_at.items()}
        self.raw: dict[str, bytes | wire.WireError] = {}

    def __call__(self, index: int, run: CellRun) -> None:
        name = self.question.get(index)
        if name is not None and run.status == "ok":
            try:
                self.raw[name] = self.sandbox.read_result(f"{name}.answers")
            except wire.WireError as exc:
                self.raw[name] = exc

    def decoded(self) -> dict[str, Any]:
        """Question -> its decoded answers, or the ``WireError`` that says why they cannot be read."""
        out: dict[str, Any] = {}
        for name, raw in self.raw.items():
            try:
                out[name] = raw if isinstance(raw, wire.WireError) else decode(raw)
            except wire.WireError as exc:
                out[name] = exc
        return out


def decode(raw: bytes, seconds: float | None = None) -> Any:
    """One question's answers, decoded in at most ``seconds`` (default ``DECODE_TIMEOUT``); else ``WireError``."""
    seconds = DECODE_TIMEOUT if seconds is None else seconds
    try:
        with time_limit(seconds):
            return wire.loads(raw)
    except Overtime:
        raise wire.WireError(f"decoding them ran past {seconds:g} s") from None


def grade_notebook(path: Path | str, timeout: int = 60, solutions: Path | str | None = None,
                   hidden: bool = True, total_timeout: float | None = None, exercise: Exercise | None = None,
                   isolation: str | None = None, hide: list[Path] | None = None, threads: int = 1,
                   data: bytes | None = None, limits: Limits | None = None) -> GradeResult:
    """Grade one learner notebook; ``hidden=False`` runs only the visible tests (``course check``).

    ``exercise``: the instructor's exercise, already read (else found from the
    notebook and ``solutions``). ``isolation``: a mode of ``isolation.MODES``
    (default: the strongest this machine allows when grading, ``none`` for a
    check). ``hide``: folders the kernel must not see (the class's submissions,
    the grades). ``data``: the notebook's bytes, already read. ``limits``: what
    the kernel may use (default: ``Limits.from_env()``).
    """
    path = Path(path)
    data = path.read_bytes() if data is None else data
    learner = notebook_from_bytes(data, path)
    ex = exercise or find_exercise(learner, path, solutions)
    mode = isolation or (detect() if hidden else "none")
    torch_too = uses_torch(ex)
    with Sandbox(mode, path.name, data, hide=list(hide or []), threads=threads, limits=limits) as sandbox:
        prods = {q.name: producer(q, hidden, str(sandbox.results / f"{q.name}.answers"), torch_too)
                 for q in ex.questions}
        nb, labels, test_at = build_run_notebook(learner, ex, {k: p.source for k, p in prods.items()})
        collect = _Answers(sandbox, test_at)
        runs = run_notebook(nb, sandbox, timeout=timeout, total_timeout=total_timeout, after_cell=collect)
        answers = collect.decoded()
        limits = sandbox.limits
    verdicts = Checker(ex, hidden).check({k: v for k, v in answers.items() if not isinstance(v, wire.WireError)})
    owner = owned_cells(nb, test_at)
    tests = set(test_at.values())
    code = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and i not in tests]
    sources, code_labels = [nb.cells[i].source for i in code], [labels[i] for i in code]
    results = []
    for q in ex.questions:
        at = test_at[q.name]
        found = _judge_cells(q, owner[at], at, labels, runs, prods[q.name], limits)
        if found is None and isinstance(answers.get(q.name), wire.WireError):
            found = _result(q, "error", f"your answers could not be read: {answers[q.name]}")
        if found is None:
            v: Verdict = verdicts.get(q.name, Verdict("error", "the checks did not run"))
            found = _result(q, v.status, v.message, v.hidden)
        used = forbid.violations(sources, [k for k, i in enumerate(code) if i in owner[at]], q.forbid, code_labels)
        if used:
            found = _result(q, "rejected", "this question asks you to write it yourself, but your code "
                                           + "; ".join(used))
        results.append(found)
    return GradeResult(notebook=str(path), exercise=ex.name, questions=results, isolation=mode)
