"""Grade a learner's notebook against the instructor's tests (``course grade`` and ``course check``).

Nothing the learner's kernel says about a test is believed; only what its
answers are. The notebook that runs is built from the learner's cells, with
the instructor's tests in place of theirs (``runbook``). The kernel runs in a
``Sandbox``. Then, in this process, the answers are decoded as plain
data and the instructor's checks run on them (``checker.Checker``); the
learner's source is read for what the question forbids (``forbid``).

A question owns the cells from just after the previous test cell up to its own
test cell. It scores its points only when all of them ran without an error, a
timeout or a dead kernel, its answers could be read, every check passed, and
nothing it forbids is used. A question that fails after an earlier cell
raised (the imports cell, most often) names that cell as the first thing to fix.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


from course_lib.tools.grading import forbid, wire
from course_lib.tools.grading.checker import Checker, Verdict, uses_torch
from course_lib.tools.grading.exercise import Exercise, Question, find_exercise, grade_id, notebook_from_bytes
from course_lib.tools.grading.execute import CellRun, run_notebook
from course_lib.tools.grading.isolation import Limits, Sandbox, detect, limit_reason
from course_lib.tools.grading.limits import Overtime, time_limit
from course_lib.tools.grading.runbook import Producer, build_run_notebook, owned_cells, producer

STATUSES = ("passed", "failed", "error", "timeout", "rejected")
DECODE_TIMEOUT: float = 30  # seconds to decode one question's answers (linear in their size: a 64 MiB file takes ~2)
_CELL_LINE = re.compile(r"Cell In\[\d+\], line (\d+)")
_MAX_MESSAGE = 400  # characters; a long traceback belongs in the notebook, not the report


@dataclass
class QuestionResult:
    """One question's outcome; ``status`` is one of ``STATUSES``; ``title``: its heading in the notebook;
    ``hidden``: what failed is a hidden test; ``earlier``: what failed is another cell than the question's
    function (the imports cell, say), so its hint does not apply."""

    name: str
    score: float
    max_score: float
    status: str
    message: str = ""
    hidden: bool = False
    title: str = ""
    earlier: bool = False

    @property
    def heading(self) -> str:
        """How a person names the question: its title, else its id."""
        return self.title or self.name


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
        """The ``--json`` form: notebook, exercise, score, max_score, questions (name, title, score, max_score,
        status, message)."""
        keys = ("name", "title", "score", "max_score", "status", "message")
        return {"notebook": self.notebook, "exercise": self.exercise, "score": self.score,
                "max_score": self.max_score, "questions": [{k: asdict(q)[k] for k in keys} for q in self.questions]}

    @classmethod
    def from_dict(cls, doc: dict) -> GradeResult:
        """The result ``as_dict`` wrote (a row of an earlier ``grades.json``)."""
        keys = ("name", "score", "max_score", "status", "message", "title")
        return cls(doc["notebook"], doc["exercise"], [QuestionResult(**{k: q[k] for k in keys if k in q})
                                                      for q in doc["questions"]])


def points_text(x: float) -> str:
    """Points as people write them: ``3``, ``2.5``."""
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


# ----- scoring -----------------------------------------------------------------------------------


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _MAX_MESSAGE else text[: _MAX_MESSAGE - 3] + "..."


def _result(q: Question, status: str, message: str, hidden: bool = False, earlier: bool = False) -> QuestionResult:
    return QuestionResult(q.name, q.points if status == "passed" else 0, q.points, status, _short(message), hidden,
                          q.title, earlier)


def _judge_cells(q: Question, cells: list[int], test: int, labels: list[str], runs: list[CellRun],
                 prod: Producer, limits: Limits, function: int | None) -> QuestionResult | None:
    """The first thing that went wrong in a question's cells in the kernel, if anything did (``function``:
    where the question's solution cell is)."""
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
        if run.status == "error" and i == function:
            return _result(q, "error", f"{label} raised {run.ename}: {run.evalue}; "
                                       "every cell of a question must run without an error")
        if run.status == "error" and i != test:
            return _result(q, "error", f"{label} raised {run.ename}: {run.evalue}: fix it first (every cell of "
                                       "a question must run without an error)", earlier=True)
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


def _first_raised(runs: list[CellRun], tests: set[int]) -> int | None:
    """The first of the learner's cells (not a test) that raised an error, if any did."""
    return next((i for i, run in enumerate(runs) if run.status == "error" and i not in tests), None)


def _blame_earlier(found: QuestionResult, first: int | None, cells: list[int], labels: list[str],
                   runs: list[CellRun]) -> QuestionResult:
    """``found``, led by the cell before the question's own that raised (``first``): that is what to fix first,
    and the question's hint does not apply to it."""
    if first is None or found.status not in ("error", "failed") or found.hidden or first >= min(cells):
        return found  # a hidden test's failure: the visible ones ran, so that cell was not in the way
    run = runs[first]
    found.message = _short(f"{labels[first]} failed ({run.ename}: {run.evalue}): fix it first; this question "
                           f"then: {found.message}")
    found.earlier = True
    return found


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
    first = _first_raised(runs, tests)
    results = []
    for q in ex.questions:
        at = test_at[q.name]
        function = next((i for i in owner[at] if q.solution_id and grade_id(nb.cells[i]) == q.solution_id), None)
        found = _judge_cells(q, owner[at], at, labels, runs, prods[q.name], limits, function)
        if found is None and isinstance(answers.get(q.name), wire.WireError):
            found = _result(q, "error", f"your answers could not be read: {answers[q.name]}")
        if found is None:
            v: Verdict = verdicts.get(q.name, Verdict("error", "the checks did not run"))
            found = _result(q, v.status, v.message, v.hidden)
        used = forbid.violations(sources, [k for k, i in enumerate(code) if i in owner[at]], q.forbid, code_labels)
        if used:
            found = _result(q, "rejected", "this question asks you to write it yourself, but your code "
                                           + "; ".join(used))
        results.append(_blame_earlier(found, first, owner[at], labels, runs))
    return GradeResult(notebook=str(path), exercise=ex.name, questions=results, isolation=mode)
