"""The instructor's side of grading: feedback a learner can act on.

A tiny exercise with an imports cell and a heading above each question, built in a temporary folder; each
graded notebook costs a kernel start of a second or two.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import nbformat
import pytest
from test_grading import ADD_ONE, ADD_ONE_TEST, SHORT, _cell, _notebook

from course_lib.tools.grading import assign, commands
from course_lib.tools.grading.classroom import Submission, feedback_markdown
from course_lib.tools.grading.exercise import Catalog, grade_id
from course_lib.tools.grading.grade import grade_notebook

DOUBLE = '''def double(x: int) -> int:
    """``2 * x``, through ``math.fsum``."""
    ### BEGIN SOLUTION
    # HINT: add x to itself.
    return int(math.fsum([x, x]))
    ### END SOLUTION'''
DOUBLE_TEST = '''### ANSWERS
got = {"3": double(3)}
### CHECKS
assert got["3"] == 6, "double(3) should be 6"'''
TITLES = {"q1_add_one_test": "Question 1: add one", "q2_double_test": "Question 2: double"}


@pytest.fixture(scope="module")
def titled(tmp_path_factory) -> dict[str, Path]:
    """``solutions/91_titled.ipynb``: an imports cell, then two questions under headings, and its exercise."""
    root = tmp_path_factory.mktemp("titled")
    src, out = root / "solutions", root / "exercises"
    src.mkdir()
    md = nbformat.v4.new_markdown_cell
    cells = [_cell("import math"), md("## Question 1 (1 point): add one\n\nWrite `add_one`."),
             _cell(ADD_ONE, "q1_add_one"), _cell(ADD_ONE_TEST, "q1_add_one_test", 1),
             md("## Question 2 (2 points): double"), _cell(DOUBLE, "q2_double"), _cell(DOUBLE_TEST, "q2_double_test", 2)]
    nbformat.write(_notebook(cells), src / "91_titled.ipynb")
    assign.write_exercises(src, out)
    return {"solutions": src, "exercise": out / "91_titled.ipynb", "root": root}


def _learner(titled: dict[str, Path], path: Path, q1: str = "    return x + 1",
             q2: str = "    return int(math.fsum([x, x]))", imports: str = "import math") -> Path:
    """A copy of the exercise at ``path`` with these bodies and this imports cell."""
    nb = nbformat.read(titled["exercise"], as_version=4)
    for cell in nb.cells:
        stub = cell.source.split("    # YOUR CODE HERE")[0]
        if grade_id(cell) in ("q1_add_one", "q2_double"):
            cell.source = stub + (q1 if grade_id(cell) == "q1_add_one" else q2)
        elif cell.source == "import math":
            cell.source = imports
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)
    return path


# ----- feedback a learner can act on ---------------------------------------------------------------------


def test_an_imports_typo_is_named_as_the_first_thing_to_fix(titled, capsys):
    path = _learner(titled, titled["root"] / "typo" / "91_titled.ipynb", imports="import mathh")
    ex = Catalog(titled["solutions"]).exercises["91_titled"]
    result = grade_notebook(path, timeout=SHORT, exercise=ex)
    q1, q2 = result.questions
    cause = "your imports cell, code cell 1 (import mathh)"  # cell 2 of the notebook, but its first code cell
    assert q1.message.startswith(f"{cause} raised ModuleNotFoundError: No module named 'mathh': fix it first"), q1
    assert q2.message.startswith(f"{cause} failed (ModuleNotFoundError: No module named 'mathh'): fix it first"), q2
    assert "NameError" in q2.message and q1.earlier and q2.earlier and result.score == 0
    text = feedback_markdown(Submission(path, rel="typo/91_titled.ipynb", exercise=ex, result=result))
    assert "hint" not in text, f"the functions' hints do not apply to an imports cell:\n{text}"
    assert f"**{TITLES['q2_double_test']}** (error)" in text and "q2_double_test" not in text
    assert commands.check(argparse.Namespace(notebook=str(path), timeout=SHORT, solutions=titled["solutions"])) == 1
    out = capsys.readouterr().out
    assert f"[error] {TITLES['q2_double_test']} (2 points): {cause} failed" in out and "hint" not in out


def test_a_wrong_function_still_gets_its_hint_under_its_title(titled):
    path = _learner(titled, titled["root"] / "wrong" / "91_titled.ipynb", q2="    return x")
    ex = Catalog(titled["solutions"]).exercises["91_titled"]
    result = grade_notebook(path, timeout=SHORT, exercise=ex)
    assert [(q.title, q.status) for q in result.questions] == [(TITLES["q1_add_one_test"], "passed"),
                                                               (TITLES["q2_double_test"], "failed")]
    assert not result.questions[1].earlier
    text = feedback_markdown(Submission(path, rel="wrong/91_titled.ipynb", exercise=ex, result=result))
    assert f"| {TITLES['q1_add_one_test']} | 1/1 | passed |" in text and "hint: add x to itself." in text
    assert commands.format_result(result).splitlines()[1].split()[:3] == ["Question", "1:", "add"]
