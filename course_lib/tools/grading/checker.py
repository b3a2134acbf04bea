"""The checks of an exercise, run in the grader on the answers a learner's kernel sent (never in the kernel).

``Checker`` replays the instructor's notebook in a fresh namespace of this
process: its plain code cells (the imports), and for each question the
inputs of its test cell, then its checks, with ``got`` bound to the decoded
answers. No learner code runs here: the learner's functions are not even
defined, so a check that called one would fail with a ``NameError``. The
random generators are reset before every inputs section, here and in the
kernel, so that both build the same inputs whatever the learner's cells did.
"""

from __future__ import annotations

import contextlib
import io
import sys
import traceback
from dataclasses import dataclass
from typing import Any

from course_lib.tools.grading.exercise import Exercise, GradingError, Part, Question
from course_lib.tools.grading.limits import Overtime, time_limit

CHECK_TIMEOUT: float = 120  # seconds for one question's checks (they compute references, on small inputs)


@dataclass
class Verdict:
    """The outcome of a question's checks: ``passed``, ``failed`` (an assert) or ``error`` (anything else)."""

    status: str
    message: str = ""
    hidden: bool = False   # whether what failed is a hidden test


def uses_torch(ex: Exercise) -> bool:
    """Whether the exercise's code mentions torch (then its generator is reset too; importing it costs seconds)."""
    return any("torch" in c.source for c in ex.notebook.cells if c.get("cell_type") == "code")


def reseed_source(torch_too: bool) -> str:
    """The line that resets the random generators before an inputs section (the kernel runs the same)."""
    line = "import random as _course_random; _course_random.seed(0)"
    return line + ("; import torch as _course_torch; _course_torch.manual_seed(0)" if torch_too else "")


HIDDEN_FAILED = "passes the visible tests but fails a hidden test"


def _message(lead: str, exc: BaseException) -> str:
    """``lead``, then the assert's own message where it has one."""
    text = str(exc).strip()
    return f"{lead}: {text}" if text else lead


class Checker:
    """The instructor's checks of ``ex`` (``hidden=False``: the visible ones only, as ``course check`` runs)."""

    def __init__(self, ex: Exercise, hidden: bool = True) -> None:
        self.ex, self.hidden = ex, hidden
        self.torch = uses_torch(ex)

    def _run(self, part: Part, which: str, q: Question, ns: dict, got: Any) -> Verdict | None:
        hidden = which == "hidden"
        exec(compile(reseed_source(self.torch), "<reseed>", "exec"), ns)
        try:
            exec(part.inputs.code(f"<{q.name} {which} inputs>"), ns)
        except Exception as exc:  # the instructor's inputs do not depend on the learner: a broken test
            raise GradingError(f"{self.ex.name}: the {which} inputs of {q.name} raised "
                               f"{type(exc).__name__}: {exc}") from exc
        ns["got"] = got
        try:
            exec(part.checks.code(f"<{q.name} {which} checks>"), ns)
        except AssertionError as exc:
            return Verdict("failed", _message(HIDDEN_FAILED if hidden else "a test failed", exc), hidden)
        except Exception as exc:  # the answers are plain data, but maybe not what the checks expect
            lead = "passes the visible tests but a hidden test" if hidden else "a test"
            return Verdict("failed", f"{lead} could not use your answers: {type(exc).__name__}: {exc}", hidden)
        return None

    def check(self, answers: dict[str, Any]) -> dict[str, Verdict]:
        """Verdicts for the questions in ``answers`` (question name -> the decoded ``got``)."""
        ns: dict[str, Any] = {"__name__": "__course_checks__"}
        out: dict[str, Verdict] = {}
        sink = io.StringIO()
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            for kind, item in self.ex.steps():
                if kind == "setup":
                    try:
                        exec(compile(item, f"<{self.ex.name} setup>", "exec"), ns)
                    except Exception as exc:
                        raise GradingError(f"{self.ex.name}: a setup cell raised {type(exc).__name__}: {exc}\n"
                                           f"{traceback.format_exc(limit=3)}") from exc
                    continue
                q: Question = item  # type: ignore[assignment]
                if q.name not in answers or q.visible is None:
                    continue
                got = answers[q.name]
                try:
                    with time_limit(CHECK_TIMEOUT):
                        verdict = self._run(q.visible, "visible", q, ns, got)
                        if verdict is None and self.hidden and q.hidden is not None:
                            verdict = self._run(q.hidden, "hidden", q, ns, got)
                except Overtime:
                    verdict = Verdict("error", f"the checks ran past {CHECK_TIMEOUT:g} s on these answers")
                out[q.name] = verdict or Verdict("passed")
                sys.stdout.flush()
        return out
