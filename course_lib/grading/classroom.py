"""Grade a folder of submissions into one CSV (``course grade FOLDER``).

Any layout works: ``submissions/alice/01_memory_anatomy.ipynb`` or
``submissions/alice_01_memory_anatomy.ipynb``; each notebook is matched to its
exercise by its metadata or its name. One row per notebook; a notebook that
cannot be graded still gets a row, with the reason in ``problem``.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from course_lib.grading.exercise import GradingError
from course_lib.grading.grade import GradeResult, grade_notebook, points_text


@dataclass
class Submission:
    """One notebook of the folder: its grade, or why it has none."""

    path: Path
    result: GradeResult | None = None
    problem: str = ""


def find_submissions(folder: Path) -> list[Path]:
    """Every ``.ipynb`` under ``folder``, without Jupyter's checkpoint copies."""
    return sorted(p for p in Path(folder).rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)


def grade_folder(folder: Path | str, timeout: int = 60, solutions: Path | str | None = None,
                 progress: Callable[[Submission], None] | None = None) -> list[Submission]:
    """Grade every notebook under ``folder``, one after the other (each in its own kernel)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"no such folder: {folder}")
    paths = find_submissions(folder)
    if not paths:
        raise GradingError(f"{folder} holds no .ipynb files to grade")
    done = []
    for path in paths:
        sub = Submission(path)
        try:
            sub.result = grade_notebook(path, timeout=timeout, solutions=solutions)
        except (GradingError, OSError) as exc:
            sub.problem = str(exc)
        done.append(sub)
        if progress:
            progress(sub)
    return done


def write_csv(subs: list[Submission], folder: Path, out: Path) -> Path:
    """Columns: submission, exercise, score, max_score, one per question (in first-seen order), problem."""
    questions: list[str] = []
    for sub in subs:
        for q in sub.result.questions if sub.result else []:
            if q.name not in questions:
                questions.append(q.name)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["submission", "exercise", "score", "max_score", *questions, "problem"])
        for sub in subs:
            name = sub.path.relative_to(folder).as_posix()
            if sub.result is None:
                w.writerow([name, "", "", "", *[""] * len(questions), sub.problem])
                continue
            by_name = {q.name: q for q in sub.result.questions}
            problems = "; ".join(f"{q.name}: {q.status}" for q in sub.result.questions if q.status != "passed")
            scores = [points_text(by_name[q].score) if q in by_name else "" for q in questions]
            w.writerow([name, sub.result.exercise, points_text(sub.result.score),
                        points_text(sub.result.max_score), *scores, problems])
    return out

