"""Execute the course's notebooks and gather their results (``course run``).

Each notebook runs in its own kernel through papermill with ``PROFILE``
injected, writes its claims to ``<out>/results/<stem>.jsonl`` and its figures
to ``<out>/figures/<stem>/``. Afterwards ``<out>/results.json`` holds every
claim and ``<out>/report.md`` a readable report with the plots.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from course_lib import report
from course_lib.env import check_profile

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"


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
# longest experiment cell on a slow or shared machine (chapter 04 at `cpu`: 67 minutes measured on a busy
# 2-core machine, about 25 estimated on an idle one), short enough that a hung cell ends the run.
CELL_TIMEOUT = {"smoke": 900, "cpu": 3 * 3600, "gpu": 3600}


def execute(notebook: Path, profile: str, out: Path, timeout: int | None = None) -> dict:
    """Run one notebook with papermill; return ``{"notebook", "seconds", "results", "error"}``.

    ``timeout`` is the limit per cell in seconds (default: ``CELL_TIMEOUT[profile]``).
    """
    import logging

    import papermill as pm

    # papermill tries to parse the parameters cell line by line and warns on multi-line size tables: harmless
    logging.getLogger("papermill.translators").setLevel(logging.ERROR)

    check_profile(profile)
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
    if profile == "smoke" and "OMP_NUM_THREADS" not in env_before:
        # smoke runs in CI, on shared machines: there two intra-op threads wait on each other and made the
        # tiny smoke models 5-100x slower (measured on a loaded 2-core machine); one thread is as fast when idle.
        os.environ["OMP_NUM_THREADS"] = "1"
    start, error = time.perf_counter(), None
    try:
        pm.execute_notebook(
            str(notebook), str(out / "notebooks" / notebook.name), parameters={"PROFILE": profile},
            cwd=str(notebook.parent), kernel_name="python3", progress_bar=False,
            execution_timeout=timeout, log_output=False,
        )
    except Exception as exc:  # papermill raises PapermillExecutionError with the failing cell
        error = f"{type(exc).__name__}: {exc}"
    finally:
        os.environ.clear()
        os.environ.update(env_before)
    return {"notebook": notebook.name, "seconds": round(time.perf_counter() - start, 1),
            "results": report.load(results_file), "error": error}


def write_report(runs: list[dict], profile: str, out: Path) -> Path:
    """``results.json`` and a Markdown report with every claim and figure."""
    (out / "results.json").write_text(json.dumps(
        {"profile": profile, "notebooks": {r["notebook"]: r for r in runs}}, indent=1))
    lines = [f"# Course results (profile `{profile}`)", "",
             "| notebook | seconds | claims | status |", "|---|---|---|---|"]
    for r in runs:
        lines.append(f"| {r['notebook']} | {r['seconds']} | {len(r['results'])} | "
                     f"{'FAILED' if r['error'] else 'ok'} |")
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


def run(names: list[str] | None, profile: str, out: Path, cell_timeout: int | None = None) -> list[dict]:
    """Execute the chosen notebooks in order and write the report; return one summary per notebook."""
    runs = []
    for nb in find_notebooks(names):
        print(f"[course] running {nb.name} at profile {profile} ...", flush=True)
        r = execute(nb, profile, out, cell_timeout)
        status = "FAILED: " + r["error"].splitlines()[0][:300] if r["error"] else "ok"
        print(f"[course]   {r['seconds']:.0f} s, {len(r['results'])} claims recorded, {status}", flush=True)
        runs.append(r)
    report_path = write_report(runs, profile, out)
    print(f"[course] report: {report_path}")
    return runs
