"""The graded-exercise system: exercises/ is generated from solutions/, and the grader scores fairly.

The first tests run over every ``solutions/*.ipynb`` (chapters added later are
covered without a change here): all of them, solutions and untouched
exercises, are graded in one class folder with two workers. The rest use a
tiny two-question exercise built in a temporary folder, so that each failure
mode (a hang, a dead kernel, an edited test) costs a kernel start of a second
or two. Attacks on the grader are in ``test_grading_adversarial.py``.
"""

from __future__ import annotations

import argparse
import ast
import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

from course_lib.tools import cli
from course_lib.tools.grading import assign, classroom, commands, execute, isolation
from course_lib.tools.grading.execute import run_notebook
from course_lib.tools.grading.exercise import GradingError, grade_id, is_test_cell, load_exercise, parse_exercise
from course_lib.tools.grading.grade import STATUSES, grade_notebook

import adversarial  # tests/adversarial.py: the attacks, and the localhost listener

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
ADD_ONE_TEST = '''### ANSWERS
got = {"1": add_one(1)}
### CHECKS
assert got["1"] == 2, "add_one(1) should be 2"
### BEGIN HIDDEN TESTS
### ANSWERS
got["-1"] = add_one(-1)
### CHECKS
assert got["-1"] == 0, "add_one(-1) should be 0"
### END HIDDEN TESTS'''
DOUBLE = '''def double(x: int) -> int:
    """``2 * x``."""
    ### BEGIN SOLUTION
    return 2 * x
    ### END SOLUTION'''
DOUBLE_TEST = '''three = 3
### ANSWERS
got = {"3": double(three)}
### CHECKS
assert got["3"] == 6, "double(3) should be 6"
### BEGIN HIDDEN TESTS
zero = 0
### ANSWERS
got["0"] = double(zero)
### CHECKS
assert got["0"] == 0, "double(0) should be 0"
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
        # two to four questions each; 04's fifth asks for the adaptive clip, 08's fifth and sixth for PipeDream's
        # weight versions and a pipeline with frozen stages
        most = {"04_normalization": 5, "08_pipeline_parallel": 6}.get(path.stem, 4)
        assert 2 <= n <= most, f"{path.name} has {n} questions; each exercise has two to {most}"


def test_readmes_say_which_exercises_exist():
    """The READMEs' chapter range for the exercises and their "three to five questions" are the files'."""
    import re

    numbers = sorted(int(p.name[:2]) for p in (ROOT / "exercises").glob("[0-9][0-9]_*.ipynb"))
    assert numbers == list(range(numbers[0], numbers[-1] + 1)), \
        f"the exercises skip a chapter ({numbers}): the READMEs' 'chapters NN-MM' no longer says which exist"
    span = f"{numbers[0]:02d}-{numbers[-1]:02d}"
    counts = [len(load_exercise(path.stem).questions) for path in SOLUTIONS]
    words = dict(enumerate(["zero", "one", "two", "three", "four", "five", "six", "seven", "eight"]))
    questions = f"{words[min(counts)]} to {words[max(counts)]} questions"
    for name in ("README.md", "exercises/README.md"):
        text = " ".join((ROOT / name).read_text().split())
        sentences = [x for x in re.split(r"(?<=[.:;])\s+", text) if "exercise" in x.lower()]
        ranges = [m for x in sentences for m in re.findall(r"[Cc]hapters? (\d\d-\d\d)\b", x)]
        assert ranges and set(ranges) == {span}, \
            f"{name} says the exercises are for chapters {sorted(set(ranges))}; exercises/ holds chapters {span}"
        stated = re.findall(r"\b\w+ to \w+ questions\b", text)
        assert stated and set(stated) == {questions}, f"{name} says {stated}; the exercises have {questions}"


@pytest.fixture(scope="module")
def course_class(tmp_path_factory) -> dict[str, classroom.Submission]:
    """Every solution, and every untouched exercise with its test cells blanked, graded as one class (-j 2)."""
    folder = tmp_path_factory.mktemp("course_class")
    for path in SOLUTIONS:
        (folder / "solution").mkdir(exist_ok=True)
        (folder / "solution" / path.name).write_bytes(path.read_bytes())
        nb = nbformat.read(ROOT / "exercises" / path.name, as_version=4)
        for cell in nb.cells:
            if is_test_cell(cell):
                cell.source = "pass"  # the learner's test cells count for nothing anyway
        (folder / "untouched").mkdir(exist_ok=True)
        nbformat.write(nb, folder / "untouched" / path.name)
    start = time.monotonic()
    subs = classroom.grade_folder(folder, timeout=60, jobs=2)
    print(f"graded {len(subs)} notebooks in {time.monotonic() - start:.0f} s")
    return {s.rel: s for s in subs}


@pytest.mark.parametrize("solution", SOLUTIONS, ids=lambda p: p.stem)
def test_solution_scores_full_marks(course_class, solution):
    result = course_class[f"solution/{solution.name}"].result
    assert result is not None, course_class[f"solution/{solution.name}"].problem
    assert result.score == result.max_score > 0, json.dumps(result.as_dict(), indent=1)
    assert all(q.status == "passed" for q in result.questions)


@pytest.mark.parametrize("solution", SOLUTIONS, ids=lambda p: p.stem)
def test_untouched_exercise_scores_zero_on_every_implementation_question(course_class, solution):
    ex = load_exercise(solution.stem)
    result = course_class[f"untouched/{solution.name}"].result
    assert result is not None and result.score < result.max_score
    for q in result.questions:
        if ex.question(q.name).is_implementation:
            assert q.score == 0 and q.status != "passed", q
            assert q.message, f"{q.name} scores zero without saying why"


def test_solutions_run_top_to_bottom_as_nbgrader_runs_them(tmp_path):
    """nbgrader runs every cell, tests included, in the learner's kernel: the solutions must pass that way too."""
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook()
    for path in SOLUTIONS:
        nb.cells += [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
    client = NotebookClient(nb, allow_errors=True, kernel_name="python3", timeout=300)
    client.execute(cwd=str(tmp_path))
    errors = [(c.source.splitlines()[0], o.get("ename"), o.get("evalue")) for c in nb.cells
              for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, errors


def test_every_test_cell_says_what_its_answer_must_not_call():
    """The questions with a one-call answer in course_lib name it, and the instructions say so."""
    named = {f for path in SOLUTIONS for q in load_exercise(path.stem).questions for f in q.forbid}
    for reference in ("course_lib.memory.zero_memory", "course_lib.parallel.data_parallel.ddp.assign_buckets",
                      "course_lib.parallel.sharding.zero.shard_bounds", "torch.nn.functional.group_norm",
                      "course_lib.parallel.sharding.sharded_checkpoint.latest_checkpoint"):
        assert reference in named, f"no question forbids {reference}"
    for path in SOLUTIONS:
        text = path.read_text()
        for q in load_exercise(path.stem).questions:
            for name in q.forbid[:1]:
                assert name.rsplit(".", 1)[1] in text.replace("\\n", " "), f"{path.name} never names {name}"


MISTAKES = {  # chapter -> solution cells replaced by an answer with a mistake its instructions name
    "01_memory_anatomy": {"q1_training_state_bytes": '''
def training_state_bytes(model, optimizer):
    buffers = {"sgd": 0, "momentum": 1, "adam": 2}
    if optimizer not in buffers:
        raise ValueError(optimizer)
    params = list(model.parameters())
    total = sum(p.numel() * p.element_size() for p in params)   # frozen parameters counted as trainable
    return {"params": total, "grads": total,
            "optimizer": buffers[optimizer] * total + (4 * len(params) if optimizer == "adam" else 0)}'''},
    "03_gradient_accumulation": {"q2_accumulate_stream": '''
def accumulate_stream(model, loss_fn, pieces):
    pieces = list(pieces)                  # reads every piece first, to know N before the first forward
    n = sum(len(x) for x, _ in pieces)
    if n == 0:
        raise ValueError("no piece")
    model.zero_grad()
    total = 0.0
    for x, y in pieces:
        loss = loss_fn(model(x), y) * (len(x) / n)
        loss.backward()
        total += loss.item()
    return total''', "q3_token_accumulation_step": '''
def token_accumulation_step(model, micro_batches):
    total_tokens = sum(int((t != -100).sum()) for _, t in micro_batches)
    if total_tokens == 0:
        raise ValueError("no real token")
    model.zero_grad()
    total = 0.0
    for x, t in micro_batches:
        if not (t != -100).any():
            continue                       # skips the model on a micro-batch of padding only
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), t.reshape(-1), ignore_index=-100,
                               reduction="sum") / total_tokens
        loss.backward()
        total += loss.item()
    return total'''},
    "07_data_parallel": {"q1_average_gradients": '''
def average_gradients(per_rank):
    if not per_rank or len({len(g) for g in per_rank}) != 1:
        raise ValueError("ragged")
    out = []
    for grads in zip(*per_rank):
        present = [g for g in grads if g is not None]
        out.append(None if not present else sum(present) / len(present))   # divides by the ranks that used it
    return out''', "q3_ring_all_reduce": '''
def ring_all_reduce(tensors):
    n = len(tensors)
    chunks = [list(torch.tensor_split(t, n)) for t in tensors]   # views of the inputs, changed in place below
    sent = [0] * n
    for phase in ("reduce-scatter", "all-gather"):
        for s in range(n - 1):
            index = [(r - s) % n if phase == "reduce-scatter" else (r + 1 - s) % n for r in range(n)]
            messages = [chunks[r][index[r]].clone() for r in range(n)]
            for r, payload in enumerate(messages):
                dst = (r + 1) % n
                if phase == "reduce-scatter":
                    chunks[dst][index[r]] += payload
                else:
                    chunks[dst][index[r]].copy_(payload)
                sent[r] += payload.numel()
    return [torch.cat(c) for c in chunks], sent'''},
    "11_memory_beyond_splitting": {"q1_online_attention": '''
def online_attention(q, k, v, block):
    if block < 1:
        raise ValueError(block)
    T, d = q.shape[-2], q.shape[-1]
    best = q.new_full((*q.shape[:-1], 1), -math.inf)
    total, acc = q.new_zeros((*q.shape[:-1], 1)), q.new_zeros((*q.shape[:-1], v.shape[-1]))
    for start in range(0, T, block):
        s = q @ k[..., start:start + block, :].transpose(-2, -1) / math.sqrt(d)
        s = s.masked_fill(torch.arange(start, start + s.shape[-1]) > torch.arange(T)[:, None], -math.inf)
        best = torch.maximum(best, s.amax(-1, keepdim=True))     # the old sums are never rescaled
        total = total + torch.exp(s - best).sum(-1, keepdim=True)
        acc = acc + torch.exp(s - best) @ v[..., start:start + block, :]
    return acc / total''', "q2_offload_hooks": '''
class Offload(saved_tensors_hooks):
    def __init__(self, keep=(), min_bytes=0):
        if min_bytes < 0:
            raise ValueError(min_bytes)
        self.min_bytes, self.copies, self.copied_bytes, self.kept_bytes = min_bytes, 0, 0, 0
        super().__init__(self.pack, self.unpack)                      # keep is ignored: the weights are copied

    def pack(self, t):
        size = t.numel() * t.element_size()
        if size < self.min_bytes:
            self.kept_bytes += size
            return t
        self.copies += 1
        self.copied_bytes += size
        return t.device, t.detach().to("cpu", copy=True)

    def unpack(self, packed):
        return packed if torch.is_tensor(packed) else packed[1].to(packed[0])''', "q3_chunked_cross_entropy": '''
def chunked_cross_entropy(hidden, weight, bias, targets, chunks):
    if not 1 <= chunks <= len(hidden):
        raise ValueError(chunks)
    total = sum(F.cross_entropy(F.linear(h, weight, bias), y, reduction="sum")   # the forward only: every
                for h, y in zip(hidden.chunk(chunks), targets.chunk(chunks)))  # chunk's log-softmax is saved
    return total / len(hidden)'''},
    "12_context_expert_parallel": {"q1_merge_partials": '''
def merge_partials(outs, lses):
    weights = torch.exp(torch.stack(lses))           # no maximum subtracted: overflows for large log-sum-exps
    total = weights.sum(0)
    return (weights * torch.stack(outs)).sum(0) / torch.where(total == 0, torch.ones_like(total), total), torch.log(total)''',
                                   "q2_ring_attention_sim": '''
def ring_attention_sim(q, k, v, c):
    if not isinstance(c, int) or c < 1 or q.shape[0] % c:
        raise ValueError(c)
    T, d = q.shape
    n, pos = T // c, torch.arange(T)
    held, order, result = list(range(c)), [[] for _ in range(c)], [None] * c
    for _ in range(c):
        for r in range(c):
            j = held[r]
            order[r].append(j)
            qs, ks = slice(r * n, (r + 1) * n), slice(j * n, (j + 1) * n)
            s = ((q[qs] @ k[ks].T) / math.sqrt(d)).masked_fill(pos[ks][None, :] > pos[qs][:, None], float("-inf"))
            lse = torch.logsumexp(s, -1, keepdim=True)
            o = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)) @ v[ks]
            result[r] = (o, lse) if result[r] is None else merge_partials([result[r][0], o], [result[r][1], lse])
        held = [held[(r + 1) % c] for r in range(c)]   # receives from the right: the ring runs the wrong way
    return torch.cat([o for o, _ in result]), order'''},
}


@pytest.mark.parametrize("stem", sorted(MISTAKES))
def test_visible_tests_catch_the_mistakes_the_instructions_name(stem, tmp_path):
    import adversarial

    wrong = MISTAKES[stem]
    cells = {c.metadata["nbgrader"]["grade_id"]: adversarial.solution_source(stem, c.metadata["nbgrader"]["grade_id"])
             for c in nbformat.read(ROOT / "solutions" / f"{stem}.ipynb", as_version=4).cells
             if c.metadata.get("nbgrader", {}).get("solution")}
    path = adversarial.Attack("mistakes", stem, honest=0, what="", cells={**cells, **wrong}).write(tmp_path)
    result = grade_notebook(path, timeout=60, hidden=False)  # what `course check` runs: the visible tests only
    for q in result.questions:
        ex = load_exercise(stem).question(q.name)
        if ex.solution_id in wrong:
            assert q.status == "failed" and not q.hidden, f"{q.name}: the visible tests miss the mistake: {q}"
        else:
            assert q.status == "passed", q


UNASKED_GUARDS = {  # checks in a solution that its instructions do not ask for: no test needs them
    ("05_activation_checkpointing", "q1_fewest_segments"): {"n < 1"},
    ("10_tensor_parallel", "q1_shard_shapes"): {"n_heads < 1"},
    ("12_context_expert_parallel", "q2_ring_attention_sim"): {"not isinstance(c, int)"},
    ("12_context_expert_parallel", "q4_exchange_splits"): {"ep < 1"},
}


def _forgotten_checks(source: str) -> list[tuple[str, str]]:
    """``(check, source)``: the solution cell ``source`` as written by a learner who forgot one of its errors.

    Each ``raise`` in turn becomes ``pass`` (``check`` is the ``if`` test it sits under, else the raise), and
    each part of an ``if a or b: raise`` test is dropped in turn (``check`` is that part).
    """
    def raises(tree: ast.AST) -> list[ast.Raise]:
        return [n for n in ast.walk(tree) if isinstance(n, ast.Raise) and n.exc is not None]

    def parents(tree: ast.AST) -> dict[ast.AST, ast.AST]:
        return {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}

    out = []
    for i in range(len(raises(ast.parse(source)))):
        tree = ast.parse(source)
        node, guard = raises(tree)[i], parents(tree)[raises(tree)[i]]
        guarded = isinstance(guard, ast.If) and node in guard.body
        check = ast.unparse(guard.test) if guarded else ast.unparse(node)
        body = next(b for b in (getattr(guard, f, None) for f in ("body", "orelse", "finalbody"))
                    if isinstance(b, list) and node in b)
        body[body.index(node)] = ast.Pass()
        out.append((check, ast.unparse(tree)))
        if guarded and isinstance(guard.test, ast.BoolOp) and isinstance(guard.test.op, ast.Or):
            for j in range(len(guard.test.values)):
                tree = ast.parse(source)
                guard = parents(tree)[raises(tree)[i]]
                kept = [v for k, v in enumerate(guard.test.values) if k != j]
                check = ast.unparse(guard.test.values[j])
                guard.test = kept[0] if len(kept) == 1 else ast.BoolOp(op=ast.Or(), values=kept)
                out.append((check, ast.unparse(tree)))
    return out


def _visible_test_error(ex, question, solution: str | None = None) -> str | None:
    """Run the notebook's plain and solution cells (``solution`` in place of the question's own), then the
    question's visible test, top to bottom in one namespace as nbgrader would; the error it ends in, or None."""
    import random

    import torch

    ns: dict = {"__name__": "__main__"}
    state, threads = random.getstate(), torch.get_num_threads()
    # one thread, as the grader's kernels run: these tensors are tiny, and on a busy machine two threads wait on
    # each other at every operation (chapter 05's visible test took 3 s with two threads, 0.06 s with one)
    torch.set_num_threads(1)
    with torch.random.fork_rng():
        try:
            for cell in ex.notebook.cells:
                if cell.cell_type == "code" and not is_test_cell(cell) and cell.source.strip():
                    own = solution is not None and grade_id(cell) == question.solution_id
                    exec(compile(solution if own else cell.source, ex.name, "exec"), ns)
            random.seed(0), torch.manual_seed(0)  # as the grader does before each test's inputs
            for section in (question.visible.inputs, question.visible.answers, question.visible.checks):
                exec(section.code(question.name), ns)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        finally:
            random.setstate(state)
            torch.set_num_threads(threads)
    return None


@pytest.mark.parametrize("solution", SOLUTIONS, ids=lambda p: p.stem)
def test_every_error_the_instructions_ask_for_has_a_visible_test(solution):
    """An answer that forgets one of the errors its question asks for (a ``ValueError`` for a bad argument)
    fails a visible test, so `course check` says so before the hidden tests would."""
    ex = load_exercise(solution.stem)
    missed = []
    for q in ex.questions:
        if not q.is_implementation:
            continue
        source = next(c.source for c in ex.notebook.cells if grade_id(c) == q.solution_id)
        allowed = UNASKED_GUARDS.get((solution.stem, q.solution_id), set())
        forgotten = _forgotten_checks(source)
        if not forgotten:
            continue
        error = _visible_test_error(ex, q)
        assert error is None, f"{q.name}: the visible test does not pass on its own with the solution: {error}"
        for check, wrong in forgotten:
            if check not in allowed and _visible_test_error(ex, q, wrong) is None:
                missed.append(f"{q.solution_id}: without `{check}`")
        stale = allowed - {check for check, _ in forgotten}
        assert not stale, f"UNASKED_GUARDS names checks {q.solution_id} no longer has: {stale}"
    assert not missed, ("every visible test still passes on an answer that forgets an error its question asks "
                        "for; add a visible test of it, named as the instructions name it (or, if they do not ask "
                        "for it, list it in UNASKED_GUARDS):\n  " + "\n  ".join(missed))


# ----- generation ------------------------------------------------------------------------------


def test_generated_stub_keeps_signature_docstring_and_hint(tiny):
    nb = nbformat.read(tiny["exercise"], as_version=4)
    text = "\n".join(c.source for c in nb.cells)
    assert 'def add_one(x: int) -> int:\n    """``x + 1``."""' in text
    assert 'raise NotImplementedError("one plus sign is enough.")' in text
    assert f"raise NotImplementedError({json.dumps(assign.GENERIC_HINT)})" in text  # q2 has no hint
    for gone in ("return x + 1", "return 2 * x", "BEGIN SOLUTION", "HIDDEN TESTS", "add_one(-1)", "double(zero)"):
        assert gone not in text, f"{gone!r} leaked into the exercise"
    assert 'got = {"1": add_one(1)}\n### CHECKS\nassert got["1"] == 2' in text, "the visible tests stay, in three parts"
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
    (lambda nb: setattr(nb.cells[3], "source", nb.cells[3].source.replace("### CHECKS\n", "", 1)), "### CHECKS"),
    (lambda nb: setattr(nb.cells[3], "source", nb.cells[3].source + "\nassert True"), "must come last"),
    (lambda nb: nb.cells[3].metadata.update(course={"forbid": "memory"}), "dotted names"),
    (lambda nb: setattr(nb.cells[1], "source", "%time import os"), "plain Python"),
])
def test_broken_convention_is_a_clear_error(tiny, broken, message):
    nb = nbformat.read(tiny["solution"], as_version=4)
    broken(nb)
    with pytest.raises(GradingError, match=message):
        parse_exercise(nb, tiny["solution"])


# ----- what travels from the kernel, and what the checks accept --------------------------------------


def test_answers_travel_as_plain_data_and_the_decoder_trusts_nothing():
    import torch

    from course_lib.tools.grading import wire

    value = {"a": [1, 2.5, float("nan"), None, True, "x", (1, 2), {3}], 7: torch.arange(6.0).reshape(2, 3),
             "p": torch.nn.Parameter(torch.ones(2)), "bf16": torch.zeros(0, 3, dtype=torch.bfloat16)}
    back = wire.loads(wire.dumps(value))
    assert type(back["p"]) is torch.Tensor and torch.equal(back["p"], torch.ones(2)), "a Parameter arrives as a tensor"
    assert back["a"][:2] == [1, 2.5] and back["a"][6] == (1, 2) and back["a"][7] == {3} and back[7].shape == (2, 3)

    class Anything:
        def __eq__(self, other):
            return True

    with pytest.raises(wire.WireError, match=r"got\['x'\] is a .*Anything"):
        wire.dumps({"x": Anything()})
    good = wire.dumps({"t": torch.ones(2)})
    n = len(wire.MAGIC) + 8
    for bad, message in [(b"\x80\x04pickle", "wrong header"), (good[:-3], "table says"),
                         (good.replace(b'"float32"', b'"object!"'), "unknown dtype"),
                         (good.replace(b'"tensor"', b'"eval"  '), "not valid JSON|unknown tag")]:
        with pytest.raises(wire.WireError, match=message):
            wire.loads(bad)
    assert n < len(good)


def test_load_refuses_links_and_huge_files(tmp_path):
    from course_lib.tools.grading import wire

    (tmp_path / "secret").write_text("the instructor's")
    (tmp_path / "link").symlink_to(tmp_path / "secret")
    with pytest.raises(wire.WireError, match="plain file"):
        wire.load(str(tmp_path / "link"))
    (tmp_path / "big").write_bytes(wire.MAGIC + b"\0" * 2048)
    with pytest.raises(wire.WireError, match="at most"):
        wire.load(str(tmp_path / "big"), max_bytes=1024)
    with pytest.raises(wire.WireError, match="did not finish"):
        wire.load(str(tmp_path / "missing"))


def test_checks_compare_with_exact_types():
    import torch

    from course_lib.tools.grading.checks import close, raised, same

    assert same([1, (2, "a")], [1, (2, "a")]) and not same([1], [True]) and not same([1], (1,)) and not same(1, 1.0)
    assert same(torch.ones(2), torch.ones(2)) and not same(torch.ones(2), torch.ones(2, dtype=torch.float64))
    assert close(16000, 16000.0) and close(1.0, 1.0 + 1e-12) and not close(True, 1.0) and not close("1", 1)
    assert close([torch.ones(2)], [torch.ones(2) + 1e-9], atol=1e-6) and not close(torch.ones(2), torch.ones(3))
    assert raised(int, "7") is None and raised(int, "x").startswith("ValueError: invalid literal")

    class Mine(ValueError):
        pass

    def boom():
        raise Mine("no")

    assert raised(boom) == "ValueError: no", "the nearest built-in class names the error"


def test_check_types_names_the_first_part_of_the_wrong_type():
    import torch

    from course_lib.tools.grading.checks import check_types

    def message(got, want, **kw) -> str:
        with pytest.raises(AssertionError) as err:
            check_types(got, want, "f()", **kw)
        return str(err.value)

    assert message([["F", 0]], [("F", 0)]) == "f()[0] must be a tuple like ('F', 0); got a list ['F', 0]"
    assert message(12.0, 12) == "f() must be an int like 12; got a float 12.0"
    assert message({"a": [1, True]}, {"a": [1, 2]}) == "f()['a'][1] must be an int like 2; got a bool True"
    assert message({"a": 1}, {"a": 1, "b": 2}) == "f() must have the keys ['a', 'b']; got ['a']"
    assert message(torch.ones(2, dtype=torch.float64), torch.ones(2)) == \
        "f() must be a torch.float32 tensor of shape (2,); got a torch.float64 tensor of shape (2,)"
    assert message(None, [1]) == "f() must be a list like [1]; got None"
    assert message(True, 1.0, numbers_alike=True) == "f() must be a float like 1.0; got a bool True"
    check_types([("F", 0), ("B", 0)], [("F", 1), ("B", 1), ("F", 2)])  # values and lengths are the value checks' task
    check_types({"x": 1, "y": [2.0]}, {"y": [2], "x": 1.0}, numbers_alike=True)


def test_a_schedule_written_with_lists_is_told_its_type():
    """Exercise 08's first question: a right schedule of ["F", 0] lists fails on the type, not as a wrong order."""
    from course_lib.parallel.pipeline.schedules import make_schedule
    from course_lib.tools.grading.checker import Checker

    def capped(m: int, caps: list[int]) -> list:   # 1F1B whose warm-up fits each stage's cap (and the one before)
        out, warm = [], m
        for s, c in enumerate(caps):
            warm = min(warm, len(caps) - s - 1, c - 1)
            out.append([("F", i) for i in range(warm)] + [op for j in range(m - warm) for op in (("F", warm + j),
                       ("B", j))] + [("B", j) for j in range(m - warm, m)])
        return out

    checker = Checker(load_exercise("08_pipeline_parallel"), hidden=False)
    tuples = {"free": make_schedule("1f1b", 4, 6), "two": capped(8, [2] * 4), "one": capped(4, [1] * 3),
              "first tight": capped(8, [1, 4, 4, 4]), "zero": "ValueError: a cap below 1"}
    lists = {k: [[list(op) for op in stage] for stage in v] if isinstance(v, list) else v for k, v in tuples.items()}
    verdicts = checker.check({"q1_one_f_one_b_test": lists})
    assert verdicts["q1_one_f_one_b_test"].status == "failed"
    assert verdicts["q1_one_f_one_b_test"].message == \
        "a test failed: capped_one_f_one_b(6, [8, 8, 8, 8])[0][0] must be a tuple like ('F', 0); got a list ['F', 0]"
    assert checker.check({"q1_one_f_one_b_test": tuples})["q1_one_f_one_b_test"].status == "passed"


def test_forbidden_references_are_found_however_they_are_spelled():
    from course_lib.tools.grading.forbid import violations

    ban = ("course_lib.memory.zero_memory",)
    used = {
        "a call": ["from course_lib import memory", "def z(n, d, s):\n    return memory.zero_memory(n, d, s)"],
        "an alias": ["from course_lib.memory import zero_memory as zm", "def z(*a):\n    return zm(*a)"],
        "a helper in another cell": ["import course_lib.memory as m\ndef h(*a):\n    return m.zero_memory(*a)",
                                     "def z(*a):\n    return h(*a)"],
        "stashed in builtins": ["import builtins\nfrom course_lib import memory\nbuiltins.zz = memory.zero_memory",
                                "def z(*a):\n    return zz(*a)"],
        "a string": ["from course_lib import memory", "def z(*a):\n    return getattr(memory, 'zero_memory')(*a)"],
        "a computed name": ["from course_lib import memory", "def z(*a):\n    return getattr(memory, 'zero_' + 'memory')(*a)"],
        "a table built with it": ["from course_lib import memory\nT = {s: memory.zero_memory(1e6, 2, s) for s in range(4)}",
                                  "def z(n, d, s):\n    return T[s]"],
    }
    for how, cells in used.items():
        assert violations(cells, [1], ban), f"not found: {how}"
    fine = {
        "trying it out": ["from course_lib import memory\nprint(memory.zero_memory(1e6, 2, 1))",
                          "def z(n, d, s):\n    return 16 * n"],
        "its own function of that name": ["def zero_memory(n):\n    return n", "def z(n, d, s):\n    return zero_memory(n)"],
        "another question's function": ["from course_lib import memory\ndef other(n):\n    return memory.zero_memory(n, 1, 0)",
                                        "def z(n, d, s):\n    return 16 * n"],
    }
    for how, cells in fine.items():
        assert not violations(cells, [1], ban), f"flagged wrongly: {how}"


# ----- the sandbox ---------------------------------------------------------------------------------


def _modes() -> list[str]:
    """Every isolation mode this machine can run: the strongest, and each weaker one it can stand in for."""
    best = isolation.detect()
    usable = {"namespaces+uid": isolation.MODES, "uid": ("uid", "none"), "namespaces": ("namespaces", "none"),
              "none": ("none",)}
    # without namespaces, another user id must reach this Python and the course (not so under /root)
    blocked = isolation.unreachable(isolation.UID_BASE, isolation.UID_BASE)
    return [m for m in usable[best] if not (m == "uid" and blocked)]


def _git_dirs() -> list[Path]:
    """This checkout's git folder, and the repository's shared one when this is a worktree of another."""
    git = ROOT / ".git"
    if git.is_file():
        own = Path(git.read_text().split("gitdir:", 1)[1].strip())
        common = own / "commondir"
        return [own, (own / common.read_text().strip()).resolve() if common.exists() else own]
    return [git]


PROBE = '''
import json, os, resource, socket, subprocess, sys
import course_lib
root = os.path.dirname(os.path.dirname(course_lib.__file__))
facts = {{"ls": sorted(os.listdir(".")), "cwd_on_path": "" in sys.path or os.getcwd() in sys.path,
          "course_lib": course_lib.__file__, "uid": os.getuid(), "env": sorted(os.environ),
          "root_ls": sorted(os.listdir(root))}}

def readable(path):
    try:
        return bool(os.listdir(path)) if os.path.isdir(path) else open(path, "rb").read(1) != b""
    except OSError:
        return False

facts["seen"] = [p for p in {secrets!r} if readable(p)]
shown = []
for extra in ([], ["--git-dir", {common!r}]):
    try:
        run = subprocess.run(["git", "-c", "safe.directory=*", *extra, "-C", root, "show",
                              "HEAD:solutions/01_memory_anatomy.ipynb"], capture_output=True, timeout=30)
        shown.append(run.returncode == 0 and b"BEGIN SOLUTION" in run.stdout)
    except OSError:
        shown.append(False)
facts["git_show"] = any(shown)
written = []
for path in {targets!r}:
    try:
        with open(path, "w") as f:
            f.write("planted")
        os.remove(path)
        written.append(path)
    except OSError:
        pass
facts["written"] = written
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=3).close()
    facts["net"] = True
except OSError:
    facts["net"] = False
facts["transport"] = json.load(open(".kernel.json"))["transport"]
facts["limits"] = {{n: resource.getrlimit(getattr(resource, "RLIMIT_" + n))[0] for n in ("NPROC", "DATA", "FSIZE")}}
st = os.statvfs(".")
facts["work_bytes"] = st.f_blocks * st.f_frsize
try:
    os.kill(os.getppid(), 0)
    facts["signal"] = "allowed"
except OSError as exc:
    facts["signal"] = type(exc).__name__
facts["parent"] = os.getppid()
open("results/facts.json", "w").write(json.dumps(facts))'''


@pytest.mark.parametrize("mode", _modes())
def test_kernel_runs_in_a_sandbox(tmp_path, mode):
    """Only the notebook's copy in its folder, no current folder on sys.path, the trusted course_lib, and as
    far as the mode allows (see docs/grading.md's table): nothing of the course but what a learner's copy
    holds, no history, no network, nothing writable but its own folders, and limits in every mode."""
    secret = tmp_path / "instructor"
    secret.mkdir()
    (secret / "answers.txt").write_text("42")
    git = _git_dirs()
    secrets = [str(p) for p in (ROOT / ".git", ROOT / "tests", ROOT / "solutions", ROOT / "build", *git,
                                secret / "answers.txt")]
    token = f"probe-{os.getpid()}-{mode}"
    listener = adversarial.Listener()
    with isolation.Sandbox(mode, "other.ipynb", b"{}") as classmate, \
            isolation.Sandbox(mode, "mine.ipynb", b"{}", hide=[secret]) as sandbox:
        targets = [str(p / token) for p in (ROOT / "course_lib", ROOT, classmate.work, Path("/"), Path("/usr"))]
        source = PROBE.format(secrets=secrets, common=str(git[-1]), targets=targets, port=listener.port)
        probe = nbformat.v4.new_notebook()
        probe.cells = [nbformat.v4.new_code_cell(source)]
        got: dict = {}  # read while the kernel lives: in a namespace its folder ends with it
        runs = run_notebook(probe, sandbox, timeout=60,
                            after_cell=lambda i, run: got.update(facts=sandbox.read_result("facts.json")))
        assert runs[0].status == "ok", (runs[0], sandbox.startup_log())
        facts = json.loads(got["facts"])
        rlimits = sandbox.rlimits
    listener.sock.close()
    for target in targets:  # nothing planted may stay behind, whatever the verdict
        Path(target).unlink(missing_ok=True)
    assert [f for f in facts["ls"] if not f.startswith(".")] == ["mine.ipynb", "results", "tmp"], facts["ls"]
    assert not facts["cwd_on_path"] and facts["course_lib"] == str(ROOT / "course_lib" / "__init__.py")
    assert not {"PYTHONPATH", "COURSE_SOLUTIONS"} & set(facts["env"]), "the kernel's environment is built from nothing"
    assert facts["transport"] == "ipc", "the grader talks to every kernel over Unix sockets in its folder, not TCP"
    assert facts["limits"] == {k: rlimits[k] for k in ("NPROC", "DATA", "FSIZE")}, "limits in every mode"
    if mode in ("namespaces+uid", "namespaces"):
        assert facts["seen"] == [] and not facts["git_show"], f"the kernel sees the instructor's files: {facts}"
        shown = {Path(p).relative_to(ROOT).parts[0] for p in isolation.views()[str(ROOT)]}
        assert set(facts["root_ls"]) == shown and not {".git", "tests", "solutions", "build"} & shown, facts["root_ls"]
        assert facts["written"] == [], f"the kernel wrote outside its folder: {facts['written']}"
        if isolation.network_isolated(mode):
            assert not facts["net"] and listener.accepted == 0, "the kernel reached the grader's localhost"
        else:  # unshare --net refused here: the grade must say so
            assert "network OPEN" in isolation.describe(mode)
        assert facts["work_bytes"] <= sandbox.limits.disk, "the work folder is capped"
        assert facts["parent"] == 1, "the grader is not the kernel's parent: process 1 of its namespace is"
    if mode in ("namespaces+uid", "uid"):
        assert facts["uid"] >= isolation.UID_BASE and facts["signal"] == "PermissionError", facts
        assert facts["written"] == [], f"the kernel wrote outside its folder: {facts['written']}"


ABUSE = {  # student -> q1's body: an abuse of the machine (small sizes), then the right answer
    "fork_storm": "    import os, time\n    for _ in range(300):\n        if os.fork() == 0:\n"
                  "            time.sleep(30)\n            os._exit(0)\n    return x + 1",
    "memory_hog": "    import numpy\n    hog = [numpy.empty(2**28, numpy.uint8) for _ in range(16)]  # 4 GiB, never written\n"
                  "    return x + 1",
    "disk_filler": "    import os\n    for k in range(32):\n        with open(f'filler-{k}', 'wb') as f:\n"
                   "            f.write(os.urandom(2**20) * 8)\n    return x + 1",
}
SMALL = isolation.Limits(processes=64, memory=2**30, file=16 * 2**20, disk=64 * 2**20)


@pytest.mark.parametrize("name", sorted(ABUSE))
def test_limits_hold_without_any_isolation(tiny, name):
    """Even in mode ``none`` (no namespace, no user id: ``course check``, or a grader that can do nothing else)
    a memory hog, a disk filler and (unless the kernel runs as root, which the grade says) a fork storm score
    zero on their question, with the limit named. (A class with each, in the strongest mode, is in
    test_grading_adversarial.py.)"""
    if name == "fork_storm" and not isolation.processes_limited("none"):
        assert "processes NOT limited" in isolation.describe("none"), "the grade must say what it cannot limit"
        return
    path = _learner(tiny, name, lambda nb: _solve(nb, q1=ABUSE[name]))
    q = _by_name(grade_notebook(path, timeout=30, solutions=tiny["solutions"], isolation="none", limits=SMALL))
    reason = {"fork_storm": "limit of 64 processes", "memory_hog": "gives each process 1024 MiB",
              "disk_filler": "filled the sandbox's 64 MiB work folder"}[name]
    assert q["q1_add_one_test"].score == 0 and reason in q["q1_add_one_test"].message, q["q1_add_one_test"]


def test_a_kernel_that_cannot_start_is_a_clear_error(tiny, monkeypatch):
    monkeypatch.setattr(isolation.Sandbox, "argv",
                        lambda self: [sys.executable, "-c", "import sys; sys.exit('no kernel for you')"])
    path = _learner(tiny, "nokernel", _solve)
    with pytest.raises(GradingError, match="could not start a Python kernel.*no kernel for you"):
        grade_notebook(path, timeout=SHORT, solutions=tiny["solutions"])


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
        fake = _cell("got = {}", "q9_bonus_test", 50)  # a made-up test is dropped
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
    assert q.status == "failed" and q.score == 0 and q.hidden
    assert q.message.startswith("passes the visible tests but fails a hidden test") and "add_one(-1)" in q.message


def test_endless_loop_times_out_and_grading_goes_on(tiny):
    path = _learner(tiny, "loop", lambda nb: _solve(nb, q1="    while True:\n        pass"))
    start = time.monotonic()
    result = grade_notebook(path, timeout=SHORT, solutions=tiny["solutions"])
    elapsed = time.monotonic() - start
    q = _by_name(result)
    assert q["q1_add_one_test"].status == "timeout" and q["q1_add_one_test"].score == 0
    assert q["q2_double_test"].status == "passed", "the interrupted kernel grades the next question"
    assert elapsed < SHORT + 45, f"grading took {elapsed:.0f} s with a {SHORT} s limit"


def test_hang_that_ignores_interrupts_still_ends(tiny, monkeypatch):
    deaf = "    import signal\n    signal.signal(signal.SIGINT, signal.SIG_IGN)\n    while True:\n        pass"
    # this kernel never answers after the interrupt, however long it is given: 2 s instead of the grader's 10
    monkeypatch.setattr(execute, "RECOVER_TIMEOUT", 2)
    start = time.monotonic()
    result = grade_notebook(_learner(tiny, "deaf", lambda nb: _solve(nb, q1=deaf)), timeout=2,
                            solutions=tiny["solutions"])
    q = _by_name(result)
    assert q["q1_add_one_test"].status == "timeout"
    assert q["q2_double_test"].status == "error" and "stopped answering" in q["q2_double_test"].message
    assert time.monotonic() - start < 2 + execute.RECOVER_TIMEOUT + 45


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


def test_an_answer_that_cannot_travel_fails_with_a_clear_message(tiny):
    odd = "    class Two:\n        def __eq__(self, other):\n            return True\n    return Two()"
    q = _by_name(grade_notebook(_learner(tiny, "odd", lambda nb: _solve(nb, q2=odd)), timeout=SHORT,
                                solutions=tiny["solutions"]))["q2_double_test"]
    assert q.status == "error" and "cannot be sent to the grader" in q.message and "Two" in q.message


# ----- the command line ----------------------------------------------------------------------------


def _course(*args: str, solutions: Path | None = None, cwd: Path = ROOT, pythonpath: Path = ROOT
            ) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(pythonpath), **({"COURSE_SOLUTIONS": str(solutions)} if solutions else {})}
    return subprocess.run([sys.executable, "-m", "course_lib.tools.cli", *args], capture_output=True, text=True,
                          env=env, timeout=300, cwd=cwd)


def test_grade_json_schema_and_exit_status(tiny):
    path = _learner(tiny, "json", lambda nb: _solve(nb, q2="    return x"))
    run = _course("grade", str(path), "--json", "--timeout", str(SHORT), solutions=tiny["solutions"])
    assert run.returncode == 0, f"a low score is still a completed grading:\n{run.stderr}"
    out = json.loads(run.stdout)
    assert set(out) == {"notebook", "exercise", "score", "max_score", "questions"}
    assert (out["exercise"], out["score"], out["max_score"]) == ("90_tiny", 1, 3)
    for q in out["questions"]:
        assert set(q) == {"name", "title", "score", "max_score", "status", "message"}
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
    slow = "    import time\n    time.sleep(3)\n    return x + 1"
    start = time.monotonic()
    result = grade_notebook(_learner(tiny, "slow", lambda nb: _solve(nb, q1=slow)), timeout=SHORT,
                            solutions=tiny["solutions"], total_timeout=2)
    assert time.monotonic() - start < 2 + 40
    q = _by_name(result)
    assert q["q1_add_one_test"].status == "timeout"
    assert q["q2_double_test"].status == "timeout" and "overall limit" in q["q2_double_test"].message


def test_folder_of_submissions_in_parallel_into_csv_summary_and_feedback(tiny, tmp_path):
    folder = tmp_path / "class"
    for who, body in [("alice", "    return 2 * x"), ("bob", "    return x")]:
        (folder / who).mkdir(parents=True)
        nb = nbformat.read(_learner(tiny, who, lambda nb, b=body: _solve(nb, q2=b)), as_version=4)
        nbformat.write(nb, folder / who / "90_tiny.ipynb")
    nbformat.write(nbformat.read(_learner(tiny, "dave", _solve), as_version=4), folder / "dave_90_tiny.ipynb")
    (folder / "carol").mkdir()
    (folder / "carol" / "90_tiny.ipynb").write_text("not json")
    csv_path = tmp_path / "out" / "grades.csv"
    args = argparse.Namespace(notebook=str(folder), timeout=SHORT, json=False, csv=str(csv_path),
                              solutions=tiny["solutions"], jobs=2, notebook_timeout=60, feedback=None)
    assert commands.grade(args) == 1, "one submission could not be graded"
    rows = {r["submission"]: r for r in csv.DictReader(csv_path.open())}
    assert set(rows) == {"alice/90_tiny.ipynb", "bob/90_tiny.ipynb", "carol/90_tiny.ipynb", "dave_90_tiny.ipynb"}
    assert [rows[k]["student"] for k in sorted(rows)] == ["alice", "bob", "carol", "dave"]
    assert (rows["alice/90_tiny.ipynb"]["score"], rows["alice/90_tiny.ipynb"]["max_score"]) == ("3", "3")
    bob = rows["bob/90_tiny.ipynb"]
    assert (bob["q1_add_one_test"], bob["q2_double_test"]) == ("1", "0")
    assert bob["q1_add_one_test_reason"] == "" and "double(3) should be 6" in bob["q2_double_test_reason"]
    assert "q2_double_test: failed" in bob["problem"]
    assert "not valid JSON" in rows["carol/90_tiny.ipynb"]["problem"] and rows["carol/90_tiny.ipynb"]["score"] == ""
    summary = {r["question"]: r for r in csv.DictReader((tmp_path / "out" / "grades_summary.csv").open())}
    assert (summary["q2_double_test"]["graded"], summary["q2_double_test"]["pass_rate"]) == ("3", "0.667")
    assert float(summary["q2_double_test"]["mean_score"]) == pytest.approx(4 / 3, abs=1e-3)
    assert json.loads((tmp_path / "out" / "grades.json").read_text())["summary"]
    bob_feedback = (tmp_path / "out" / "feedback" / "bob" / "90_tiny.md").read_text()
    assert "1 of 3 points" in bob_feedback and "double(3) should be 6" in bob_feedback
    assert sorted(p.parent.name for p in (tmp_path / "out" / "feedback").rglob("*.md")) == ["alice", "bob", "dave"]
    assert not list((tmp_path / "out").glob(".*.tmp")), "every output is renamed into place"


def _class(tiny: dict[str, Path], folder: Path, who: dict[str, str]) -> Path:
    """``folder/<rel>`` for each ``rel -> q1 body`` of ``who`` (q2 solved): a class of the tiny exercise."""
    for rel, body in who.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(nbformat.read(_learner(tiny, "class", lambda nb: _solve(nb, q1=body)), as_version=4),
                       folder / rel)
    return folder


def _rows(csv_path: Path) -> dict[str, dict]:
    return {r["submission"]: r for r in csv.DictReader(csv_path.read_text().splitlines())}


def test_students_whose_ids_collide_are_refused_and_the_rest_graded(tiny, tmp_path):
    right = "    return x + 1"
    folder = _class(tiny, tmp_path / "class", {rel: right for rel in (
        "a b/90_tiny.ipynb", "a_b/90_tiny.ipynb", "Zoe/90_tiny.ipynb", "zoe_90_tiny.ipynb", "carl/90_tiny.ipynb",
        "carl/old/90_tiny.ipynb", "dana/90_tiny.ipynb")})
    out = classroom.Outputs(tmp_path / "out" / "grades.csv", tmp_path / "out" / "feedback")
    subs = {s.rel: s for s in classroom.grade_folder(folder, timeout=SHORT, solutions=tiny["solutions"], outputs=out)}
    assert subs["dana/90_tiny.ipynb"].result.score == 3, subs["dana/90_tiny.ipynb"].problem
    for rel, other in [("a b/90_tiny.ipynb", "a_b/90_tiny.ipynb"), ("a_b/90_tiny.ipynb", "a b/90_tiny.ipynb"),
                       ("Zoe/90_tiny.ipynb", "zoe_90_tiny.ipynb"), ("zoe_90_tiny.ipynb", "Zoe/90_tiny.ipynb")]:
        assert subs[rel].result is None and other in subs[rel].problem and "rename" in subs[rel].problem, rel
    for rel in ("carl/90_tiny.ipynb", "carl/old/90_tiny.ipynb"):
        assert subs[rel].result is None and "more than once" in subs[rel].problem and "keep one" in subs[rel].problem
    assert sorted(p.parent.name for p in (tmp_path / "out" / "feedback").rglob("*.md")) == ["dana"]
    assert _rows(out.csv)["a b/90_tiny.ipynb"]["problem"] == subs["a b/90_tiny.ipynb"].problem


def test_a_worker_past_its_deadline_is_stopped_and_the_rest_graded(tiny, tmp_path):
    folder = _class(tiny, tmp_path / "class", {"stuck/90_tiny.ipynb": "    import time\n    time.sleep(120)",
                                                "quick/90_tiny.ipynb": "    return x + 1"})
    import psutil

    # the test session's own processes (its background notebooks and their ranks) are not the grader's
    already = {p.pid for p in psutil.Process().children(recursive=True)}
    start = time.monotonic()
    subs = {s.student: s for s in classroom.grade_folder(folder, timeout=300, solutions=tiny["solutions"], jobs=2,
                                                         deadline=20)}
    # 20 s: the honest notebook has the same deadline, and its kernel took over 8 s to start on a loaded machine
    elapsed = time.monotonic() - start
    assert subs["quick"].result is not None and subs["quick"].result.score == 3, subs["quick"].problem
    assert subs["stuck"].result is None and "ran past its deadline of 20 s" in subs["stuck"].problem
    assert elapsed < 20 + 20, f"a deadline of 20 s, graded in {elapsed:.0f} s"
    left = [p for p in psutil.Process().children(recursive=True)
            if not ({p.pid} | {q.pid for q in p.parents()}) & already
            and "resource_tracker" not in " ".join(p.cmdline())]
    assert not left, f"the stopped worker left {[p.cmdline() for p in left]}"


def test_an_interrupted_run_keeps_what_was_graded(tiny, tmp_path):
    import signal

    import psutil

    marker = f"{300 + os.getpid() % 1000}.{os.getpid()}"  # the slow learner's child process: sleep <marker>
    slow = f"    import subprocess\n    subprocess.run(['sleep', '{marker}'])"
    folder = _class(tiny, tmp_path / "class", {"a_quick/90_tiny.ipynb": "    return x + 1",
                                                "b_slow/90_tiny.ipynb": slow})
    csv_path = tmp_path / "out" / "grades.csv"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COURSE_SOLUTIONS": str(tiny["solutions"])}
    run = subprocess.Popen([sys.executable, "-m", "course_lib.tools.cli", "grade", str(folder), "-j", "1",
                            "--timeout", "600", "--csv", str(csv_path)], env=env, start_new_session=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (csv_path.exists() and _rows(csv_path).get("a_quick/90_tiny.ipynb", {}).get("score")):
            assert run.poll() is None and time.monotonic() < deadline, "the first notebook was never written out"
            time.sleep(0.2)
        while not [q for q in psutil.process_iter(["cmdline"]) if marker in (q.info["cmdline"] or [])]:
            assert run.poll() is None and time.monotonic() < deadline, "the slow notebook never started"
            time.sleep(0.2)
        os.killpg(run.pid, signal.SIGINT)  # as Ctrl-C in a terminal: to the whole foreground group
        _, err = run.communicate(timeout=30)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    rows = _rows(csv_path)
    assert run.returncode == 130 and "stopped" in err, err[-2000:]
    assert rows["a_quick/90_tiny.ipynb"]["score"] == "3" and rows["b_slow/90_tiny.ipynb"]["score"] == ""
    assert "not graded yet" in rows["b_slow/90_tiny.ipynb"]["problem"]
    assert (tmp_path / "out" / "feedback" / "a_quick" / "90_tiny.md").exists()
    assert json.loads(csv_path.with_suffix(".json").read_text())["submissions"][0]["score"] == 3
    time.sleep(1)
    left = [p.pid for p in psutil.process_iter(["cmdline"]) if marker in (p.info["cmdline"] or [])]
    assert not left, "the interrupted notebook's processes outlived the grader"


def test_checks_stop_at_their_time_limit_and_cost_only_their_question(tiny, monkeypatch):
    from course_lib.tools.grading import checker

    nb = nbformat.read(tiny["solution"], as_version=4)
    test = next(c for c in nb.cells if grade_id(c) == "q1_add_one_test")
    test.source = test.source.replace('assert got["1"] == 2', 'assert all(i >= 0 for i in range(got["1"]))')
    ex = parse_exercise(nb, tiny["solution"])
    monkeypatch.setattr(checker, "CHECK_TIMEOUT", 0.5)
    start = time.monotonic()
    verdicts = checker.Checker(ex).check({"q1_add_one_test": {"1": 10**12, "-1": 0},
                                          "q2_double_test": {"3": 6, "0": 0}})
    assert time.monotonic() - start < 3
    assert verdicts["q1_add_one_test"].status == "error" and "ran past 0.5 s" in verdicts["q1_add_one_test"].message
    assert verdicts["q2_double_test"].status == "passed"


def test_feedback_never_quotes_a_hidden_test(tiny, tmp_path):
    from course_lib.tools.grading.classroom import Submission, feedback_markdown
    from course_lib.tools.grading.exercise import Catalog

    leak = ("    import linecache, sys\n    lines = linecache.getlines(sys._getframe(1).f_code.co_filename)\n"
            "    raise ValueError(' | '.join(l.strip() for l in lines[-3:]))")
    path = _learner(tiny, "leak", lambda nb: _solve(nb, q1="    return abs(x) + 1", q2=leak))
    ex = Catalog(tiny["solutions"]).exercises["90_tiny"]
    result = grade_notebook(path, timeout=SHORT, exercise=ex)
    assert "double(zero)" in _by_name(result)["q2_double_test"].message, "the instructor's CSV says what happened"
    text = feedback_markdown(Submission(path, rel="leak/90_tiny.ipynb", exercise=ex, result=result))
    for line in ("got[\"-1\"] = add_one(-1)", "add_one(-1) should be 0", "got[\"0\"] = double(zero)", "zero = 0",
                 "double(0) should be 0"):
        assert line not in text, f"the feedback quotes the hidden test: {line}"
    assert "fails a hidden test" in text and "hint: one plus sign is enough." in text


def test_check_gives_friendly_messages_and_hints(tiny, capsys):
    args = argparse.Namespace(notebook=str(tiny["exercise"]), timeout=SHORT, solutions=tiny["solutions"])
    assert commands.check(args) == 1
    out = capsys.readouterr().out
    assert "[to do] q1_add_one_test" in out and "one plus sign is enough." in out
    assert "0 of 2 questions pass their visible tests" in out
    solved = _learner(tiny, "check", lambda nb: _solve(nb, q1="    return abs(x) + 1"))
    args.notebook = str(solved)
    assert commands.check(argparse.Namespace(**vars(args))) == 0, "the hidden test is not run by check"
    out = capsys.readouterr().out
    assert "2 of 2 questions pass" in out and commands.ALL_VISIBLE_PASS in out and "Well done" not in out


# ----- the learner's copy of the course ------------------------------------------------------------------


def _hidden_test_lines() -> set[str]:
    """Every line of every hidden test of every solutions notebook, read here without the grader's help,
    less those the generated exercises also show (they are public by design) and those shorter than ten
    characters (``else:``, ``return m``: Python, not a test)."""
    hidden, public = set(), set()
    for path in SOLUTIONS:
        inside = False
        for cell in nbformat.read(path, as_version=4).cells:
            for line in cell.source.splitlines():
                if "BEGIN HIDDEN TESTS" in line:
                    inside = True
                elif "END HIDDEN TESTS" in line:
                    inside = False
                elif inside and len(line.strip()) >= 10:
                    hidden.add(line.strip())
        for cell in nbformat.read(ROOT / "exercises" / path.name, as_version=4).cells:
            public |= {line.strip() for line in cell.source.splitlines()}
    return hidden - public


@pytest.fixture(scope="module")
def released(tmp_path_factory) -> Path:
    dest = tmp_path_factory.mktemp("release") / "course"
    run = _course("release", str(dest))
    assert run.returncode == 0, run.stderr
    return dest


def test_release_holds_no_solution_and_no_hidden_test_line(released):
    lines = _hidden_test_lines()
    assert len(lines) > 200, f"only {len(lines)} hidden lines found: the search is broken"
    assert not (released / "solutions").exists() and not (released / "tests").exists()
    assert not (released / "benchmarks" / "bench_grading.py").exists(), "it needs the solutions"
    for path in released.rglob("*"):
        if path.is_file():
            text = path.read_bytes().decode("utf-8", errors="ignore")
            found = [line for line in lines if line in text]
            assert not found, f"{path.relative_to(released)} holds hidden-test lines: {found[:3]}"
    for name in ("README.md", "pyproject.toml", "Makefile", "environment.yml", "data/README.md",
                 "course_lib/tools/grading/grade.py", "notebooks/01_memory_anatomy.ipynb", "exercises/README.md"):
        assert (released / name).is_file(), f"the learner's copy lacks {name}"
    assert sorted(p.name for p in (released / "exercises").glob("*.ipynb")) == [p.name for p in SOLUTIONS]


def test_the_learners_copy_says_how_to_study_and_check_not_how_to_grade(released):
    import re

    for rel in ("README.md", "exercises/README.md"):
        text = (released / rel).read_text()
        assert "course check" in text, f"{rel} does not say how to check an exercise"
        for word in ("solutions/", "course grade", "sandbox", "isolation", "(instructors)", "nbgrader"):
            assert word not in text, f"the learner's {rel} speaks of {word!r}, the instructor's business"
        for link in re.findall(r"\]\(([^)#]+)", text):
            assert link.startswith("http") or ((released / rel).parent / link).exists(), f"{rel}: {link} is missing"
    readme = (released / "README.md").read_text()
    assert "make lab" in readme and all(f"(notebooks/{p.name})" in readme for p in (ROOT / "notebooks").glob("*.ipynb"))
    assert not (released / "docs" / "grading.md").exists() and not (released / "docs" / "instructors.md").exists()


def test_check_works_in_the_learners_copy_from_its_visible_tests(released, tmp_path):
    work = tmp_path / "02_batch_size.ipynb"
    solved = nbformat.read(released / "exercises" / "02_batch_size.ipynb", as_version=4)
    answers = {c.metadata["nbgrader"]["grade_id"]: c.source for c in nbformat.read(ROOT / "solutions" / work.name,
                                                                                   as_version=4).cells
               if c.metadata.get("nbgrader", {}).get("solution")}
    for cell in solved.cells:
        if grade_id(cell) in answers:
            cell.source = answers[grade_id(cell)]
    nbformat.write(solved, work)
    run = _course("check", str(work), cwd=released, pythonpath=released)
    assert run.returncode == 0, run.stdout + run.stderr
    assert commands.ALL_VISIBLE_PASS in run.stdout and "Well done" not in run.stdout
    assert "3 of 3 questions pass their visible tests" in run.stdout
    run = _course("grade", str(work), cwd=released, pythonpath=released)
    assert run.returncode != 0 and "learner's copy" in run.stderr, "no hidden tests to grade with in the copy"


def test_release_refuses_a_folder_in_use(tmp_path, capsys):
    (tmp_path / "x.txt").write_text("mine")
    assert cli.main(["release", str(tmp_path)]) == 2 and "not empty" in capsys.readouterr().err
    assert cli.main(["release", str(ROOT / "notebooks" / "copy")]) == 2 and "choose another" in capsys.readouterr().err
    assert not (ROOT / "notebooks" / "copy").exists()
