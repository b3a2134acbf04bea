"""The grades as a learning-management system imports them (``grades_lms.csv``), and the roster that maps
a student's folder name to the id the LMS knows them by.

One row per graded question: ``student``, ``lms_id``, ``exercise``, ``question`` (its title in the
notebook), ``points``, ``max_points``, ``total``, ``max_total`` (the notebook's). An LMS's import picks the
columns it needs (``lms_id`` and ``total`` for one grade per exercise). A notebook that could not be graded
has no row here (``grades.csv`` says why). Due dates, late penalties and manual overrides are not
handled here: they belong to nbgrader or the LMS (docs/instructors.md).
"""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import TYPE_CHECKING

from course_lib.tools.grading.exercise import GradingError
from course_lib.tools.grading.grade import points_text

if TYPE_CHECKING:
    from course_lib.tools.grading.classroom import Submission

COLUMNS = ["student", "lms_id", "exercise", "question", "points", "max_points", "total", "max_total"]


def read_roster(path: Path) -> dict[str, str]:
    """``student -> id`` from a CSV with the columns ``student`` (the folder name) and ``id``."""
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            reader = csv.DictReader(f)
            if not {"student", "id"} <= set(reader.fieldnames or []):
                raise GradingError(f"the roster {path} needs a header with the columns student and id (the "
                                   f"student's folder name, the id the LMS knows them by); it has "
                                   f"{', '.join(reader.fieldnames or []) or 'none'}")
            rows = [(r["student"].strip(), (r["id"] or "").strip()) for r in reader if (r["student"] or "").strip()]
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise GradingError(f"cannot read the roster {path}: {exc}") from None
    roster: dict[str, str] = {}
    for student, ident in rows:
        if roster.get(student, ident) != ident:
            raise GradingError(f"the roster {path} gives {student} two ids ({roster[student]}, {ident}): keep one")
        roster[student] = ident
    return roster


def not_in_roster(subs: list[Submission], roster: dict[str, str] | None) -> list[str]:
    """The graded students the roster has no id for (their ``lms_id`` is left empty)."""
    if roster is None:
        return []
    return sorted({s.student for s in subs if s.result is not None and s.student not in roster})


def lms_csv(subs: list[Submission], roster: dict[str, str] | None = None) -> str:
    """The LMS export of the graded rows of ``subs`` (columns ``COLUMNS``)."""
    from course_lib.tools.grading.outputs import as_text

    out = io.StringIO()
    w = csv.writer(out)
    w.writerow(COLUMNS)
    for sub in subs:
        r = sub.result
        if r is None:
            continue
        ident = (roster or {}).get(sub.student, "")
        for q in r.questions:
            w.writerow(as_text([sub.student, ident, r.exercise, q.heading, points_text(q.score),
                                points_text(q.max_score), points_text(r.score), points_text(r.max_score)]))
    return out.getvalue()
