"""Graded exercises: make ``exercises/`` from ``solutions/`` and grade learners' notebooks.

- ``exercise``: the authoring convention (nbgrader metadata) and finding a notebook's exercise;
- ``assign``: the learner's copy of a solutions notebook (``course assign``);
- ``execute``: running cells in a separate kernel with time limits;
- ``grade``: re-inserting the instructor's tests and scoring each question (``course grade``, ``course check``);
- ``classroom``: a folder of submissions into one CSV;
- ``commands``: the CLI entry points.
"""

from course_lib.grading.exercise import Exercise, GradingError, Question, find_exercise, load_exercise
from course_lib.grading.grade import GradeResult, QuestionResult, grade_notebook

__all__ = ["Exercise", "GradeResult", "GradingError", "Question", "QuestionResult", "find_exercise",
           "grade_notebook", "load_exercise"]
