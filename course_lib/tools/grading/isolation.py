"""Where a learner's kernel runs: a fresh folder, a clean environment, limits, and as little reach as the machine allows.

Every notebook gets a new temporary work folder holding only a copy of the
notebook (never the files handed in beside it) and runs ``python -I`` with
the trusted ``course_lib`` first on ``sys.path``. The grader talks to it over
Unix sockets in that folder (ZeroMQ's ``ipc`` transport), never TCP. In every
mode it gets the limits of ``Limits`` (processes, memory per process, file
size, and the size of its folder). How far it is shut off depends on what the
machine allows (``detect``), strongest first:

- ``namespaces+uid`` (the grader is root and ``unshare`` works, as in CI): new
  PID, mount and network namespaces and a user id of its own, drawn at random
  per notebook. The kernel sees of the course only what a learner's copy holds
  (``course_lib``, ``data``, ``exercises``), no git history, solutions or tests;
  the whole file system is read-only but its work folder and temporary
  folders (one size-capped ``tmpfs``); it has no network (its own, with only
  a loopback); it cannot see, let alone signal, the grader; when it ends,
  everything left in its namespace is killed, detached processes too.
- ``uid`` (root, no namespaces, e.g. a container without ``CAP_SYS_ADMIN``): its
  own user id, so it cannot signal the grader or write the instructor's files
  (but can read what is world-readable, and keeps the network); every process
  of that user id is killed at the end.
- ``namespaces`` (not root, unprivileged user namespaces allowed): the same
  namespaces and read-only view as the first mode, with the instructor's user
  id but no capabilities.
- ``none``: only the fresh folder, the clean environment, the limits and its
  own session; a detached process can outlive it and it can signal the grader
  (a worker process absorbs that, see ``classroom``). ``course check`` runs
  this way: it is the learner's own code on the learner's own machine.

``describe`` says in words what the chosen mode protects against and what not
(``course grade`` prints it; docs/grading.md has the table).
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from course_lib.tools.grading import wire
from course_lib.tools.grading.exercise import ROOT, GradingError
from course_lib.tools.grading.limits import Limits, limit_reason  # noqa: F401 (part of this module's API)

MODES = ("namespaces+uid", "uid", "namespaces", "none")
NAMESPACED = ("namespaces+uid", "namespaces")
SANDBOX_PY = Path(__file__).with_name("sandbox.py")
UID_BASE = int(os.environ.get("COURSE_GRADER_UID_BASE", "2000000000"))  # kernels get UID_BASE + random(2**24)
NS_FLAGS = ["--pid", "--fork", "--kill-child", "--mount", "--mount-proc", "--propagation", "private"]
LEARNER_COPY = ("course_lib", "data", "exercises")  # what of the course a kernel sees: a learner's copy holds them
_PROBE = ("import ctypes; libc = ctypes.CDLL(None, use_errno=True); "
          "raise SystemExit(libc.mount(b'none', b'/tmp', b'tmpfs', 0, None))")


def _works(cmd: list[str]) -> bool:
    try:
        return subprocess.run([*cmd, sys.executable, "-I", "-c", _PROBE], capture_output=True,
                              timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@functools.lru_cache(maxsize=None)
def _ns_flags() -> tuple[str, ...] | None:
    """The ``unshare`` flags that work here: with a network namespace if allowed, else without; None if none do."""
    exe = shutil.which("unshare")
    if exe is None:
        return None
    user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    for flags in ([*NS_FLAGS, "--net"], NS_FLAGS):
        if _works([exe, *user, *flags]):
            return (exe, *flags)
    return None


def _unshare(user_ns: bool) -> list[str]:
    exe, *flags = _ns_flags() or (shutil.which("unshare") or "unshare", *NS_FLAGS)
    return [exe, *(["--user", "--map-root-user"] if user_ns else []), *flags]


@functools.lru_cache(maxsize=None)
def detect() -> str:
    """The strongest mode this machine allows (``COURSE_GRADER_ISOLATION`` may ask for a weaker one)."""
    root = os.geteuid() == 0
    wanted = os.environ.get("COURSE_GRADER_ISOLATION")
    works = _ns_flags() is not None
    best = ("namespaces+uid" if works else "uid") if root else ("namespaces" if works else "none")
    if wanted in MODES and MODES.index(wanted) >= MODES.index(best):
        return wanted
    return best


def network_isolated(mode: str) -> bool:
    """Whether a kernel in ``mode`` has a network namespace of its own (no way out, only a loopback)."""
    return mode in NAMESPACED and "--net" in (_ns_flags() or ())


def processes_limited(mode: str) -> bool:
    """Whether ``RLIMIT_NPROC`` holds: the kernel of root itself ignores it for root's processes."""
    return mode in ("namespaces+uid", "uid") or os.geteuid() != 0


def describe(mode: str, limits: Limits | None = None) -> str:
    """One paragraph: what a kernel in ``mode`` cannot do on this machine, and what it still can."""
    lim = limits or Limits.from_env()
    mib = lambda n: f"{n / 2**20:.0f} MiB"  # noqa: E731
    procs = f"{lim.processes} processes" if processes_limited(mode) else "processes NOT limited (root's own user id)"
    limits_text = (f"limits: {procs}, {mib(lim.memory)} of memory per process, {mib(lim.file)} per file, "
                   f"{mib(lim.disk)} of work folder ({'a tmpfs' if mode in NAMESPACED else 'checked after each cell'})")
    net = ("no network (a namespace of its own)" if network_isolated(mode) else
           "network OPEN (no network namespace here): it can reach other machines and this one's localhost")
    files = {
        "namespaces+uid": "sees only course_lib, data and exercises of the course (no .git, tests, solutions, "
                          "build), everything read-only but its own folders; a user id of its own",
        "namespaces": "sees only course_lib, data and exercises of the course (no .git, tests, solutions, "
                      "build), everything read-only but its own folders; the instructor's user id, no capabilities",
        "uid": "a user id of its own: writes nothing of the instructor's, but READS what is world-readable "
               "(the solutions and .git included unless made private)",
        "none": "the grader's user id: READS AND WRITES whatever the grader can (course_lib, the solutions, "
                "other submissions); only for `course check` or a throw-away account",
    }[mode]
    return f"{mode}: {files}; {net}; {limits_text}"


@functools.lru_cache(maxsize=None)
def _kernel_sys_path() -> tuple[str, ...]:
    """``sys.path`` of ``python -I`` here: the folders the kernel imports from (site-packages and .pth entries)."""
    try:
        out = subprocess.run([sys.executable, "-I", "-c", "import sys, json; print(json.dumps(sys.path))"],
                             capture_output=True, text=True, timeout=60).stdout
        return tuple(p for p in json.loads(out) if p and os.path.isdir(p))
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return ()


def _needed() -> list[Path]:
    """Paths the kernel must keep seeing: this course_lib, the interpreter and every folder it imports from."""
    paths = {ROOT, Path(sys.prefix), Path(sys.base_prefix), Path(sys.executable).resolve().parent}
    paths |= {Path(p) for p in _kernel_sys_path()}
    return sorted({p.resolve() for p in paths})


def _within(path: Path, other: Path) -> bool:
    return path == other or other in path.parents


def git_folders() -> tuple[list[Path], list[Path]]:
    """This repository's git folders, and its other checkouts (worktrees: each holds the solutions)."""
    git = ROOT / ".git"
    if not git.is_file():
        return [git], []
    try:
        own = Path(git.read_text().split("gitdir:", 1)[1].strip())
        common = (own / (own / "commondir").read_text().strip()).resolve() if (own / "commondir").exists() else own
    except (OSError, IndexError):
        return [], []
    checkouts = [common.parent] if common.name == ".git" else []
    for gitdir in (common / "worktrees").glob("*/gitdir"):
        try:
            checkouts.append(Path(gitdir.read_text().strip()).parent)
        except OSError:
            pass
    return [own, common], [c.resolve() for c in checkouts if c.exists() and c.resolve() != ROOT]


def views() -> dict[str, list[str]]:
    """Folders the kernel sees only part of: this course (what a learner's copy holds) and the repository's
    other checkouts (only what this Python imports from them); folder -> what stays visible, read-only."""
    needed = _needed()
    _, others = git_folders()
    folders = [ROOT, *others]
    out: dict[str, list[str]] = {}
    for folder in folders:
        keep = [folder / n for n in LEARNER_COPY] if folder == ROOT else []
        keep += [n for n in needed if folder in n.parents] + [f for f in folders if folder in f.parents]
        keep = [k for k in keep if k.is_dir()]
        out[str(folder)] = sorted({str(k) for k in keep if not any(o in k.parents for o in keep)})
    return out


def hideable(paths: list[Path]) -> tuple[list[str], list[str]]:
    """The folders to hide that exist, and those left visible because the kernel needs what is inside."""
    keep, skipped = [], []
    for p in sorted({Path(p).resolve() for p in paths}):
        if not p.exists():
            continue
        if any(_within(n, p) for n in _needed()):
            skipped.append(str(p))
        else:
            keep.append(str(p))
    return keep, skipped


def unreachable(uid: int, gid: int) -> dict[str, list[str]]:
    """Folders on the way to what the kernel needs that another user cannot enter (``/root`` for a Python
    installed under root's home): folder -> the needed paths under it."""
    out: dict[str, list[str]] = {}
    for needed in _needed():
        for parent in [*reversed(needed.parents), needed]:
            info = parent.stat()
            if info.st_uid == uid:
                continue
            bit = 0o010 if info.st_gid == gid else 0o001
            if not info.st_mode & bit:
                out.setdefault(str(parent), [])
                if parent != needed:
                    out[str(parent)].append(str(needed))
                break
    return {k: sorted(set(v)) for k, v in out.items()}


def kernel_env(workdir: Path, threads: int) -> dict[str, str]:
    """The whole environment of a kernel: nothing inherited but a plain PATH."""
    home = str(workdir)
    return {
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), "/usr/local/bin", "/usr/bin", "/bin"]),
        "HOME": home, "USER": "learner", "LOGNAME": "learner", "LANG": "C.UTF-8", "TMPDIR": f"{home}/tmp",
        "MPLBACKEND": "Agg", "MPLCONFIGDIR": f"{home}/.config/matplotlib", "IPYTHONDIR": f"{home}/.ipython",
        "COURSE_PROGRESS": "0", "PYDEVD_DISABLE_FILE_VALIDATION": "1", "JUPYTER_PLATFORM_DIRS": "1",
        "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
    }


def _tasks_of(uid: int) -> int:
    """Processes and threads now running as ``uid`` (what ``RLIMIT_NPROC`` counts)."""
    count = 0
    for p in psutil.process_iter(["uids", "num_threads"]):
        if p.info["uids"] and p.info["uids"].real == uid:
            count += p.info["num_threads"] or 1
    return count


@dataclass
class Sandbox:
    """The folders and the launch command of one kernel; ``close()`` kills what is left and deletes them."""

    mode: str
    notebook_name: str
    notebook_bytes: bytes
    hide: list[Path] = field(default_factory=list)
    threads: int = 1
    limits: Limits | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown isolation mode {self.mode!r}; choose one of {', '.join(MODES)}")
        self.limits = self.limits or Limits.from_env()
        self.namespaces = self.mode in NAMESPACED
        self.uid = UID_BASE + secrets.randbelow(2**24) if self.mode in ("namespaces+uid", "uid") else None
        blocked = unreachable(self.uid, self.uid) if self.uid is not None else {}
        if blocked and self.mode == "uid":
            raise GradingError(
                f"a kernel running as another user cannot reach {', '.join(blocked)}, where this Python or the "
                "course lives; install them where other users can read them, or set COURSE_GRADER_ISOLATION=none")
        # base (0711: others may pass through, not list) / ctl (0700: the grader's) and work (the kernel's)
        self.base = Path(tempfile.mkdtemp(prefix="course-grading-"))
        self.base.chmod(0o711)
        self.ctl = self.base / "ctl"
        self.ctl.mkdir(mode=0o700)
        self.work = self.base / "work"
        self.results = self.work / "results"
        for d in (self.work, self.results, self.work / "tmp"):
            d.mkdir(mode=0o700)
        (self.work / self.notebook_name).write_bytes(self.notebook_bytes)
        if self.uid is not None:
            for path in [self.work, *self.work.rglob("*")]:
                os.chown(path, self.uid, self.uid)
        # In a namespace the kernel's folder is a tmpfs the grader reaches through the launcher's /proc entry
        # (``attach``); its Unix sockets ``.kernel-1`` ... ``.kernel-5`` live there too.
        self.live = self.work
        self.ipc = self.work / ".kernel"
        self.connection_file = self.ctl / "kernel.json"
        self.log = self.ctl / "launcher.log"
        gits, _ = git_folders()
        self.hidden, self.visible_anyway = hideable(self.hide + [ROOT / "solutions", *gits])
        lim = self.limits
        nproc = lim.processes if self.uid is not None or os.geteuid() == 0 else lim.processes + _tasks_of(os.getuid())
        self.rlimits = {"NPROC": nproc, "CORE": 0, "DATA": lim.memory, "FSIZE": lim.file}
        env = kernel_env(self.work, self.threads)
        if not self.namespaces:  # the kernel's parent is this process: ipykernel then exits if it dies
            env["JPY_PARENT_PID"] = str(os.getpid())
        config = {
            "workdir": str(self.work), "uid": self.uid, "gid": self.uid, "notebook": self.notebook_name,
            "namespaces": self.namespaces, "expose": blocked, "views": views() if self.namespaces else {},
            "hide": self.hidden, "disk": lim.disk, "loopback": network_isolated(self.mode),
            "own_temp": not any(_within(n, Path(t)) for n in _needed() for t in ("/tmp", "/var/tmp", "/dev/shm")),
            "python": sys.executable, "sys_path": [str(ROOT)], "env": env,
            "connection_file": str(self.connection_file), "rlimits": self.rlimits,
        }
        self.config = self.ctl / "sandbox.json"
        self.config.write_text(json.dumps(config))

    def argv(self) -> list[str]:
        """The kernel command line for jupyter_client."""
        launch = [sys.executable, "-I", "-B", str(SANDBOX_PY), str(self.config)]
        return [*_unshare(self.mode == "namespaces"), *launch] if self.namespaces else launch

    def attach(self, pid: int) -> str:
        """Once the launcher runs as ``pid``: the prefix of the kernel's Unix sockets as the grader reaches them."""
        if self.namespaces:  # unshare's one child is the namespace's process 1, whose folder is the kernel's
            deadline = time.monotonic() + 30
            while True:
                try:
                    proc = psutil.Process(pid)
                    children, ended = proc.children(), proc.status() == psutil.STATUS_ZOMBIE
                except psutil.Error:
                    children, ended = [], True
                if children:
                    self.live = Path(f"/proc/{children[0].pid}/cwd")
                    break
                if ended or time.monotonic() > deadline:
                    raise GradingError("the sandbox's launcher did not start: " + self.startup_log())
                time.sleep(0.005)
        return str(self.live / ".kernel")

    def read_result(self, name: str, max_bytes: int = wire.MAX_BYTES) -> bytes:
        """The bytes of ``results/name`` in the kernel's folder (a plain file; raises ``wire.WireError``)."""
        return wire.read_plain(str(self.live / "results"), name, max_bytes)

    def over_limit(self) -> str:
        """Why the kernel must stop, if its folder outgrew the limit (a tmpfs enforces it in a namespace)."""
        if self.namespaces:
            return ""
        used, stack = 0, [str(self.work)]
        while stack and used <= self.limits.disk:
            try:
                with os.scandir(stack.pop()) as entries:
                    for e in entries:
                        info = e.stat(follow_symlinks=False)
                        used += info.st_blocks * 512
                        if e.is_dir(follow_symlinks=False):
                            stack.append(e.path)
            except OSError:
                continue
        if used > self.limits.disk:
            return (f"filled the sandbox's {self.limits.disk / 2**20:.0f} MiB work folder (found after the cell; "
                    "without a namespace the folder is measured, not capped)")
        return ""

    def startup_log(self, limit: int = 2000) -> str:
        """What the launcher and the kernel printed (for a kernel that did not start)."""
        try:
            with open(self.log, "rb") as f:
                return f.read(limit).decode(errors="replace").strip()[-limit:]
        except OSError:
            return ""

    def kill_leftovers(self) -> int:
        """Kill every process still running as the kernel's user id (its own, drawn for this notebook)."""
        if self.uid is None:
            return 0
        killed = 0
        for _ in range(20):  # a process may fork while we look: repeat until none is left
            procs = [p for p in psutil.process_iter(["uids"]) if p.info["uids"] and self.uid in p.info["uids"]]
            if not procs:
                break
            for p in procs:
                try:
                    p.kill()
                    killed += 1
                except psutil.Error:
                    pass
            time.sleep(0.05)
        return killed

    def close(self) -> None:
        self.kill_leftovers()
        shutil.rmtree(self.base, ignore_errors=True)

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
