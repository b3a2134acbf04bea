"""Graded exercises: make ``exercises/`` from ``solutions/``, grade learners' notebooks, release the course.

- ``exercise``: the authoring convention (nbgrader metadata, test cells in inputs / answers / checks);
- ``assign``: the learner's copy of a solutions notebook (``course assign``);
- ``checks``: ``raised``, ``check_types``, ``same`` and ``close``, which the test cells use;
- ``wire``: the answers a kernel sends out, as plain data (no pickle);
- ``isolation`` and ``sandbox``: where a learner's kernel runs, and what it cannot reach;
- ``limits``: the processes, memory, file size and disk a kernel may use, in every mode;
- ``runbook``: the notebook that kernel runs (the learner's cells, the instructor's tests);
- ``execute``: running cells in that kernel with time limits;
- ``checker``: the instructor's checks, run in the grader on the answers;
- ``forbid``: what a question's answer must not call;
- ``grade``: one notebook (``course grade``, ``course check``);
- ``classroom``: a folder of submissions in parallel, or some of them again (a regrade);
- ``outputs``: where a class's grades go (beside the submissions, never inside) and what they hold;
- ``feedback``: what a learner is handed back, questions named by their titles;
- ``lms``: the grades as an LMS imports them, with a roster of the LMS's ids;
- ``workers``: the worker processes that grade them, each notebook under a deadline;
- ``release``: the learner's copy of the course (``course release``), with ``readme``: what it says to learners;
- ``commands``: the CLI entry points.

Importing this package is cheap: the learner's kernel imports ``checks`` and
``wire`` from it, so the rest is loaded only when used.
"""

from __future__ import annotations

import importlib

_EXPORTS = {"Exercise": "exercise", "GradingError": "exercise", "Question": "exercise", "find_exercise": "exercise",
            "load_exercise": "exercise", "GradeResult": "grade", "QuestionResult": "grade",
            "grade_notebook": "grade"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"course_lib.tools.grading.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'course_lib.tools.grading' has no attribute {name!r}")
