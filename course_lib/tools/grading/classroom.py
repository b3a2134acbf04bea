"""Grade a folder of submissions (``course grade FOLDER``): in parallel, into a CSV, a summary and feedback.

The outputs (``outputs``: where they go and what they hold; ``feedback``:
what a learner reads) are written outside the class's folder. With ``only``,
the named students' (or notebooks') submissions are graded again into an
earlier run's outputs, whose other rows stay as they were.

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
notebook finishes, rewrites the CSV, the JSON, the summary and the LMS
export and writes
that notebook's feedback, each file atomically (to a temporary name, then
renamed): a run that is stopped keeps every grade given so far, and lists
the rest as not graded yet. A worker that a submission managed to kill
(possible only without isolation) is replaced and that submission graded
once more.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from course_lib.tools.grading import checker, grade, workers
from course_lib.tools.grading.execute import longest_run
from course_lib.tools.grading.exercise import Catalog, Exercise, GradingError, notebook_from_bytes
from course_lib.tools.grading.feedback import as_markdown, feedback_markdown, hidden_snippets  # noqa: F401
from course_lib.tools.grading.grade import GradeResult, grade_notebook
from course_lib.tools.grading.isolation import Limits, detect
from course_lib.tools.grading.outputs import (  # noqa: F401
    Outputs, as_text, csv_text, read_earlier, summary, summary_csv, summary_text, write_atomic,
)

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


def select(subs: list[Submission], only: list[str], folder: Path) -> list[Submission]:
    """The submissions ``only`` names, each by its student id, or by its path (under ``folder``, or as given)."""
    chosen: list[Submission] = []
    for name in only:
        given = Path(name).resolve() if Path(name).is_file() else None
        hits = [s for s in subs if name in (s.student, s.rel) or s.path.resolve() == given]
        if not hits:
            known = sorted({s.student for s in subs})
            raise GradingError(f"--only {name}: no submission under {folder} is that student's or that notebook; "
                               f"the students are {', '.join(known[:20])}{', ...' if len(known) > 20 else ''}")
        chosen += [s for s in hits if s not in chosen]
    return chosen


def earlier_rows(doc: dict, catalog: Catalog) -> list[Submission]:
    """The rows of an earlier run's ``grades.json`` (``outputs.read_earlier``), as submissions."""
    rows = []
    for row in doc["submissions"]:
        sub = Submission(Path(row["submission"]), rel=row["submission"], student=row["student"],
                         exercise=catalog.exercises.get(row["exercise"]), problem=row.get("error", ""))
        try:
            sub.result = None if "error" in row else GradeResult.from_dict(row)
        except (KeyError, TypeError) as exc:
            raise GradingError(f"a row of the earlier grades.json ({sub.rel}) lacks {exc}: grade the whole "
                               "class again") from None
        rows.append(sub)
    return rows


def grade_folder(folder: Path | str, timeout: int = 60, solutions: Path | str | None = None,
                 progress: Callable[[Submission], None] | None = None, jobs: int = 1,
                 notebook_timeout: float | None = None, isolation: str | None = None,
                 hide: list[Path] | None = None, limits: Limits | None = None, outputs: Outputs | None = None,
                 deadline: float | None = None, only: list[str] | None = None) -> list[Submission]:
    """Grade every notebook under ``folder`` with ``jobs`` parallel workers (each notebook in its own kernel,
    within ``limits``, each worker within ``deadline`` seconds a notebook: default ``notebook_deadline``).
    ``outputs``: where the grades are written, updated as each notebook finishes. ``only``: grade just these
    students or notebooks (see ``select``), into the earlier rows of ``outputs``; the graded ones are returned."""
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
    refuse_collisions(subs)  # over the whole class, regrading or not: an id means one student
    if only is not None:
        subs = select(subs, only, folder)
        if outputs is not None:
            earlier = read_earlier(outputs.paths()["json"])
            outputs.kept = earlier_rows(earlier, catalog)
            outputs.roster = earlier.get("roster") if outputs.roster is None else outputs.roster
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
