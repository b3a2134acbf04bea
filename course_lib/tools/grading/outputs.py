"""Where a class's grades go, and what they hold: a CSV, a JSON, a summary, an LMS export, and feedback.

By default everything goes to ``<submissions>-grades/`` beside the class's
folder, never inside it: a folder handed back to the class must show no one
else's grade. Files are written private (``0o600``, folders ``0o700``), each
atomically (a temporary name, then a rename), after every graded notebook.
The feedback is one folder per student (``feedback/<student>/``) holding only
that student's files, to hand back as it is. A regrade (``--only``) keeps the
other rows of the earlier ``grades.json`` as they were.

Everything a learner chose (folder and file names, the text of their errors)
is data: a CSV cell that a spreadsheet would read as a formula gets a leading
apostrophe.
"""

from __future__ import annotations

import csv
import io
import json
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from course_lib.tools.grading import lms
from course_lib.tools.grading.exercise import GradingError
from course_lib.tools.grading.feedback import feedback_markdown
from course_lib.tools.grading.grade import points_text
from course_lib.tools.grading.isolation import describe

if TYPE_CHECKING:
    from course_lib.tools.grading.classroom import Submission

FILE_MODE, FOLDER_MODE = 0o600, 0o700


def default_csv(folder: Path) -> Path:
    """Where a class's CSV goes unless told: ``<folder>-grades/grades.csv``, beside the submissions."""
    folder = Path(folder).resolve()
    return folder.parent / f"{folder.name}-grades" / "grades.csv"


def refuse_inside(folder: Path, *outputs: Path | None) -> None:
    """Raise ``GradingError`` if an output would land inside the submissions ``folder``."""
    inside = Path(folder).resolve()
    for out in outputs:
        if out is not None and (out.resolve() == inside or inside in out.resolve().parents):
            raise GradingError(
                f"{out} is inside the submissions folder {folder}: handed back, that folder would show every "
                f"student every grade. Write the grades elsewhere (the default is {default_csv(folder)}), or "
                "leave out --csv and --feedback")


def private_dir(path: Path) -> Path:
    """``path`` as a folder, each level this creates readable by its owner alone."""
    missing = [p for p in [path, *path.parents] if not p.exists()]
    for p in reversed(missing):
        p.mkdir(mode=FOLDER_MODE, exist_ok=True)
        os.chmod(p, FOLDER_MODE)
    return path


def write_atomic(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` (mode ``0o600``) through a temporary file in the same folder, then rename it
    into place."""
    private_dir(path.parent)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    os.fchmod(fd, FILE_MODE)  # a leftover temporary file keeps its mode through O_CREAT
    with open(fd, "w", encoding="utf-8", newline="") as f:
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
    """The summary as CSV: exercise, question, graded, mean_score, max_score, pass_rate."""
    out = io.StringIO()
    w = csv.DictWriter(out, fieldnames=["exercise", "question", "graded", "mean_score", "max_score", "pass_rate"])
    w.writeheader()
    w.writerows(dict(zip(r, as_text(list(r.values())))) for r in rows)
    return out.getvalue()


@dataclass
class Outputs:
    """Where a class's grades go: the CSV at ``csv``, the JSON, the summary and the LMS export beside it, and one
    feedback folder per student under ``feedback`` (none if ``None``). ``kept``: rows of an earlier run that
    this one does not grade again; ``roster``: student -> the id the LMS knows them by."""

    csv: Path
    feedback: Path | None = None
    isolation: str = ""
    kept: list = field(default_factory=list)
    roster: dict[str, str] | None = None

    def paths(self) -> dict[str, Path]:
        """Each output's path: csv, json, summary, lms, and feedback (a folder) when there is one."""
        out = {"csv": self.csv, "json": self.csv.with_suffix(".json"),
               "summary": self.csv.with_name(f"{self.csv.stem}_summary.csv"),
               "lms": self.csv.with_name(f"{self.csv.stem}_lms.csv")}
        return {**out, "feedback": self.feedback} if self.feedback is not None else out

    def rows(self, subs: list[Submission]) -> list[Submission]:
        """The class's rows: the kept ones, each replaced where ``subs`` grades the same notebook, then the rest
        of ``subs``."""
        fresh = {s.rel: s for s in subs}
        return [fresh.pop(k.rel, k) for k in self.kept] + list(fresh.values())

    def update(self, subs: list[Submission], done: Submission | None = None) -> dict[str, Path]:
        """Rewrite the CSV, the JSON, the summary and the LMS export for ``subs`` (with the kept rows), each
        atomically, and write the feedback of ``done`` (``None``: of every graded notebook of ``subs``); the
        paths. Called as each notebook finishes, so that a stopped run keeps what was graded; rewriting the
        tables costs time linear in the class, each time."""
        paths, every = self.paths(), self.rows(subs)
        rows = summary(every)
        detail = describe(self.isolation) if self.isolation else ""
        json_doc = {"isolation": self.isolation, "isolation_detail": detail, "roster": self.roster,
                    "summary": rows, "submissions": [submission_dict(s) for s in every]}
        write_atomic(paths["csv"], csv_text(every))
        write_atomic(paths["json"], json.dumps(json_doc, indent=1))
        write_atomic(paths["summary"], summary_csv(rows))
        write_atomic(paths["lms"], lms.lms_csv(every, self.roster))
        if self.feedback is not None:
            private_dir(self.feedback)
            for s in subs if done is None else [done]:
                if s.result is not None:
                    write_atomic(self.feedback / s.student / f"{s.result.exercise}.md", feedback_markdown(s))
        return paths


def submission_dict(sub: Submission) -> dict:
    """One row of ``grades.json``: student, submission, then the result (``GradeResult.as_dict``) or the error
    and the exercise."""
    if sub.result is not None:
        return {"student": sub.student, "submission": sub.rel, **sub.result.as_dict()}
    return {"student": sub.student, "submission": sub.rel, "exercise": sub.exercise.name if sub.exercise else "",
            "error": sub.problem}


def read_earlier(path: Path) -> dict:
    """The ``grades.json`` of an earlier run, to regrade into; ``GradingError`` when there is none to read."""
    if not path.is_file():
        raise GradingError(f"--only grades into a class's earlier outputs, but {path} does not exist: grade the "
                           "whole class first, or point --csv at the grades.csv of that run")
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        if not all("student" in s and "submission" in s and "exercise" in s for s in doc["submissions"]):
            raise KeyError("exercise")
        return doc
    except (ValueError, KeyError, TypeError) as exc:
        raise GradingError(f"{path} is not a grades.json this version of `course grade` can regrade into "
                           f"({type(exc).__name__}: {exc}): grade the whole class again") from None
