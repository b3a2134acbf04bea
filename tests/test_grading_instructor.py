"""The instructor's side of grading: feedback a learner can act on, outputs kept apart from the submissions,
regrading one student in place, and the LMS export.

A tiny exercise with an imports cell and a heading above each question, built in a temporary folder; each
graded notebook costs a kernel start of a second or two.
"""

from __future__ import annotations

import argparse
import csv
import json
import stat
from pathlib import Path

import nbformat
import pytest
from test_grading import ADD_ONE, ADD_ONE_TEST, SHORT, _cell, _notebook

from course_lib.tools import cli
from course_lib.tools.grading import assign, commands, lms
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


def _args(folder: Path, **kw) -> argparse.Namespace:
    base = dict(notebook=str(folder), timeout=SHORT, json=False, csv=None, feedback=None, jobs=None, only=None,
                roster=None, notebook_timeout=60)
    return argparse.Namespace(**{**base, **kw})


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


# ----- a class: outputs apart and private, regrading one student, the LMS export ---------------------------


@pytest.fixture(scope="module")
def graded(titled, tmp_path_factory) -> dict:
    """A class of two (alice right, bob wrong on q2) graded with the defaults and a roster that lacks bob."""
    base = tmp_path_factory.mktemp("class")
    folder = base / "submissions"
    _learner(titled, folder / "alice" / "91_titled.ipynb")
    _learner(titled, folder / "bob" / "91_titled.ipynb", q2="    return x")
    roster = base / "roster.csv"
    roster.write_text("student,id\nalice,A-17\n")
    args = _args(folder, solutions=titled["solutions"], jobs=2, roster=str(roster))
    assert commands.grade(args) == 0
    return {"folder": folder, "out": base / "submissions-grades", "args": args}


def test_grades_are_written_beside_the_submissions_privately_one_folder_per_student(graded, capsys):
    out = graded["out"]
    assert sorted(p.relative_to(graded["folder"]).as_posix() for p in graded["folder"].rglob("*")) == [
        "alice", "alice/91_titled.ipynb", "bob", "bob/91_titled.ipynb"], "nothing is written among the submissions"
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert files == ["feedback/alice/91_titled.md", "feedback/bob/91_titled.md", "grades.csv", "grades.json",
                     "grades_lms.csv", "grades_summary.csv"]
    for path in [out, *out.rglob("*")]:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == (0o700 if path.is_dir() else 0o600), f"{path} has mode {oct(mode)}"
    assert "1 of 3 points" in (out / "feedback" / "bob" / "91_titled.md").read_text()


def test_outputs_inside_the_submissions_are_refused(graded, capsys):
    folder = graded["folder"]
    for option in (["--csv", str(folder / "grades.csv")], ["--feedback", str(folder / "alice" / "fb")]):
        assert cli.main(["grade", str(folder), *option]) == 2
        err = capsys.readouterr().err
        assert "inside the submissions folder" in err and "submissions-grades" in err, err
    assert not (folder / "grades.csv").exists() and not (folder / "alice" / "fb").exists()


def test_an_option_the_single_notebook_mode_ignores_is_an_error(graded, capsys):
    notebook = graded["folder"] / "alice" / "91_titled.ipynb"
    assert cli.main(["grade", str(notebook), "--csv", str(graded["out"] / "x.csv")]) == 2
    err = capsys.readouterr().err
    assert "--csv works with a folder of submissions" in err and "--only STUDENT" in err, err
    assert not (graded["out"] / "x.csv").exists()


def test_the_lms_export_has_a_row_per_question_with_the_rosters_ids(graded):
    rows = list(csv.DictReader((graded["out"] / "grades_lms.csv").read_text().splitlines()))
    assert list(rows[0]) == lms.COLUMNS
    got = [(r["student"], r["lms_id"], r["question"], r["points"], r["max_points"], r["total"]) for r in rows]
    assert got == [("alice", "A-17", TITLES["q1_add_one_test"], "1", "1", "3"),
                   ("alice", "A-17", TITLES["q2_double_test"], "2", "2", "3"),
                   ("bob", "", TITLES["q1_add_one_test"], "1", "1", "1"),
                   ("bob", "", TITLES["q2_double_test"], "0", "2", "1")]


def test_a_roster_without_its_columns_is_a_clear_error(tmp_path):
    roster = tmp_path / "roster.csv"
    roster.write_text("name,number\nalice,17\n")
    with pytest.raises(ValueError, match="needs a header with the columns student and id"):
        lms.read_roster(roster)


def test_one_student_is_regraded_in_place(graded, titled, capsys):
    folder, out = graded["folder"], graded["out"]
    before = {p: p.read_bytes() for p in (out / "grades.csv", out / "feedback" / "alice" / "91_titled.md")}
    alice_json = json.loads((out / "grades.json").read_text())["submissions"][0]
    with pytest.raises(ValueError, match="--only carol: no submission"):
        commands.grade(_args(folder, solutions=titled["solutions"], only=["carol"]))
    _learner(titled, folder / "bob" / "91_titled.ipynb")  # bob's corrected notebook
    assert commands.grade(_args(folder, solutions=titled["solutions"], only=["bob"])) == 0
    assert "1 of 1 notebooks graded again" in capsys.readouterr().err
    rows = {r["student"]: r for r in csv.DictReader((out / "grades.csv").read_text().splitlines())}
    old = {r["student"]: r for r in csv.DictReader(before[out / "grades.csv"].decode().splitlines())}
    assert rows["alice"] == old["alice"] and (old["bob"]["score"], rows["bob"]["score"]) == ("1", "3")
    doc = json.loads((out / "grades.json").read_text())
    assert doc["submissions"][0] == alice_json and doc["submissions"][1]["score"] == 3
    assert {r["question"]: r["pass_rate"] for r in doc["summary"]}["q2_double_test"] == 1
    assert "3 of 3 points" in (out / "feedback" / "bob" / "91_titled.md").read_text()
    assert (out / "feedback" / "alice" / "91_titled.md").read_bytes() == before[out / "feedback" / "alice" / "91_titled.md"]
    assert [r["lms_id"] for r in csv.DictReader((out / "grades_lms.csv").read_text().splitlines())][:2] == ["A-17"] * 2


def test_regrading_needs_an_earlier_run(titled, tmp_path):
    folder = tmp_path / "class"
    _learner(titled, folder / "dana" / "91_titled.ipynb")
    with pytest.raises(ValueError, match="grade the whole class first"):
        commands.grade(_args(folder, solutions=titled["solutions"], only=["dana"]))
    assert not (tmp_path / "class-grades" / "grades.csv").exists()


# ----- the instructor's page ---------------------------------------------------------------------------------


def test_the_instructors_page_is_linked_and_names_only_options_course_grade_has():
    import re

    root = Path(__file__).resolve().parent.parent
    assert "](instructors.md)" in (root / "docs" / "grading.md").read_text()
    text = re.sub(r"`nbgrader[^`]*`", "", (root / "docs" / "instructors.md").read_text())  # nbgrader's own options
    subparsers = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    known = {o for a in subparsers.choices["grade"]._actions for o in a.option_strings}
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", text))
    assert {"--only", "--csv", "--feedback", "--roster"} <= named and named <= known, named - known
