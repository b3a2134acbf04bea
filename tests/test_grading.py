"""The graded-exercise system: exercises/ is generated from solutions/, and the grader scores fairly.

The first tests run over every ``solutions/*.ipynb`` (chapters added later are
covered without a change here). The rest use a tiny two-question exercise
built in a temporary folder, so that each failure mode (a hang, a dead
kernel, an edited test) costs a kernel start of a second or two.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

from course_lib import cli
from course_lib.grading import assign, commands
from course_lib.grading.exercise import GradingError, grade_id, is_test_cell, load_exercise, parse_exercise
from course_lib.grading.execute import RECOVER_TIMEOUT
from course_lib.grading.grade import STATUSES, grade_notebook

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))
SHORT = 5  # seconds per cell in the failure tests: learner code here is instant unless it hangs

# ----- a tiny exercise -------------------------------------------------------------------------

ADD_ONE = '''def add_one(x: int) -> int:
    """``x + 1``."""
    ### BEGIN SOLUTION
    # HINT: one plus sign is enough.
    return x + 1
    ### END SOLUTION'''
ADD_ONE_TEST = '''assert add_one(1) == 2, "add_one(1) should be 2"
### BEGIN HIDDEN TESTS
assert add_one(-1) == 0, "add_one(-1) should be 0"
### END HIDDEN TESTS'''
DOUBLE = '''def double(x: int) -> int:
    """``2 * x``."""
    ### BEGIN SOLUTION
    return 2 * x
    ### END SOLUTION'''
DOUBLE_TEST = '''assert double(3) == 6, "double(3) should be 6"
### BEGIN HIDDEN TESTS
assert double(0) == 0, "double(0) should be 0"
### END HIDDEN TESTS'''


def _cell(source: str, gid: str | None = None, points: int | None = None):
    cell = nbformat.v4.new_code_cell(source)
    if gid and points is None:
        cell.metadata["nbgrader"] = {"solution": True, "grade": False, "locked": False, "grade_id": gid,
                                     "schema_version": 3}
    elif gid:
        cell.metadata["nbgrader"] = {"grade": True, "solution": False, "locked": True, "points": points,
                                     "grade_id": gid, "schema_version": 3}
    return cell


def _notebook(cells: list) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_markdown_cell("# A tiny exercise"), *cells]
    return nb


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    """``solutions/90_tiny.ipynb`` (q1 worth 1 point, q2 worth 2) and its generated exercise."""
    root = tmp_path_factory.mktemp("tiny")
    src, out = root / "solutions", root / "exercises"
    src.mkdir()
    cells = [_cell("import os"), _cell(ADD_ONE, "q1_add_one"), _cell(ADD_ONE_TEST, "q1_add_one_test", 1),
             _cell(DOUBLE, "q2_double"), _cell(DOUBLE_TEST, "q2_double_test", 2)]
    nbformat.write(_notebook(cells), src / "90_tiny.ipynb")
    assign.write_exercises(src, out)
    return {"solutions": src, "solution": src / "90_tiny.ipynb", "exercise": out / "90_tiny.ipynb", "root": root}


def _learner(tiny: dict[str, Path], name: str, edit) -> Path:
    """A copy of the tiny exercise changed by ``edit(notebook)``, saved as ``<root>/<name>/90_tiny.ipynb``."""
    nb = nbformat.read(tiny["exercise"], as_version=4)
    edit(nb)
    path = tiny["root"] / name / "90_tiny.ipynb"
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)
    return path


def _solve(nb, q1: str = "    return x + 1", q2: str = "    return 2 * x") -> None:
    """Replace the stubs of the tiny exercise with the given bodies."""
    for cell in nb.cells:
        stub = cell.source.split("    # YOUR CODE HERE")[0]
        if grade_id(cell) == "q1_add_one":
            cell.source = stub + q1
        elif grade_id(cell) == "q2_double":
            cell.source = stub + q2


def _by_name(result) -> dict:
    return {q.name: q for q in result.questions}


# ----- the course's own exercises ----------------------------------------------------------------


def test_exercises_are_up_to_date(capsys):
    status = commands.assign(argparse.Namespace(check=True))
    assert status == 0, f"exercises/ differs from what `course assign` generates:\n{capsys.readouterr().err}"


def test_chapters_01_and_02_have_exercises():
    names = {p.stem for p in SOLUTIONS}
    assert {"01_memory_anatomy", "02_batch_size"} <= names, names
    for path in SOLUTIONS:
        n = len(load_exercise(path.stem).questions)
        assert 2 <= n <= 4, f"{path.name} has {n} questions; each exercise has two to four"


_untouched: dict[str, object] = {}


def _grade_untouched(stem: str):
    if stem not in _untouched:
        _untouched[stem] = grade_notebook(ROOT / "exercises" / f"{stem}.ipynb", timeout=60)
    return _untouched[stem]


@pytest.mark.parametrize("solution", SOLUTIONS, ids=lambda p: p.stem)
def test_solution_scores_full_marks(solution):
    start = time.monotonic()
    result = grade_notebook(solution, timeout=60)
    assert result.score == result.max_score > 0, json.dumps(result.as_dict(), indent=1)
    assert all(q.status == "passed" for q in result.questions)
    assert time.monotonic() - start < 120, "grading one solution notebook should take seconds"


@pytest.mark.parametrize("solution", SOLUTIONS, ids=lambda p: p.stem)
def test_untouched_exercise_scores_zero_on_every_implementation_question(solution):
    ex = load_exercise(solution.stem)
    result = _grade_untouched(solution.stem)
    assert result.score < result.max_score
    for q in result.questions:
        if ex.question(q.name).is_implementation:
            assert q.score == 0 and q.status != "passed", q
            assert q.message, f"{q.name} scores zero without saying why"


@pytest.mark.parametrize("solution", SOLUTIONS, ids=lambda p: p.stem)
def test_blanked_tests_score_no_more_than_untouched(solution, tmp_path):
    nb = nbformat.read(ROOT / "exercises" / solution.name, as_version=4)
    blanked = 0
    for cell in nb.cells:
        if is_test_cell(cell):
            cell.source, blanked = "pass", blanked + 1
    assert blanked == len(load_exercise(solution.stem).questions)
    path = tmp_path / solution.name
    nbformat.write(nb, path)
    assert grade_notebook(path, timeout=60).score <= _grade_untouched(solution.stem).score


# ----- generation ------------------------------------------------------------------------------


def test_generated_stub_keeps_signature_docstring_and_hint(tiny):
    nb = nbformat.read(tiny["exercise"], as_version=4)
    text = "\n".join(c.source for c in nb.cells)
    assert 'def add_one(x: int) -> int:\n    """``x + 1``."""' in text
    assert 'raise NotImplementedError("one plus sign is enough.")' in text
    assert f"raise NotImplementedError({json.dumps(assign.GENERIC_HINT)})" in text  # q2 has no hint
    for gone in ("return x + 1", "return 2 * x", "BEGIN SOLUTION", "HIDDEN TESTS", "add_one(-1)", "double(0)"):
        assert gone not in text, f"{gone!r} leaked into the exercise"
    assert 'assert add_one(1) == 2' in text, "the visible tests stay"
    assert nb.metadata["course"] == {"exercise": "90_tiny"}
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code")


def test_assign_check_reports_stale_files(tiny, tmp_path):
    out = tmp_path / "exercises"
    assert assign.stale(tiny["solutions"], out) == ["90_tiny.ipynb (missing)"]
    assign.write_exercises(tiny["solutions"], out)
    assert assign.stale(tiny["solutions"], out) == []
    (out / "90_tiny.ipynb").write_text((out / "90_tiny.ipynb").read_text().replace("add_one(1)", "add_one(2)"))
    assert assign.stale(tiny["solutions"], out) == ["90_tiny.ipynb (out of date)"]


@pytest.mark.parametrize("broken, message", [
    (lambda nb: nb.cells[3].metadata["nbgrader"].update(points=0), "positive 'points'"),
    (lambda nb: nb.cells[5].metadata["nbgrader"].update(grade_id="q1_add_one"), "used twice"),
    (lambda nb: nb.cells[2].metadata.clear(), "outside a solution cell"),
])
def test_broken_convention_is_a_clear_error(tiny, broken, message):
    nb = nbformat.read(tiny["solution"], as_version=4)
    broken(nb)
    with pytest.raises(GradingError, match=message):
        parse_exercise(nb, tiny["solution"])


# ----- grading: what the learner cannot change ---------------------------------------------------


def test_instructor_tests_and_points_replace_the_learners(tiny):
    def edit(nb):
        _solve(nb, q2="    return 3 * x")  # q1 right, q2 wrong
        for cell in list(nb.cells):
            if grade_id(cell) == "q1_add_one_test":
                cell.source = "assert False"           # an edited test counts for nothing ...
                cell.metadata["nbgrader"]["points"] = 100  # ... and neither do edited points
            elif grade_id(cell) == "q2_double_test":
                nb.cells.remove(cell)                  # a deleted test is put back
        fake = _cell("assert True", "q9_bonus_test", 50)  # a made-up test is dropped
        nb.cells.append(fake)

    result = grade_notebook(_learner(tiny, "tamper", edit), timeout=SHORT, solutions=tiny["solutions"])
    q = _by_name(result)
    assert set(q) == {"q1_add_one_test", "q2_double_test"}
    assert (q["q1_add_one_test"].status, q["q1_add_one_test"].score, q["q1_add_one_test"].max_score) == ("passed", 1, 1)
    assert q["q2_double_test"].status == "failed" and "double(3)" in q["q2_double_test"].message
    assert (result.score, result.max_score) == (1, 3)


def test_hidden_test_failure_is_reported(tiny):
    path = _learner(tiny, "hidden", lambda nb: _solve(nb, q1="    return abs(x) + 1"))
    q = _by_name(grade_notebook(path, timeout=SHORT, solutions=tiny["solutions"]))["q1_add_one_test"]
    assert q.status == "failed" and q.score == 0
    assert "hidden test" in q.message and "add_one(-1)" in q.message


def test_endless_loop_times_out_and_grading_goes_on(tiny):
    path = _learner(tiny, "loop", lambda nb: _solve(nb, q1="    while True:\n        pass"))
    start = time.monotonic()
    result = grade_notebook(path, timeout=SHORT, solutions=tiny["solutions"])
    elapsed = time.monotonic() - start
    q = _by_name(result)
    assert q["q1_add_one_test"].status == "timeout" and q["q1_add_one_test"].score == 0
    assert q["q2_double_test"].status == "passed", "the interrupted kernel grades the next question"
    assert elapsed < SHORT + 45, f"grading took {elapsed:.0f} s with a {SHORT} s limit"


def test_hang_that_ignores_interrupts_still_ends(tiny):
    deaf = "    import signal\n    signal.signal(signal.SIGINT, signal.SIG_IGN)\n    while True:\n        pass"
    start = time.monotonic()
    result = grade_notebook(_learner(tiny, "deaf", lambda nb: _solve(nb, q1=deaf)), timeout=2,
                            solutions=tiny["solutions"])
    q = _by_name(result)
    assert q["q1_add_one_test"].status == "timeout"
    assert q["q2_double_test"].status == "error" and "stopped answering" in q["q2_double_test"].message
    assert time.monotonic() - start < 2 + RECOVER_TIMEOUT + 45


def test_dead_kernel_fails_everything_after_it(tiny):
    def edit(nb):
        _solve(nb)
        at = next(i for i, c in enumerate(nb.cells) if grade_id(c) == "q1_add_one_test")
        nb.cells.insert(at + 1, _cell("import os\nos._exit(1)"))

    start = time.monotonic()
    result = grade_notebook(_learner(tiny, "exit", edit), timeout=SHORT, solutions=tiny["solutions"])
    q = _by_name(result)
    assert q["q1_add_one_test"].status == "passed", "what ran before the crash still counts"
    assert q["q2_double_test"].status == "error" and q["q2_double_test"].score == 0
    assert "kernel died" in q["q2_double_test"].message
    assert time.monotonic() - start < 60


# ----- the command line ----------------------------------------------------------------------------


def _course(*args: str, solutions: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **({"COURSE_SOLUTIONS": str(solutions)} if solutions else {})}
    return subprocess.run([sys.executable, "-m", "course_lib.cli", *args], capture_output=True, text=True,
                          env=env, timeout=180, cwd=ROOT)


def test_grade_json_schema_and_exit_status(tiny):
    path = _learner(tiny, "json", lambda nb: _solve(nb, q2="    return x"))
    run = _course("grade", str(path), "--json", "--timeout", str(SHORT), solutions=tiny["solutions"])
    assert run.returncode == 0, f"a low score is still a completed grading:\n{run.stderr}"
    out = json.loads(run.stdout)
    assert set(out) == {"notebook", "score", "max_score", "questions"}
    assert (out["score"], out["max_score"]) == (1, 3)
    for q in out["questions"]:
        assert set(q) == {"name", "score", "max_score", "status", "message"}
        assert q["status"] in STATUSES
    assert [q["status"] for q in out["questions"]] == ["passed", "failed"]


@pytest.mark.parametrize("content, expected", [
    ('{"cells": [', "not valid JSON"),
    ('{"hello": "world"}', "not a Jupyter notebook"),
])
def test_unreadable_notebook_is_a_clear_error(tmp_path, capsys, content, expected):
    path = tmp_path / "01_memory_anatomy.ipynb"
    path.write_text(content)
    assert cli.main(["grade", str(path), "--json"]) != 0
    out = capsys.readouterr()
    assert expected in out.err and str(path) in out.err and not out.out


def test_unreadable_notebook_exits_non_zero(tmp_path):
    path = tmp_path / "broken.ipynb"
    path.write_text('{"cells": [')
    run = _course("grade", str(path))
    assert run.returncode != 0 and "not valid JSON" in run.stderr


def test_foreign_notebook_is_a_clear_error(tmp_path, capsys):
    path = tmp_path / "my_experiments.ipynb"
    nbformat.write(_notebook([_cell("print('hello')")]), path)
    with pytest.raises(GradingError, match="not an exercise of this course"):
        grade_notebook(path)
    assert cli.main(["grade", str(path)]) != 0
    assert "not an exercise of this course" in capsys.readouterr().err


def test_overall_time_limit_ends_grading(tiny):
    slow = "    import time\n    time.sleep(1.5)\n    return x + 1"  # the q1 test calls it twice: 3 s
    start = time.monotonic()
    result = grade_notebook(_learner(tiny, "slow", lambda nb: _solve(nb, q1=slow)), timeout=SHORT,
                            solutions=tiny["solutions"], total_timeout=2)
    assert time.monotonic() - start < 2 + 40
    q = _by_name(result)
    assert q["q1_add_one_test"].status == "timeout"
    assert q["q2_double_test"].status == "timeout" and "overall limit" in q["q2_double_test"].message


def test_folder_of_submissions_into_csv(tiny, tmp_path):
    folder = tmp_path / "class"
    for who, body in [("alice", "    return 2 * x"), ("bob", "    return x")]:
        (folder / who).mkdir(parents=True)
        nb = nbformat.read(_learner(tiny, who, lambda nb, b=body: _solve(nb, q2=b)), as_version=4)
        nbformat.write(nb, folder / who / "90_tiny.ipynb")
    (folder / "carol").mkdir()
    (folder / "carol" / "90_tiny.ipynb").write_text("not json")
    csv_path = tmp_path / "grades.csv"
    args = argparse.Namespace(notebook=str(folder), timeout=SHORT, json=False, csv=str(csv_path),
                              solutions=tiny["solutions"])
    assert commands.grade(args) == 1, "one submission could not be graded"
    rows = {r["submission"]: r for r in csv.DictReader(csv_path.open())}
    assert set(rows) == {"alice/90_tiny.ipynb", "bob/90_tiny.ipynb", "carol/90_tiny.ipynb"}
    assert (rows["alice/90_tiny.ipynb"]["score"], rows["alice/90_tiny.ipynb"]["max_score"]) == ("3", "3")
    assert (rows["bob/90_tiny.ipynb"]["q1_add_one_test"], rows["bob/90_tiny.ipynb"]["q2_double_test"]) == ("1", "0")
    assert "q2_double_test: failed" in rows["bob/90_tiny.ipynb"]["problem"]
    assert "not valid JSON" in rows["carol/90_tiny.ipynb"]["problem"] and rows["carol/90_tiny.ipynb"]["score"] == ""


def test_check_gives_friendly_messages_and_hints(tiny, capsys):
    args = argparse.Namespace(notebook=str(tiny["exercise"]), timeout=SHORT, solutions=tiny["solutions"])
    assert commands.check(args) == 1
    out = capsys.readouterr().out
    assert "[to do] q1_add_one_test" in out and "one plus sign is enough." in out
    assert "0 of 2 questions pass their visible tests" in out
    solved = _learner(tiny, "check", lambda nb: _solve(nb, q1="    return abs(x) + 1"))
    args.notebook = str(solved)
    assert commands.check(argparse.Namespace(**vars(args))) == 0, "the hidden test is not run by check"
    assert "2 of 2 questions pass" in capsys.readouterr().out
