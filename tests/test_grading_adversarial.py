"""A learner who can write any Python in the notebook, put files beside it and has read the grader's source
scores at most what their honest work is worth, and cannot touch the grader, the instructor's files or
the other learners.

One class folder holds every attack of ``adversarial.py`` next to honest submissions; it is graded once,
by ``course grade -j 2`` in a subprocess (so that a submission that kills its grader could only kill that),
and every test below reads that one run.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import html
import re

import mistune
import nbformat
import psutil
import pytest

import adversarial as A
from course_lib.tools.grading import classroom, isolation, wire
from course_lib.tools.grading.exercise import Catalog
from course_lib.tools.grading.grade import GradeResult, QuestionResult

ROOT = Path(__file__).resolve().parent.parent
TOKEN = f"course-detached-{os.getpid()}"
PLANTED = f"planted_{os.getpid()}.py"
STRONG = isolation.detect() in ("namespaces+uid", "uid", "namespaces")

FORMULA = '=HYPERLINK("example.com?grades","open me")'  # a folder name a spreadsheet would run
LEARNER_TEXT = "<script>alert(1)</script> [open](javascript:alert(1)) `` ` ``x ![i](javascript:1) *bold* &amp; |"
DECODE_SECONDS = 1.0  # what refusing any hostile answers file may cost (each took seconds to hours before)

LEAK = A.Attack(
    "leaks_hidden_tests", "02_batch_size", honest=0,
    what="raises errors whose message is the test cell's own source, hoping the feedback shows the hidden tests",
    cells={"q1_max_batch_size": '''
import linecache, sys

def max_batch_size(budget_bytes, fixed_bytes, per_sample_bytes):
    lines = linecache.getlines(sys._getframe(1).f_code.co_filename)
    raise ValueError(" | ".join(line.strip() for line in lines[-6:]))'''})

FORGED = A.Attack(
    "forged_answers", "08_pipeline_parallel", honest=0,
    what="replaces the answers the kernel sends by the visible tests' expected values, and claims every error",
    cells={"q1_one_f_one_b": '''
import sys
from course_lib.tools.grading import checks, wire

checks.raised = lambda *args, **kwargs: "ValueError: of course"
_real_dump = wire.dump
from course_lib.parallel.pipeline.schedules import make_schedule

_known = {"q1": {"free": make_schedule("1f1b", 4, 6), "zero": "ValueError: of course"},
          "q3": {"4, 0.2": 12, "4, 0.75": 1, "1, 0": 1, "4, 0": "ValueError: of course"}}

def _forge(got, path):
    for answers in _known.values():
        if set(answers) & set(got):
            got = {**got, **answers}
    _real_dump(got, path)

wire.dump = _forge

def capped_one_f_one_b(num_microbatches, max_inflight):
    return []''',
           "q3_min_microbatches": "def min_microbatches(num_stages, max_bubble):\n    return 1"})


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """The class folder, graded once: rows by student, the solutions' bytes before, and the run itself."""
    base = tmp_path_factory.mktemp("adversarial")
    solutions = base / "solutions"
    shutil.copytree(ROOT / "solutions", solutions)
    before = {p.name: p.read_bytes() for p in solutions.glob("*.ipynb")}
    folder = base / "class"
    listener = A.Listener()
    attacks = [*A.IN_KERNEL, A.rewrite_solutions(solutions), A.COPY_CLASSMATE, A.KILLER, A.detached(TOKEN), LEAK,
               FORGED, *A.LIMITS, A.exfiltrate(listener.port), A.plant(PLANTED, [folder]), *A.ANSWERS]
    for attack in attacks:
        attack.write(folder)
    (folder / FORMULA).mkdir()
    shutil.copy(ROOT / "exercises" / "02_batch_size.ipynb", folder / FORMULA)
    A.write_solution(folder, "02_batch_size", "zz_classmate")   # what the copier hopes to find
    A.write_solution(folder, "01_memory_anatomy", "zz_after_the_killer")
    later = folder / "zz_later_learner"                          # graded after the solutions were attacked
    later.mkdir()
    shutil.copy(ROOT / "exercises" / "02_batch_size.ipynb", later)
    out = base / "out"
    # a small work folder: the disk filler fills it (a tmpfs, in memory) before the default's 512 MiB
    env = {**os.environ, "COURSE_SOLUTIONS": str(solutions), "PYTHONPATH": str(ROOT), "COURSE_GRADER_DISK_MB": "128"}
    start = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "course_lib.tools.cli", "grade", str(folder), "-j", "2", "--timeout", "60",
                          "--csv", str(out / "grades.csv")], capture_output=True, text=True, env=env, timeout=900)
    seconds = time.monotonic() - start
    csv_text = (out / "grades.csv").read_text() if (out / "grades.csv").exists() else ""
    rows = {r["student"]: r for r in csv.DictReader(csv_text.splitlines())}
    doc = json.loads((out / "grades.json").read_text()) if (out / "grades.json").exists() else {}
    print(f"graded {len(rows)} notebooks in {seconds:.0f} s, isolation {doc.get('isolation')}")
    listener.sock.close()
    planted = [p for where in (ROOT, folder) for p in where.rglob(PLANTED)]
    for path in planted:  # never leave a planted file in the course, whatever the verdict
        path.unlink()
    yield {"run": run, "rows": rows, "json": doc, "csv": out / "grades.csv", "csv_text": csv_text, "out": out,
           "solutions": solutions, "before": before, "attacks": {a.name: a for a in attacks}, "listener": listener,
           "planted": planted}


@pytest.mark.parametrize("name", [a.name for a in A.IN_KERNEL + [FORGED, LEAK]])
def test_an_attack_scores_at_most_its_honest_work(graded, name):
    row = graded["rows"].get(name)
    assert row is not None, f"{name} has no row:\n{graded['run'].stderr[-2000:]}"
    attack = graded["attacks"][name]
    assert row["score"] != "", f"{name} was not graded: {row['problem']}"
    assert float(row["score"]) <= attack.honest, f"{name} ({attack.what}) scored {row['score']}: {row['problem']}"


def test_an_answer_that_is_one_call_into_the_library_is_rejected(graded):
    rows = graded["rows"]
    assert rows["always_equal"]["q3_zero_devices_needed_test_reason"].startswith("rejected: ")
    assert "course_lib.memory.zero_memory" in rows["always_equal"]["q3_zero_devices_needed_test_reason"]
    assert "course_lib.parallel.data_parallel.ddp.assign_buckets" in rows["patched_torch"]["q2_assign_buckets_test_reason"]


def test_the_honest_part_of_an_attack_still_scores(graded):
    rows = graded["rows"]
    assert rows["redefined_abs"]["q1_max_batch_size_test"] == "2", "builtins patched later do not cost q1"
    assert rows["replaced_reference"]["q2_zero1_step_test"] == "3"


@pytest.mark.skipif(not STRONG, reason="this machine gives the kernel no isolation: see isolation.detect()")
def test_a_killer_kills_nothing_and_everyone_is_graded(graded):
    run, rows = graded["run"], graded["rows"]
    assert run.returncode == 0, f"every notebook should be graded:\n{run.stderr[-3000:]}"
    assert rows["killer"]["score"] == "0" and rows["zz_after_the_killer"]["score"] == "10"
    assert all(r["score"] != "" for r in rows.values()), [r["student"] for r in rows.values() if r["score"] == ""]


@pytest.mark.skipif(not STRONG, reason="this machine gives the kernel no isolation: see isolation.detect()")
def test_instructor_files_and_classmates_are_out_of_reach(graded):
    rows = graded["rows"]
    after = {p.name: p.read_bytes() for p in graded["solutions"].glob("*.ipynb")}
    assert after == graded["before"], "a submission changed the instructor's solutions"
    assert rows["zz_later_learner"]["score"] == "0", "a later learner is graded with the full tests"
    assert rows["zz_classmate"]["score"] == "8"
    assert rows["copy_classmate"]["score"] == "0" and rows["read_solutions"]["score"] == "0"


@pytest.mark.skipif(not STRONG, reason="this machine gives the kernel no isolation: see isolation.detect()")
def test_no_process_outlives_its_notebook_and_the_grades_stay_as_written(graded):
    left = [p.info for p in psutil.process_iter(["pid", "cmdline"]) if TOKEN in " ".join(p.info["cmdline"] or [])]
    assert not left, f"a detached process outlived the grader: {left}"
    time.sleep(2)  # it would rewrite every CSV it can reach twice a second
    assert graded["csv"].read_text() == graded["csv_text"] and "tampered" not in graded["csv_text"]


@pytest.mark.parametrize("name, reason", [("fork_storm", "limit of 128 processes"),
                                          ("memory_hog", "ran out of memory: the sandbox gives each process"),
                                          ("disk_filler", "filled the sandbox's 128 MiB work folder")])
def test_a_kernel_that_exceeds_a_limit_scores_zero_and_the_reason_says_which(graded, name, reason):
    row = graded["rows"][name]
    assert row["score"] == "0", f"{name} ({graded['attacks'][name].what}) scored {row['score']}"
    assert reason in row["q1_max_batch_size_test_reason"], row["q1_max_batch_size_test_reason"]


def test_the_grade_says_which_isolation_it_used_and_what_it_leaves_open(graded):
    mode = isolation.detect()
    said = isolation.describe(mode, isolation.Limits(disk=128 * 2**20))  # as COURSE_GRADER_DISK_MB=128 asks
    assert f"[course] isolation: {said}" in graded["run"].stderr, graded["run"].stderr[:2000]
    assert graded["json"]["isolation"] == mode and graded["json"]["isolation_detail"] == said


def test_no_kernel_reaches_the_network(graded):
    """The hidden tests' inputs go nowhere: the kernel has no network (or the grade says that it has)."""
    if not isolation.network_isolated(isolation.detect()):
        assert "network OPEN" in graded["run"].stderr
        pytest.skip("this machine gives the kernel no network namespace; the grade says so")
    assert graded["listener"].received == [], "a kernel sent the tests' inputs to the grader's localhost"
    assert graded["rows"]["exfiltrate"]["score"] == "2", "its honest answer still counts"


@pytest.mark.skipif(not STRONG, reason="this machine gives the kernel no isolation: see isolation.detect()")
def test_no_kernel_writes_into_the_course_or_another_submission(graded):
    assert graded["planted"] == [], f"a kernel wrote {graded['planted']}"
    assert graded["rows"]["planter"]["score"] == "2", "its honest answer still counts"


def test_feedback_never_quotes_a_hidden_test(graded):
    catalog = Catalog(graded["solutions"])
    secret = set()
    for ex in catalog.exercises.values():
        for q in ex.questions:
            if q.hidden is not None:
                for section in (q.hidden.inputs, q.hidden.answers, q.hidden.checks):
                    secret |= {line.strip() for line in section.source.splitlines() if len(line.strip()) >= 10}
    public = {line.strip() for p in (ROOT / "exercises").glob("*.ipynb")
              for c in nbformat.read(p, as_version=4).cells for line in c.source.splitlines()}
    secret -= public
    files = list((graded["out"] / "feedback").rglob("*.md"))
    assert len(files) >= len(graded["rows"]) - 1, "one feedback file per graded notebook"
    assert "max_batch_size(100, 95, 8)" in graded["rows"]["leaks_hidden_tests"]["q1_max_batch_size_test_reason"], \
        "the instructor's CSV shows what the learner's error said"
    for path in files:
        text = path.read_text()
        found = [line for line in secret if line in text]
        assert not found, f"{path.relative_to(graded['out'])} quotes hidden tests: {found[:3]}"


# ----- the grader's own process: the answers it decodes, the CSV and the feedback it writes ----------------


@pytest.mark.parametrize("attack", list(A.ANSWERS_ATTACKS))
def test_a_hostile_answers_file_is_refused_quickly_in_the_graders_words(attack):
    data = A.hostile_answers(wire.dumps({"right": [1, 2.5]}), attack)
    start = time.perf_counter()
    with pytest.raises(wire.WireError) as refused:
        wire.loads(data)
    seconds = time.perf_counter() - start
    what, words = A.ANSWERS_ATTACKS[attack]
    assert words in str(refused.value), f"{what}: {refused.value}"
    assert not re.search(r"frame #|c10::|site-packages|0x[0-9a-f]{6}", str(refused.value)), refused.value
    assert seconds < DECODE_SECONDS, f"{what}: refused after {seconds:.2f} s"


def test_decoding_is_linear_in_the_tensors_a_file_holds():
    import torch

    many = {"t": [torch.zeros(0) for _ in range(wire.MAX_TENSORS)]}
    start = time.perf_counter()
    back = wire.loads(wire.dumps(many))
    seconds = time.perf_counter() - start
    assert len(back["t"]) == wire.MAX_TENSORS and seconds < 2, f"{wire.MAX_TENSORS} tensors took {seconds:.2f} s"
    with pytest.raises(wire.WireError, match="at most"):
        wire.dumps({"t": [torch.zeros(0) for _ in range(wire.MAX_TENSORS + 1)]})


def test_a_few_values_of_one_hash_still_travel():
    """Honest values collide too (-1 and -2 hash alike, and so do tuples of them): a few per hash decode."""
    value = {"pairs": {(a, b) for a in (-1, -2) for b in (-1, -2)}, "keys": {-1: "a", -2: "b"}, "big": -(2**63) + 1}
    assert wire.loads(wire.dumps(value)) == value
    with pytest.raises(wire.WireError, match="below 2\\*\\*63"):
        wire.dumps({"n": 2**63})


def test_a_slow_decode_fails_its_question_at_the_time_limit(monkeypatch):
    from course_lib.tools.grading import grade

    def endless(data: bytes) -> None:
        while True:
            pass

    monkeypatch.setattr(wire, "loads", endless)
    start = time.monotonic()
    with pytest.raises(wire.WireError, match="decoding them ran past 0.5 s"):
        grade.decode(b"", seconds=0.5)
    assert time.monotonic() - start < 2


def _graded_class() -> list[classroom.Submission]:
    """Two graded notebooks of exercise 02 whose learner-chosen text (folder names, error messages) is hostile."""
    ex = Catalog(ROOT / "solutions").exercises["02_batch_size"]
    questions = [QuestionResult(q.name, 0, q.points, "error", f"your code raised ValueError on the test's inputs: "
                                                              f"{LEARNER_TEXT}") for q in ex.questions]
    subs = []
    for rel in (f"{FORMULA}/02_batch_size.ipynb", "@SUM(1+1)/02_batch_size.ipynb", "-2+3_02_batch_size.ipynb",
                "`a``b <i>/02_batch_size.ipynb"):
        sub = classroom.Submission(Path(rel), rel=rel, exercise=ex, problem="")
        sub.student = classroom.student_id(Path(rel), ex.name)
        sub.result = GradeResult(rel, ex.name, questions)
        subs.append(sub)
    subs[1].result, subs[1].problem = None, "+cmd|' /C calc'!A0"
    return subs


def test_the_csv_shows_learner_text_as_text():
    rows = list(csv.reader(classroom.csv_text(_graded_class()).splitlines()))
    cells = [c for row in rows for c in row]
    assert f"'{FORMULA}/02_batch_size.ipynb" in cells and "'@SUM_1+1_" in cells and "'+cmd|' /C calc'!A0" in cells
    formulas = [c for c in cells if c[:1] in ("=", "+", "-", "@", "\t", "\r")]
    assert not formulas, f"cells a spreadsheet would run as formulas: {formulas}"


def test_feedback_shows_learner_text_as_text():
    for sub in _graded_class():
        if sub.result is None:
            continue
        page = mistune.html(classroom.feedback_markdown(sub))
        assert "<script" not in page and "<a " not in page and "<img" not in page and "<i>" not in page, page
        shown = html.unescape(re.sub(r"<[^>]+>", "", page))
        assert LEARNER_TEXT in shown, f"the learner's text, shown as written: {shown}"
        assert sub.rel in shown, f"the feedback names the notebook as it was handed in: {shown}"


def test_a_hostile_answers_file_costs_only_its_question(graded):
    for name, (stem, attacks, honest) in A.ANSWERS_PLAN.items():
        row = graded["rows"][name]
        assert row["score"] != "", f"{name} was not graded: {row['problem']}"
        for question, attack in attacks.items():
            reason = row[f"{question}_reason"]
            assert reason.startswith("error: your answers could not be read: "), f"{name} {question}: {reason}"
            assert A.ANSWERS_ATTACKS[attack][1] in reason, f"{name} {question} ({attack}): {reason}"
        assert float(row["score"]) == honest, f"{name}: the honest questions score, the attacked ones not: {row}"


def test_a_formula_in_a_folder_name_stays_text_in_the_csv(graded):
    rows = list(csv.reader(graded["csv_text"].splitlines()))
    assert [f"'{FORMULA}/02_batch_size.ipynb"] == [c for r in rows for c in r if FORMULA in c], rows
    assert not [c for r in rows for c in r if c[:1] in ("=", "+", "-", "@")]
