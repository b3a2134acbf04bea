"""The feedback a learner is handed back: one markdown file per graded notebook, without the hidden tests.

Questions are named by their titles in the notebook. What a learner wrote
(the text of their errors, their file names) is escaped as markdown shows it;
a hidden test is never quoted: a hidden failure reads "passes the visible
tests but fails a hidden test", an error on the hidden inputs gives only the
exception's name, and a message holding a line or a string of the hidden
tests is withheld. A hint is shown where it can help: not when an earlier
cell (the imports, say) is what failed.
"""

from __future__ import annotations

import ast
import re
from typing import TYPE_CHECKING

from course_lib.tools.grading.checker import HIDDEN_FAILED
from course_lib.tools.grading.exercise import Exercise, is_test_cell
from course_lib.tools.grading.grade import QuestionResult, points_text

if TYPE_CHECKING:
    from course_lib.tools.grading.classroom import Submission


def hidden_snippets(ex: Exercise, shortest: int = 8) -> set[str]:
    """Text of the hidden tests that feedback must never quote: their lines and their string literals, less
    what the exercise shows anyway (its text, its setup, its visible tests)."""
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


def _feedback_line(q: QuestionResult, hint: str | None, secret: set[str]) -> str:
    """What a learner may read about one question: never the hidden tests' text."""
    if q.status == "passed":
        return ""
    if q.hidden and q.status == "failed":
        text = (f"{HIDDEN_FAILED}: a case the instructions or the docstring name (an edge case, an invalid "
                "input, another shape)")
    elif q.hidden:
        kind = q.message.split(" on the hidden")[0].removeprefix("your code raised ").strip()
        text = (f"your code raised {kind if _NAME.fullmatch(kind) else 'an exception'} on the hidden tests' "
                "inputs" if q.message.startswith("your code raised") else "an error on the hidden tests")
    else:
        text = q.message
    if any(s in text for s in secret):
        text = f"{q.status} (the message is withheld: it quotes the hidden tests)"
    helps = hint and hint not in text and q.status in ("failed", "error", "timeout") and not q.earlier
    return as_markdown(text) + (f"\n  - hint: {hint}" if helps else "")  # the hint is the instructor's markdown


def feedback_markdown(sub: Submission) -> str:
    """The per-student feedback for one graded notebook (markdown), without any hidden test's text."""
    r, ex = sub.result, sub.exercise
    assert r is not None and ex is not None
    secret = hidden_snippets(ex)
    lines = [f"# {r.exercise}: {points_text(r.score)} of {points_text(r.max_score)} points", "",
             f"Notebook: {as_markdown(sub.rel)}", "", "| question | points | result |", "|---|---|---|"]
    for q in r.questions:
        lines.append(f"| {as_markdown(q.heading)} | {points_text(q.score)}/{points_text(q.max_score)} | {q.status} |")
    notes = [(q, _feedback_line(q, ex.question(q.name).hint, secret)) for q in r.questions]
    notes = [(q, t) for q, t in notes if t]
    if notes:
        lines += ["", "## What to look at", ""]
        lines += [f"- **{as_markdown(q.heading)}** ({q.status}): {t}" for q, t in notes]
    lines += ["", "The grader ran your notebook in a fresh kernel with the instructor's tests, hidden ones "
                  "included; `course check` runs the visible ones the same way."]
    return "\n".join(lines) + "\n"
