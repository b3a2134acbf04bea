"""Grade a folder of submissions (``course grade FOLDER``): in parallel, into a CSV, a summary and feedback.

Any layout works: ``submissions/alice/01_memory_anatomy.ipynb`` or
``submissions/alice_01_memory_anatomy.ipynb``; the student is the first
folder, else what the file name holds besides the exercise's name. Each
notebook is matched to its exercise by its metadata or its name. One row per
notebook; a notebook that cannot be graded still gets a row, with the reason
in ``problem``.

Order of events: every instructor notebook and every submission is read into
memory first, and submissions whose student ids collide are refused; then
worker processes grade (``workers``: each notebook in its own sandboxed
kernel, the class's folder and the outputs hidden from it, under a
deadline); the grader's main process only collects results and, as each
notebook finishes, rewrites the CSV, the JSON and the summary and writes
that notebook's feedback, each file atomically (to a temporary name, then
renamed): a run that is stopped keeps every grade given so far, and lists
the rest as not graded yet. A worker that a submission managed to kill
(possible only without isolation) is replaced and that submission graded
once more.

Everything a learner chose (folder and file names, the text of their
errors) is data: a CSV cell that a spreadsheet would read as a formula gets a
leading apostrophe, and the feedback escapes markdown and HTML.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from course_lib.tools.grading import checker, grade, workers
from course_lib.tools.grading.execute import longest_run
from course_lib.tools.grading.exercise import Catalog, Exercise, GradingError, is_test_cell, notebook_from_bytes
from course_lib.tools.grading.grade import GradeResult, grade_notebook, points_text
from course_lib.tools.grading.isolation import Limits, describe, detect

PENDING = "not graded yet: grading was still running, or was stopped before this notebook"


@dataclass
class Submission:
    """One notebook of the folder: who handed it in, its grade, or why it has none."""

    path: Path
    rel: str = ""
    student: str = ""
    exercise: Exercise | None = None
    data: bytes = b""
    result: GradeResult | None = None
    problem: str = ""
    attempts: int = 0


@dataclass
class Settings:
    """How each notebook is graded."""

    timeout: int = 60                      # seconds per cell
    notebook_timeout: float | None = None  # seconds for all of a notebook's cells
    isolation: str | None = None           # None: the strongest the machine allows
    hide: list[Path] = field(default_factory=list)
    threads: int = 1
    limits: Limits | None = None           # None: Limits.from_env()
    deadline: float | None = None          # seconds a worker may spend on one notebook (None: notebook_deadline)


def notebook_deadline(settings: Settings, ex: Exercise) -> float:
    """Seconds a worker may spend on one notebook of ``ex``: the longest its kernel can run, the time limits
    of decoding and checking each question, and a minute for the rest (the sandbox, reading the source)."""
    if settings.deadline is not None:
        return settings.deadline
    per_question = grade.DECODE_TIMEOUT + checker.CHECK_TIMEOUT
    return longest_run(settings.timeout, settings.notebook_timeout) + len(ex.questions) * per_question + 60


def find_submissions(folder: Path) -> list[Path]:
    """Every ``.ipynb`` under ``folder``, without Jupyter's checkpoint copies."""
    return sorted(p for p in Path(folder).rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)


def student_name(rel: Path, exercise: str | None) -> str:
    """Who handed ``rel`` in, as written: its first folder, else what its file name holds besides ``exercise``."""
    if len(rel.parts) > 1:
        return rel.parts[0]
    stem = rel.stem
    return (stem.replace(exercise, "").strip(" _-.") if exercise and exercise in stem else stem) or stem


def student_id(rel: Path, exercise: str | None) -> str:
    """``alice/01_x.ipynb`` -> ``alice``; ``alice_01_x.ipynb`` -> ``alice``; ``01_x.ipynb`` -> ``01_x``."""
    return re.sub(r"[^\w.@+-]", "_", student_name(rel, exercise)).lstrip(".") or "unnamed"


def refuse_collisions(subs: list[Submission]) -> None:
    """Refuse (a ``problem`` that says what to rename) the submissions whose student ids collide: two names
    that differ only in case or in characters an id replaces (``a b`` and ``a_b``; ``Zoe`` and ``zoe`` share a
    folder where case does not count), or one student's exercise handed in twice. Either would give two rows
    one name, and the second feedback file would overwrite the first."""
    def name(sub: Submission) -> str:
        return student_name(Path(sub.rel), sub.exercise.name if sub.exercise else None)

    groups: dict[str, list[Submission]] = {}
    for sub in subs:
        groups.setdefault(sub.student.casefold(), []).append(sub)
    for group in groups.values():
        if len({name(s) for s in group}) > 1:
            for sub in group:
                others = ", ".join(o.rel for o in group if name(o) != name(sub))
                sub.problem = sub.problem or (
                    f"its student id {sub.student} is also that of {others} (names that differ only in case or in "
                    "characters an id replaces): rename one of them and grade again")
            continue
        by_exercise: dict[str, list[Submission]] = {}
        for sub in group:
            if sub.exercise is not None:
                by_exercise.setdefault(sub.exercise.name, []).append(sub)
        for same in by_exercise.values():
            for sub in same if len(same) > 1 else []:
                sub.problem = sub.problem or (
                    f"student {sub.student} handed in exercise {sub.exercise.name} more than once "
                    f"({', '.join(s.rel for s in same)}): keep one and grade again")


def _grade_one(sub: Submission, settings: Settings) -> tuple[GradeResult | None, str]:
    """In a worker: the grade of one submission, or why it has none."""
    try:
        result = grade_notebook(sub.path, timeout=settings.timeout, total_timeout=settings.notebook_timeout,
                                exercise=sub.exercise, isolation=settings.isolation, hide=settings.hide,
                                threads=settings.threads, data=sub.data, limits=settings.limits)
        return result, ""
    except (GradingError, OSError) as exc:
        return None, str(exc)


def _grade(subs: list[Submission], settings: Settings, jobs: int,
           record: Callable[[Submission], None]) -> list[Submission]:
    """Grade ``subs`` with ``jobs`` workers, ``record`` each as it ends; return those whose worker died."""
    lost: list[Submission] = []

    def finished(sub: Submission, outcome: workers.Outcome) -> None:
        sub.attempts += 1
        if outcome.kind == "died":
            lost.append(sub)
            return
        if outcome.kind == "done":
            sub.result, sub.problem = outcome.value
        elif outcome.kind == "overtime":
            sub.problem = (f"grading this notebook ran past its deadline of "
                           f"{notebook_deadline(settings, sub.exercise):.0f} s (its kernel's time limits, then "
                           "decoding and checking each question): it was stopped, not graded")
        else:  # a bug in the grader should not lose the class's other grades
            sub.problem = f"the grader failed on this notebook: {outcome.value}"
        record(sub)

    workers.run(subs, _grade_one, settings, jobs, lambda s: notebook_deadline(settings, s.exercise), finished)
    return lost


def grade_folder(folder: Path | str, timeout: int = 60, solutions: Path | str | None = None,
                 progress: Callable[[Submission], None] | None = None, jobs: int = 1,
                 notebook_timeout: float | None = None, isolation: str | None = None,
                 hide: list[Path] | None = None, limits: Limits | None = None, outputs: Outputs | None = None,
                 deadline: float | None = None) -> list[Submission]:
    """Grade every notebook under ``folder`` with ``jobs`` parallel workers (each notebook in its own kernel,
    within ``limits``, each worker within ``deadline`` seconds a notebook: default ``notebook_deadline``).
    ``outputs``: where the grades are written, updated as each notebook finishes."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"no such folder: {folder}")
    if jobs < 1:
        raise GradingError(f"-j needs at least one worker, got {jobs}")
    catalog = Catalog(solutions)  # the instructor's files, in memory before any learner code runs
    paths = find_submissions(folder)
    if not paths:
        raise GradingError(f"{folder} holds no .ipynb files to grade")
    subs = []
    for path in paths:
        sub = Submission(path, rel=path.relative_to(folder).as_posix())
        try:
            sub.data = path.read_bytes()
            sub.exercise = catalog.find(notebook_from_bytes(sub.data, path), path)
        except (GradingError, OSError) as exc:
            sub.problem = str(exc)
        sub.student = student_id(Path(sub.rel), sub.exercise.name if sub.exercise else None)
        subs.append(sub)
    refuse_collisions(subs)
    settings = Settings(timeout, notebook_timeout, isolation, [folder, catalog.folder, *(hide or [])],
                        threads=max(1, (os.cpu_count() or 1) // jobs), limits=limits or Limits.from_env(),
                        deadline=deadline)
    todo = [s for s in subs if s.exercise is not None and not s.problem]
    for s in todo:
        s.problem = PENDING

    def record(sub: Submission) -> None:
        if outputs is not None:
            outputs.update(subs, sub)
        if progress:
            progress(sub)

    if outputs is not None:
        outputs.update(subs)  # every submission listed before the first kernel starts
    for s in subs:
        if s not in todo and progress:
            progress(s)
    lost = _grade(todo, settings, jobs, record)
    for sub in lost:  # its worker died: once more, alone, in case something else killed it
        if _grade([sub], settings, 1, record):
            sub.problem = ("grading this notebook killed the grader's worker process (twice): it was not "
                           f"graded; isolation {isolation or detect()} could not stop it")
            record(sub)
    return subs


# ----- outputs -------------------------------------------------------------------------------------


def write_atomic(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary file in the same folder, then rename it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8", newline="") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def question_names(subs: list[Submission]) -> list[str]:
    """Every question, in first-seen order."""
    names: list[str] = []
    for sub in subs:
        for q in sub.result.questions if sub.result else []:
            if q.name not in names:
                names.append(q.name)
    return names


_FORMULA = ("=", "+", "-", "@", "\t", "\r", "\n")  # how a cell a spreadsheet runs as a formula can start


def as_text(cells: list) -> list:
    """A CSV row whose text cells a spreadsheet shows as text: one that starts like a formula (``=``, ``+``,
    ``-``, ``@``, or a tab or line break before one) gets a leading apostrophe, which it hides."""
    return ["'" + c if isinstance(c, str) and c.startswith(_FORMULA) else c for c in cells]


def csv_text(subs: list[Submission]) -> str:
    """Columns: student, submission, exercise, score, max_score, per question its points and its reason, problem."""
    questions = question_names(subs)
    out = io.StringIO()
    w = csv.writer(out)
    w.writerow(as_text(["student", "submission", "exercise", "score", "max_score",
                        *[c for q in questions for c in (q, f"{q}_reason")], "problem"]))
    for sub in subs:
        if sub.result is None:
            w.writerow(as_text([sub.student, sub.rel, sub.exercise.name if sub.exercise else "", "", "",
                                *[""] * (2 * len(questions)), sub.problem]))
            continue
        by_name = {q.name: q for q in sub.result.questions}
        cells = []
        for name in questions:
            q = by_name.get(name)
            cells += [points_text(q.score), "" if q.status == "passed" else f"{q.status}: {q.message}"] if q else ["", ""]
        problems = "; ".join(f"{q.name}: {q.status}" for q in sub.result.questions if q.status != "passed")
        w.writerow(as_text([sub.student, sub.rel, sub.result.exercise, points_text(sub.result.score),
                            points_text(sub.result.max_score), *cells, problems]))
    return out.getvalue()


def summary(subs: list[Submission]) -> list[dict]:
    """Per exercise and question: notebooks graded, mean points, maximum, pass rate."""
    rows: dict[tuple[str, str], list] = {}
    for sub in subs:
        for q in sub.result.questions if sub.result else []:
            rows.setdefault((sub.result.exercise, q.name), []).append(q)
    return [{"exercise": ex, "question": name, "graded": len(qs), "max_score": qs[0].max_score,
             "mean_score": round(statistics.fmean(q.score for q in qs), 3),
             "pass_rate": round(sum(q.status == "passed" for q in qs) / len(qs), 3)}
            for (ex, name), qs in rows.items()]


def summary_text(rows: list[dict]) -> str:
    """The summary as a table for the terminal."""
    head = ("exercise", "question", "graded", "mean", "max", "pass rate")
    table = [head] + [(r["exercise"], r["question"], str(r["graded"]), f"{r['mean_score']:g}",
                       points_text(r["max_score"]), f"{100 * r['pass_rate']:.0f}%") for r in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in table)


def summary_csv(rows: list[dict]) -> str:
    out = io.StringIO()
    w = csv.DictWriter(out, fieldnames=["exercise", "question", "graded", "mean_score", "max_score", "pass_rate"])
    w.writeheader()
    w.writerows(dict(zip(r, as_text(list(r.values())))) for r in rows)
    return out.getvalue()


def hidden_snippets(ex: Exercise, shortest: int = 8) -> set[str]:
    """Text of the hidden tests that feedback must never quote: their lines and their string literals, less
    what the exercise shows anyway (its text, its setup, its visible tests)."""
    import ast

    public = [c.source for c in ex.notebook.cells if not is_test_cell(c)]
    public += [sec.source for q in ex.questions if q.visible for sec in (q.visible.inputs, q.visible.answers,
                                                                          q.visible.checks)]
    shown = "\n".join(public)
    found: set[str] = set()
    for q in ex.questions:
        if q.hidden is None:
            continue
        for section in (q.hidden.inputs, q.hidden.answers, q.hidden.checks):
            found |= {line.strip() for line in section.source.splitlines() if len(line.strip()) >= shortest}
            for node in ast.walk(ast.parse(section.source)):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and len(node.value) >= shortest:
                    found.add(node.value)
    return {s for s in found if s not in shown}


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]{0,60}")
_MARKUP = re.compile(r"([\\`*_\[\]<>|~&$])")       # what markdown, its tables, HTML or math could read as markup
_CONTROL = re.compile(r"[\x00-\x1f\x7f]+")          # line breaks, and a terminal's escape sequences


def as_markdown(text: str) -> str:
    """Markdown that shows ``text`` as written, on one line: every character that could start a tag, a link, an
    image, a code span, emphasis, a table cell or math is backslash-escaped (a learner wrote the text)."""
    return _MARKUP.sub(r"\\\1", " ".join(_CONTROL.sub(" ", text).split()))


def _feedback_line(q, hint: str | None, secret: set[str]) -> str:
    """What a learner may read about one question: never the hidden tests' text."""
    if q.status == "passed":
        return ""
    if q.hidden and q.status == "failed":
        text = ("passes the visible tests but fails a hidden test: a case the instructions or the docstring "
                "name (an edge case, an invalid input, another shape)")
    elif q.hidden:
        kind = q.message.split(" on the hidden")[0].removeprefix("your code raised ").strip()
        text = (f"your code raised {kind if _NAME.fullmatch(kind) else 'an exception'} on the hidden tests' "
                "inputs" if q.message.startswith("your code raised") else "an error on the hidden tests")
    else:
        text = q.message
    if any(s in text for s in secret):
        text = f"{q.status} (the message is withheld: it quotes the hidden tests)"
    helps = hint and hint not in text and q.status in ("failed", "error", "timeout")
    return as_markdown(text) + (f"\n  - hint: {hint}" if helps else "")  # the hint is the instructor's markdown


def feedback_markdown(sub: Submission) -> str:
    """The per-student feedback for one graded notebook (markdown), without any hidden test's text."""
    r, ex = sub.result, sub.exercise
    assert r is not None and ex is not None
    secret = hidden_snippets(ex)
    lines = [f"# {r.exercise}: {points_text(r.score)} of {points_text(r.max_score)} points", "",
             f"Notebook: {as_markdown(sub.rel)}", "", "| question | points | result |", "|---|---|---|"]
    for q in r.questions:
        lines.append(f"| {q.name} | {points_text(q.score)}/{points_text(q.max_score)} | {q.status} |")
    notes = [(q, _feedback_line(q, ex.question(q.name).hint, secret)) for q in r.questions]
    notes = [(q, t) for q, t in notes if t]
    if notes:
        lines += ["", "## What to look at", ""]
        lines += [f"- **{q.name}** ({q.status}): {t}" for q, t in notes]
    lines += ["", "The grader ran your notebook in a fresh kernel with the instructor's tests, hidden ones "
                  "included; `course check` runs the visible ones the same way."]
    return "\n".join(lines) + "\n"


@dataclass
class Outputs:
    """Where a class's grades go: the CSV at ``csv``, the JSON and the summary beside it, and one feedback file
    per graded notebook under ``feedback`` (none if ``None``)."""

    csv: Path
    feedback: Path | None = None
    isolation: str = ""

    def paths(self) -> dict[str, Path]:
        out = {"csv": self.csv, "json": self.csv.with_suffix(".json"),
               "summary": self.csv.with_name(f"{self.csv.stem}_summary.csv")}
        return {**out, "feedback": self.feedback} if self.feedback is not None else out

    def update(self, subs: list[Submission], done: Submission | None = None) -> dict[str, Path]:
        """Rewrite the CSV, the JSON and the summary for ``subs``, each atomically, and write the feedback of
        ``done`` (``None``: of every graded notebook); the paths. Called as each notebook finishes, so that a
        stopped run keeps what was graded; rewriting the tables costs time linear in the class, each time."""
        paths, rows = self.paths(), summary(subs)
        detail = describe(self.isolation) if self.isolation else ""
        json_doc = {"isolation": self.isolation, "isolation_detail": detail, "summary": rows, "submissions": [
            {"student": s.student, "submission": s.rel, **(s.result.as_dict() if s.result else {"error": s.problem})}
            for s in subs]}
        write_atomic(paths["csv"], csv_text(subs))
        write_atomic(paths["json"], json.dumps(json_doc, indent=1))
        write_atomic(paths["summary"], summary_csv(rows))
        if self.feedback is not None:
            for s in subs if done is None else [done]:
                if s.result is not None:
                    write_atomic(self.feedback / s.student / f"{s.result.exercise}.md", feedback_markdown(s))
        return paths
