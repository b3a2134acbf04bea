"""Where a learner's kernel runs: a fresh folder, a clean environment, and as little reach as the machine allows.

Every notebook gets a new temporary work folder holding only a copy of the
notebook (never the files handed in beside it) and runs ``python -I`` with
the trusted ``course_lib`` first on ``sys.path``. How far it is shut off
depends on what the machine allows (``detect``), strongest first:

- ``namespaces+uid`` (the grader is root and ``unshare`` works, as in CI): new
  PID and mount namespaces and a user id of its own, drawn at random per
  notebook. The kernel cannot see, let alone signal, the grader; the
  instructor's folders are hidden under empty mounts; ``/tmp`` is its own; when
  it ends, everything left in its namespace is killed, detached processes too.
- ``uid`` (root, no namespaces, e.g. a container without ``CAP_SYS_ADMIN``): its
  own user id, so it cannot signal the grader or write the instructor's files
  (but can read what is world-readable); every process of that user id is
  killed at the end.
- ``namespaces`` (not root, unprivileged user namespaces allowed): the same
  namespaces, with the instructor's user id but no capabilities; it can still
  write what the instructor can write outside the hidden folders.
- ``none``: only the fresh folder, the clean environment and its own session;
  a detached process can outlive it and it can signal the grader (a worker
  process absorbs that, see ``classroom``). ``course check`` runs this way: it
  is the learner's own code on the learner's own machine.
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

from course_lib.tools.grading.exercise import ROOT, GradingError

MODES = ("namespaces+uid", "uid", "namespaces", "none")
SANDBOX_PY = Path(__file__).with_name("sandbox.py")
UID_BASE = int(os.environ.get("COURSE_GRADER_UID_BASE", "2000000000"))  # kernels get UID_BASE + random(2**24)
NS_FLAGS = ["--pid", "--fork", "--kill-child", "--mount", "--mount-proc", "--propagation", "private"]
RLIMITS = {"NPROC": 512, "CORE": 0, "FSIZE": 2**30}  # processes of the kernel's user id, core dumps, file size
_PROBE = ("import ctypes; libc = ctypes.CDLL(None, use_errno=True); "
          "raise SystemExit(libc.mount(b'none', b'/tmp', b'tmpfs', 0, None))")


def _unshare(root: bool) -> list[str] | None:
    exe = shutil.which("unshare")
    if exe is None:
        return None
    return [exe, *([] if root else ["--user", "--map-root-user"]), *NS_FLAGS]


@functools.lru_cache(maxsize=None)
def detect() -> str:
    """The strongest mode this machine allows (``COURSE_GRADER_ISOLATION`` may ask for a weaker one)."""
    root = os.geteuid() == 0
    wanted = os.environ.get("COURSE_GRADER_ISOLATION")
    cmd = _unshare(root)
    works = False
    if cmd is not None:
        try:
            works = subprocess.run([*cmd, sys.executable, "-I", "-c", _PROBE], capture_output=True,
                                   timeout=30).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            works = False
    best = ("namespaces+uid" if works else "uid") if root else ("namespaces" if works else "none")
    if wanted in MODES and MODES.index(wanted) >= MODES.index(best):
        return wanted
    return best


def _needed() -> list[Path]:
    """Paths the kernel must keep seeing: this course_lib, the interpreter and its libraries."""
    paths = {ROOT, Path(sys.prefix), Path(sys.base_prefix), Path(sys.executable).resolve().parent}
    return sorted(p.resolve() for p in paths)


def _within(path: Path, other: Path) -> bool:
    return path == other or other in path.parents


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


@dataclass
class Sandbox:
    """The folders and the launch command of one kernel; ``close()`` kills what is left and deletes them."""

    mode: str
    notebook_name: str
    notebook_bytes: bytes
    hide: list[Path] = field(default_factory=list)
    threads: int = 1

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown isolation mode {self.mode!r}; choose one of {', '.join(MODES)}")
        self.uid = UID_BASE + secrets.randbelow(2**24) if self.mode in ("namespaces+uid", "uid") else None
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
        self.connection_file = self.ctl / "kernel.json"
        self.log = self.ctl / "launcher.log"
        self.hidden, self.visible_anyway = hideable(self.hide + [ROOT / "solutions"])
        blocked = unreachable(self.uid, self.uid) if self.uid is not None else {}
        if blocked and self.mode == "uid":
            raise GradingError(
                f"a kernel running as another user cannot reach {', '.join(blocked)}, where this Python or the "
                "course lives; install them where other users can read them, or set COURSE_GRADER_ISOLATION=none")
        env = kernel_env(self.work, self.threads)
        namespaces = self.mode in ("namespaces+uid", "namespaces")
        if not namespaces:  # the kernel's parent is this process: ipykernel then exits if it dies
            env["JPY_PARENT_PID"] = str(os.getpid())
        config = {
            "workdir": str(self.work), "uid": self.uid, "gid": self.uid, "hide": self.hidden, "expose": blocked,
            "namespaces": namespaces,
            "own_temp": not any(_within(n, Path(t)) for n in _needed() for t in ("/tmp", "/var/tmp", "/dev/shm")),
            "python": sys.executable, "sys_path": [str(ROOT)], "env": env,
            "connection_file": str(self.connection_file),
            "rlimits": RLIMITS if self.uid is not None else {},
        }
        self.config = self.ctl / "sandbox.json"
        self.config.write_text(json.dumps(config))

    def argv(self) -> list[str]:
        """The kernel command line for jupyter_client."""
        launch = [sys.executable, "-I", "-B", str(SANDBOX_PY), str(self.config)]
        if self.mode in ("namespaces+uid", "namespaces"):
            return [*_unshare(self.mode == "namespaces+uid"), *launch]
        return launch

    def startup_log(self, limit: int = 2000) -> str:
        """What the launcher and the kernel printed (for a kernel that did not start)."""
        text = ""
        for path in (self.log, self.work / ".kernel.log"):
            try:
                with open(path, "rb") as f:
                    text += f.read(limit).decode(errors="replace")
            except OSError:
                pass
        return text.strip()[-limit:]

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
