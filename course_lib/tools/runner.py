"""Execute the course's notebooks and gather their results (``course run``).

Each notebook runs in its own kernel through papermill with ``PROFILE``
injected, writes its claims to ``<out>/results/<stem>.jsonl`` and its figures
to ``<out>/figures/<stem>/``. Afterwards ``<out>/results.json`` holds every
claim and ``<out>/report.md`` a readable report with the plots. While a
notebook runs, a line says which cell it is in and for how long (``CellProgress``).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import TextIO

from course_lib import env, parallel_runs
from course_lib.env import check_profile, duration
from course_lib.kernels import FORCE_ENV, inductor_cache_dir
from course_lib.tools import report

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"

# Kernels get CurveZMQ keys from the kernel manager when their kernelspec says it supports them (ipykernel's
# does): the connection to the kernel is encrypted, and ipykernel no longer warns "Kernel is running over TCP
# without encryption" at every start. A kernelspec without support starts as before, unencrypted.
KERNEL_MANAGER_CONFIG = {"KernelManager": {"transport_encryption": "auto"}}
# Kernels of these profiles run one intra-op thread unless OMP_NUM_THREADS is set. On a shared or busy machine
# two threads wait on each other at every operation: on a loaded 2-core machine the smoke models ran 5-100x
# slower, and chapter 03's `cpu` training cell took 5 min 14 s with two threads against 12 s with one. The `cpu`
# sizes are chosen to fit 3 minutes a notebook on one core (env.BUDGET_S), so one thread keeps that promise on any
# machine.
ONE_THREAD_PROFILES = ("smoke", "cpu")
# Without a terminal (CI logs, `make course | tee`), a progress line at most this often, in seconds.
LOG_EVERY_S = 30.0


class CellProgress:
    """The line ``course run`` prints while a notebook runs: ``[course] 03_x: cell 12/24, 1 min 05 s``.

    On a terminal, one line redrawn in place every second. Elsewhere (a CI log,
    a file), a new line at most every ``every`` seconds: when a cell finishes, and
    while a long cell still runs, so the log is readable and still shows that work
    goes on. Its methods are nbclient's cell hooks.
    """

    def __init__(self, name: str, stream: TextIO | None = None, every: float | None = None) -> None:
        self.name, self.stream, self.every = name, stream or sys.stdout, every or LOG_EVERY_S
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.total = self.current = 0
        self.start = self.cell_start = self.last_line = time.perf_counter()
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._ticker = threading.Thread(target=self._tick, daemon=True)

    def notebook_start(self, notebook, **_) -> None:
        self.total = sum(1 for c in notebook.cells if c.cell_type == "code" and c.source.strip())
        self.start = self.last_line = time.perf_counter()
        self._ticker.start()

    def cell_execute(self, **_) -> None:  # a code cell is sent to the kernel
        with self._lock:
            self.current += 1
            self.cell_start = time.perf_counter()
        if self.tty:
            self._show(self._status())

    def cell_executed(self, **_) -> None:
        now = time.perf_counter()
        if self.tty:
            self._show(self._status())
        elif now - self.last_line >= self.every:
            self._show(f"{self._status()} ({duration(now - self.cell_start)} for the last cell)")

    def close(self) -> None:
        self._stop.set()
        if self._ticker.is_alive():
            self._ticker.join(timeout=5)
        if self.tty:
            self._write("\r\x1b[K")  # clear the status line for the summary that follows

    def _status(self) -> str:
        return (f"[course] {self.name}: cell {self.current}/{self.total}, "
                f"{duration(time.perf_counter() - self.start)}")

    def _tick(self) -> None:
        while not self._stop.wait(1.0 if self.tty else self.every / 6):
            now = time.perf_counter()
            if self.tty:
                self._show(self._status())
            elif now - self.last_line >= self.every:
                self._show(f"{self._status()} (this cell running for {duration(now - self.cell_start)})")

    def _show(self, text: str) -> None:
        self._write(f"\r{text}\x1b[K" if self.tty else text + "\n")
        self.last_line = time.perf_counter()

    def _write(self, text: str) -> None:
        with self._lock:
            self.stream.write(text)
            self.stream.flush()


def find_notebooks(names: list[str] | None = None) -> list[Path]:
    """The course notebooks in order, or those matching ``names`` (a path, a file name, or a prefix like ``03``)."""
    all_nbs = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
    if not names:
        return all_nbs
    chosen = []
    for name in names:
        p = Path(name)
        if p.suffix == ".ipynb" and p.exists():
            chosen.append(p.resolve())
            continue
        matches = [nb for nb in all_nbs if nb.name.startswith(p.stem) or nb.stem == p.stem]
        if not matches:
            raise FileNotFoundError(
                f"no notebook matches {name!r}; the course has: {', '.join(nb.name for nb in all_nbs)}"
            )
        chosen.extend(matches)
    return chosen


# Seconds one cell may run before the run is stopped (papermill's execution_timeout): enough for the
# longest experiment cell on a slow or shared machine (a notebook at `cpu` is sized for 3 minutes on two idle
# cores, but a loaded machine ran cells 10-20x slower, chapter 02's longest for 28 minutes), short enough that
# a hung cell ends the run.
CELL_TIMEOUT = {"smoke": 900, "cpu": 3 * 3600, "gpu": 3600}


def execute(notebook: Path, profile: str, out: Path, timeout: int | None = None,
            progress: TextIO | None = None, kernels: str = "") -> dict:
    """Run one notebook with papermill; return ``{"notebook", "seconds", "results", "error"}``.

    ``timeout`` is the limit per cell in seconds (default: ``CELL_TIMEOUT[profile]``);
    ``progress`` is where the cell-by-cell line goes (default: stdout); ``kernels``, if given, forces kernel
    verdicts in the kernel (``COURSE_KERNELS``, see ``course_lib.kernels``). Besides the wall time, ``cpu_seconds``
    is the CPU time of the kernel and every process it started (its workers, torchrun's ranks): unlike the wall
    time it barely changes when other work loads the machine.
    """
    import logging

    import papermill as pm
    from traitlets.config import Config

    # papermill tries to parse the parameters cell line by line and warns on multi-line size tables: harmless
    logging.getLogger("papermill.translators").setLevel(logging.ERROR)

    profile = check_profile(profile)  # "CPU" is cpu: the timeouts, the thread caps and PROFILE use the lowercase name
    timeout = timeout or CELL_TIMEOUT[profile]
    out = Path(out).resolve()  # the kernel runs in notebooks/: a relative path would land there
    stem = notebook.stem
    results_file = out / "results" / f"{stem}.jsonl"
    results_file.parent.mkdir(parents=True, exist_ok=True)
    (out / "notebooks").mkdir(parents=True, exist_ok=True)
    results_file.unlink(missing_ok=True)  # a rerun replaces the old claims
    env_before = dict(os.environ)
    os.environ.update({  # the kernel inherits these
        "COURSE_RESULTS": str(results_file), "COURSE_FIGURES": str(out / "figures" / stem),
        "COURSE_PROFILE": profile, "COURSE_PROGRESS": "0", "PYDEVD_DISABLE_FILE_VALIDATION": "1",
    })
    if kernels:
        os.environ[FORCE_ENV] = kernels
    # torch.compile's cache of this machine and ISA settings (chapter 11): a kernel built under other settings
    # (ATEN_CPU_CAPABILITY=avx2, say) is never loaded here
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(inductor_cache_dir()))
    if profile in ONE_THREAD_PROFILES and "OMP_NUM_THREADS" not in env_before:
        os.environ["OMP_NUM_THREADS"] = "1"
    if profile in ONE_THREAD_PROFILES and parallel_runs.PROCESSES_ENV not in env_before:
        os.environ[parallel_runs.PROCESSES_ENV] = str(parallel_runs.default_processes())
    # Finished children's CPU time (the kernel, once shut down and reaped, with the processes it reaped in turn)
    children_before = _children_cpu()
    start, error = time.perf_counter(), None
    cells = CellProgress(stem, progress)
    try:
        pm.execute_notebook(
            str(notebook), str(out / "notebooks" / notebook.name), parameters={"PROFILE": profile},
            cwd=str(notebook.parent), kernel_name="python3", progress_bar=False,
            execution_timeout=timeout, log_output=False, config=Config(KERNEL_MANAGER_CONFIG),
            on_notebook_start=cells.notebook_start, on_cell_execute=cells.cell_execute,
            on_cell_executed=cells.cell_executed,
        )
    except Exception as exc:  # papermill raises PapermillExecutionError with the failing cell
        error = f"{type(exc).__name__}: {exc}"
    finally:
        cells.close()
        os.environ.clear()
        os.environ.update(env_before)
    return {"notebook": notebook.name, "seconds": round(time.perf_counter() - start, 1),
            "cpu_seconds": round(_children_cpu() - children_before, 1), "results": report.load(results_file),
            "error": error}


def _children_cpu() -> float:
    """User and system CPU seconds of this process's finished children (0 where the OS does not say)."""
    t = os.times()
    return t.children_user + t.children_system


def write_report(runs: list[dict], profile: str, out: Path) -> Path:
    """``results.json`` and a Markdown report with every claim and figure."""
    (out / "results.json").write_text(json.dumps(
        {"profile": profile, "notebooks": {r["notebook"]: r for r in runs}}, indent=1))
    lines = [f"# Course results (profile `{profile}`)", "",
             "| notebook | time | CPU time | claims | status |", "|---|---|---|---|---|"]
    for r in runs:
        lines.append(f"| {r['notebook']} | {duration(r['seconds'])} | {duration(r.get('cpu_seconds', 0))} | "
                     f"{len(r['results'])} | {'FAILED' if r['error'] else 'ok'} |")
    lines.append(f"| all | {duration(sum(r['seconds'] for r in runs))} | "
                 f"{duration(sum(r.get('cpu_seconds', 0) for r in runs))} | "
                 f"{sum(len(r['results']) for r in runs)} | {sum(bool(r['error']) for r in runs)} failed |")
    for r in runs:
        lines += ["", f"## {r['notebook']}", ""]
        if r["error"]:
            lines += ["```", r["error"][-2000:], "```", ""]
        for key, value in r["results"].items():
            text = json.dumps(value)
            lines.append(f"- `{key}` = {text if len(text) < 200 else text[:200] + ' ...'}")
        fig_dir = out / "figures" / Path(r["notebook"]).stem
        for fig in sorted(fig_dir.glob("*.png")):
            lines += ["", f"![{fig.stem}]({fig.relative_to(out).as_posix()})"]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def busy_note() -> str | None:
    """A warning when other work already loads the CPU (docs/running.md's times are for idle cores), else None."""
    if not hasattr(os, "getloadavg"):  # Windows
        return None
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load < 0.75 * cores:
        return None
    return (f"[course] note: the CPU is already busy (load average {load:.1f} on {cores} cores): notebooks will "
            "take longer than docs/running.md's times, and timings will be noisier")


def processes_note(profile: str) -> str:
    """How many cores and processes ``course run`` uses, in one line."""
    cores = parallel_runs.cores()
    if profile not in ONE_THREAD_PROFILES:
        return (f"[course] {cores} CPU core(s); notebooks run one at a time on the GPU, their training runs one "
                "by one")
    n = int(os.environ.get(parallel_runs.PROCESSES_ENV) or parallel_runs.default_processes())
    threads = os.environ.get("OMP_NUM_THREADS", "1")
    return (f"[course] {cores} CPU core(s): notebooks run one at a time, {threads} thread(s) a kernel; "
            f"independent training runs in a notebook (chapters 02, 04) go {n} at a time in processes of their "
            f"own, and chapters 07-13 start one process per rank (set {parallel_runs.PROCESSES_ENV} to change {n})")


def cpu_note() -> str:
    """This CPU's vector capability and measured bf16 speed, and what that means for the notebooks; then every
    low-precision kernel's verdict (``kernels.probe_all``), one line each."""
    from course_lib import kernels

    return "\n".join([f"[course] CPU: {env.cpu_speed().summary()}",
                      "[course] low-precision kernels on this CPU: " + ", ".join(
                          v.short() for v in kernels.probe_all().values())
                      + "; where one is slow or broken the chapters run its emulated twin (`course doctor`)"])


def run(names: list[str] | None, profile: str, out: Path, cell_timeout: int | None = None) -> list[dict]:
    """Execute the chosen notebooks in order and write the report; return one summary per notebook."""
    notebooks = find_notebooks(names)
    print(processes_note(profile), flush=True)
    print(cpu_note(), flush=True)
    note = busy_note()
    if note:
        print(note, flush=True)
    runs = []
    for i, nb in enumerate(notebooks, 1):
        print(f"[course] {nb.stem} ({i}/{len(notebooks)}) at profile {profile} ...", flush=True)
        r = execute(nb, profile, out, cell_timeout)
        status = "FAILED: " + r["error"].splitlines()[0][:300] if r["error"] else "ok"
        print(f"[course] {nb.stem}: {status}, {duration(r['seconds'])} ({duration(r['cpu_seconds'])} of CPU time), "
              f"{len(r['results'])} claims recorded", flush=True)
        runs.append(r)
    report_path = write_report(runs, profile, out)
    print(summary(runs, profile))
    print(f"[course] report: {report_path}")
    return runs


def summary(runs: list[dict], profile: str) -> str:
    """The closing table of ``course run``: each notebook's wall and CPU time, status, and the totals.

    At ``cpu`` a notebook over its budget (``env.BUDGET_S``) is marked (the budget is for two idle cores: on a busy
    machine compare the CPU time, which the load barely changes). The first line names the CPU's capability
    and its bf16 speed: the same notebook takes longer, and runs some bf16 cells smaller, where bf16 is emulated.
    """
    width = max((len(Path(r["notebook"]).stem) for r in runs), default=10)
    total = sum(r["seconds"] for r in runs)
    cpu_total = sum(r.get("cpu_seconds", 0.0) for r in runs)
    failed = sum(bool(r["error"]) for r in runs)
    from course_lib import kernels

    one = env.BUDGET_S["cpu"][0]  # marked at cpu only: smoke's budget is the test suite's, gpu's an estimate
    cpu = env.cpu_speed()
    lines = [f"[course] {len(runs)} notebook(s) at profile {profile} in {duration(total)}"
             + (f" ({duration(cpu_total)} of CPU time)" if cpu_total else "")
             + f" on a {cpu.capability} CPU ({kernels.probe('bf16').short()}, {kernels.probe('fp8').short()})"
             + (f", {failed} FAILED" if failed else ", all ok") + ":",
             f"[course]   {'notebook':<{width}}  {'time':>12}  {'CPU time':>12}  status"]
    for r in runs:
        over = profile == "cpu" and r["seconds"] > one
        lines.append(f"[course]   {Path(r['notebook']).stem:<{width}}  {duration(r['seconds']):>12}  "
                     f"{duration(r.get('cpu_seconds', 0.0)):>12}  {'FAILED' if r['error'] else 'ok'}"
                     + (f" (over the {duration(one)} budget)" if over else ""))
    return "\n".join(lines)
