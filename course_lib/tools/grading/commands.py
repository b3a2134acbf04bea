"""The ``course assign``, ``grade``, ``check`` and ``release`` commands (called from ``course_lib.tools.cli``).

Each takes the parsed arguments and returns the exit status. ``grade`` exits
0 whenever grading completed, whatever the score; a notebook that cannot be
graded raises ``GradingError`` (a ``ValueError``), which the CLI prints and
turns into exit status 2. A folder's grading stopped with Ctrl-C exits 130,
with every grade given until then written out.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
from pathlib import Path

from course_lib.tools.grading.exercise import EXERCISES, Catalog, GradingError, read_notebook
from course_lib.tools.grading.grade import GradeResult, grade_notebook, points_text

STATUS_WORD = {"passed": "ok", "failed": "failed", "error": "error", "timeout": "timeout", "rejected": "rejected"}
ALL_VISIBLE_PASS = "visible tests passed; hidden tests check more"


def _solutions(args: argparse.Namespace) -> Path | None:
    return getattr(args, "solutions", None)  # None: $COURSE_SOLUTIONS, else solutions/


def _shown(path: Path) -> str:
    """``path`` relative to the working folder when it lies below it (as a learner would type it)."""
    try:
        return os.path.relpath(path) if Path.cwd() in path.resolve().parents else str(path)
    except ValueError:  # another drive (Windows)
        return str(path)


def missing_notebook(path: Path, command: str, exercises: Path = EXERCISES) -> FileNotFoundError:
    """The error for a notebook path that is not there: what was wrong, and the exercises that are."""
    folder = _shown(exercises)
    names = sorted(p.name for p in exercises.glob("*.ipynb")) if exercises.is_dir() else []
    why = "is a folder" if path.is_dir() else "does not exist" if not path.exists() else "is not a file"
    lines = [f"{path} {why} (looked for it from {Path.cwd()}). `course {command}` takes a notebook file."]
    if not names:
        lines.append(f"There are no exercise notebooks in {folder}{os.sep}.")
        return FileNotFoundError("\n".join(lines))
    close = [n for n in names if n.startswith(path.name)] if path.name else []
    close = close if len(close) == 1 else difflib.get_close_matches(path.name, names, n=1, cutoff=0.6)
    if close:
        lines.append(f"Did you mean {os.path.join(folder, close[0])}?")
    lines.append(f"The exercises are in {folder}{os.sep}:")
    lines += [f"  {name}" for name in names]
    lines.append(f"For example: course {command} {os.path.join(folder, names[0])}")
    return FileNotFoundError("\n".join(lines))


def assign(args: argparse.Namespace) -> int:
    """Regenerate ``exercises/`` from ``solutions/``; with ``--check``, only report what is stale."""
    from course_lib.tools.grading import assign as gen

    if getattr(args, "check", False):
        stale = gen.stale(_solutions(args))
        if stale:
            print("exercises/ is out of date; run `course assign` and commit the result:", file=sys.stderr)
            for name in stale:
                print(f"  {name}", file=sys.stderr)
            return 1
        print("exercises/ is up to date")
        return 0
    touched = gen.write_exercises(_solutions(args))
    for path in touched:
        print(f"{'wrote' if path.exists() else 'deleted'} {path}")
    if not touched:
        print("exercises/ was already up to date")
    return 0


def format_result(result: GradeResult) -> str:
    """A plain-text score table for one notebook, its questions named by their titles."""
    width = max(len(q.heading) for q in result.questions)
    lines = [f"{result.notebook} (exercise {result.exercise})"]
    for q in result.questions:
        pts = f"{points_text(q.score)}/{points_text(q.max_score)}"
        lines.append(f"  {q.heading:<{width}}  {pts:>5}  {q.status:<8}  {q.message}".rstrip())
    lines.append(f"score: {points_text(result.score)}/{points_text(result.max_score)}")
    return "\n".join(lines)


def grade(args: argparse.Namespace) -> int:
    """Grade one notebook, or every notebook in a folder (a CSV, a summary, feedback files)."""
    target = Path(args.notebook)
    if target.is_dir():
        return _grade_folder(target, args)
    if not target.is_file():
        raise missing_notebook(target, "grade")
    refuse_folder_options(args, target)
    path = target
    ex = Catalog(_solutions(args)).find(read_notebook(path), path)
    from course_lib.tools.grading import isolation

    print(f"[course] isolation: {isolation.describe(isolation.detect())}", file=sys.stderr, flush=True)
    result = grade_notebook(path, timeout=args.timeout, exercise=ex,
                            total_timeout=getattr(args, "notebook_timeout", None), hide=[path.resolve().parent])
    print(json.dumps(result.as_dict(), indent=1) if args.json else format_result(result))
    return 0


FOLDER_OPTIONS = {"csv": "--csv", "feedback": "--feedback", "only": "--only", "roster": "--roster", "jobs": "-j"}


def refuse_folder_options(args: argparse.Namespace, notebook: Path) -> None:
    """Raise ``GradingError`` for an option that only grading a folder uses (it would do nothing here)."""
    given = [flag for key, flag in FOLDER_OPTIONS.items() if getattr(args, key, None) is not None]
    if given:
        raise GradingError(
            f"{', '.join(given)} work{'s' if len(given) == 1 else ''} with a folder of submissions; grading the one "
            f"notebook {notebook} writes no file and only prints its grade. To grade one student into a class's "
            "outputs, name the class's folder: course grade SUBMISSIONS --only STUDENT (see docs/instructors.md)")


def _grade_folder(folder: Path, args: argparse.Namespace) -> int:
    from course_lib.tools.grading import isolation, lms
    from course_lib.tools.grading.classroom import Submission, grade_folder, summary, summary_text
    from course_lib.tools.grading.outputs import Outputs, default_csv, refuse_inside

    csv_path = Path(args.csv) if getattr(args, "csv", None) else default_csv(folder)
    feedback = getattr(args, "feedback", None)
    feedback_dir = None if feedback == "none" else Path(feedback) if feedback else csv_path.parent / "feedback"
    refuse_inside(folder, csv_path, feedback_dir)
    roster = lms.read_roster(Path(args.roster)) if getattr(args, "roster", None) else None
    jobs = 1 if getattr(args, "jobs", None) is None else args.jobs
    only = getattr(args, "only", None)
    mode = isolation.detect()
    print(f"[course] isolation: {isolation.describe(mode)}", file=sys.stderr, flush=True)
    print(f"[course] {jobs} worker(s)", file=sys.stderr, flush=True)

    finished: list[Submission] = []

    def progress(sub: Submission) -> None:
        finished.append(sub)
        if sub.result:
            what = f"{points_text(sub.result.score)}/{points_text(sub.result.max_score)}"
        else:
            what = f"not graded: {sub.problem}"
        print(f"[course] {sub.rel}: {what}", file=sys.stderr, flush=True)

    outputs = Outputs(csv_path, feedback_dir, isolation=mode, roster=roster)
    try:
        subs = grade_folder(folder, timeout=args.timeout, solutions=_solutions(args), progress=progress,
                            jobs=jobs, notebook_timeout=getattr(args, "notebook_timeout", None),
                            hide=[csv_path.parent, *([feedback_dir] if feedback_dir else [])], outputs=outputs,
                            only=only)
    except KeyboardInterrupt:
        done = sum(s.result is not None for s in finished)
        print(f"\n[course] stopped: the {done} notebook(s) graded so far are written to {csv_path}; the others "
              "are listed as not graded yet. Grade again to finish.", file=sys.stderr)
        return 130
    out = outputs.paths()
    rows = summary(outputs.rows(subs))
    if args.json:
        print(json.dumps([{"student": s.student, **(s.result.as_dict() if s.result else
                                                    {"notebook": str(s.path), "error": s.problem})}
                          for s in subs], indent=1))
    elif rows:
        print(summary_text(rows))
    failed = [s for s in subs if s.result is None]
    where = ", ".join(str(p) for p in out.values())
    print(f"[course] {len(subs) - len(failed)} of {len(subs)} notebooks graded{' again' if only else ''}; "
          f"written: {where}", file=sys.stderr)
    if feedback_dir is not None:
        print(f"[course] to hand back: each folder {feedback_dir}{os.sep}<student>{os.sep} holds only that student's "
              "feedback", file=sys.stderr)
    missing = lms.not_in_roster(outputs.rows(subs), outputs.roster)
    if missing:
        print(f"[course] not in the roster (no lms_id in {out['lms'].name}): {', '.join(missing)}", file=sys.stderr)
    return 1 if failed else 0


def check(args: argparse.Namespace) -> int:
    """Run a learner's notebook against the visible tests, the way the grader runs them, with hints."""
    path = Path(args.notebook)
    if not path.is_file():
        raise missing_notebook(path, "check")
    ex = Catalog(_solutions(args), public=True).find(read_notebook(path), path)
    print(f"Checking {path} against the visible tests of exercise {ex.name} ...", flush=True)
    result = grade_notebook(path, timeout=args.timeout, exercise=ex, hidden=False, isolation="none")
    print()
    for q in result.questions:
        hint = ex.question(q.name).hint
        word = "to do" if q.message.startswith("not implemented") else STATUS_WORD[q.status]
        head = f"  [{word}] {q.heading} ({points_text(q.max_score)} point{'' if q.max_score == 1 else 's'})"
        print(head if q.status == "passed" else f"{head}: {q.message}")
        # a hint helps with the function, not with another cell that raised or a dead kernel
        helps = not q.earlier and (q.status in ("failed", "timeout") or q.message.startswith("your code raised"))
        if helps and hint and hint not in q.message:
            print(f"      hint: {hint}")
    passed = sum(q.status == "passed" for q in result.questions)
    print(f"\n{passed} of {len(result.questions)} questions pass their visible tests.")
    if passed == len(result.questions):
        print(f"All {ALL_VISIBLE_PASS}: the grader's hidden tests try other inputs and edge cases.")
    else:
        print("Fix the first one that is not ok, rerun its cells, then run `course check` again.")
    return 0 if passed == len(result.questions) else 1


def release(args: argparse.Namespace) -> int:
    """Write the learner's copy of the course to ``DEST`` (no solutions, no hidden tests)."""
    from course_lib.tools.grading.release import write_release

    report = write_release(Path(args.dest), _solutions(args), force=getattr(args, "force", False))
    print(f"[course] learner's copy in {report['dest']}: {report['files']} files; no solutions, "
          f"no hidden tests (checked: {report['checked_lines']} hidden-test lines absent)")
    return 0
