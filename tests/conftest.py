"""Shared fixtures: run a course notebook once per test session and hand its recorded claims to the tests.

The notebooks run at ``$COURSE_TEST_PROFILE`` (default ``smoke``, as in CI): ``COURSE_TEST_PROFILE=cpu make test``
asserts the claims at the laptop sizes, where the paper trends must show beyond their seed spread.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from course_lib import env
from course_lib.tools import runner

ROOT = Path(__file__).resolve().parent.parent
PROFILE = os.environ.get("COURSE_TEST_PROFILE", "smoke")
OUT = ROOT / "build" / f"test-{PROFILE}"
_cache: dict[str, dict] = {}
# Notebooks run one at a time, in order, in a background process from the start of the session, on the core the
# tests leave idle, while the tests go on: those whose kernel runs alone (single-threaded), and three that start
# ranks but whose claims are counts, bytes and memory, which a busy machine does not move (06 and 07 measure CPU
# time and bubbles, 08 what asynchronous buckets hold in flight: they run in the foreground).
# The others must not share the machine with it: they wait until the background run is done (ZeRO-2's saving in
# 08 fell to 0.59 of its formula once, with chapter 12's ranks running beside it).
PREFETCH = ("00", "01", "02", "03", "04", "05", "10", "09", "11", "12")
_prefetch: dict[str, Path] = {}
_prefetcher: subprocess.Popen | None = None


def pytest_configure(config: pytest.Config) -> None:
    try:  # an unknown profile, or gpu without CUDA: one clear message instead of a failure per notebook
        env.pick_profile(PROFILE)
    except ValueError as exc:
        raise pytest.UsageError(f"COURSE_TEST_PROFILE={PROFILE}: {exc}") from None


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start executing, in the background, the single-process notebooks that the selected tests need."""
    global _prefetcher
    modules = {getattr(getattr(item, "module", None), "__name__", "") for item in session.items}
    wanted = sorted(m.removeprefix("test_nb_") for m in modules if m.startswith("test_nb_"))
    chosen = [p for p in wanted if p in PREFETCH]
    if not chosen or os.environ.get("COURSE_TEST_PREFETCH", "1") == "0":
        return
    folder = OUT / "prefetch"
    folder.mkdir(parents=True, exist_ok=True)
    for p in chosen:
        _prefetch[p] = folder / f"{p}.json"
        _prefetch[p].unlink(missing_ok=True)
    # one notebook after another, each summary written as JSON as soon as it is done
    code = ("import json, os, sys; from pathlib import Path; from course_lib.tools import runner\n"
            "for p in sys.argv[3:]:\n"
            "    (nb,) = runner.find_notebooks([p])\n"
            "    r = runner.execute(nb, sys.argv[1], Path(sys.argv[2]), progress=open(os.devnull, 'w'))\n"
            "    part = Path(sys.argv[2], 'prefetch', p + '.part')\n"
            "    part.write_text(json.dumps(r))\n"
            "    part.replace(part.with_suffix('.json'))  # whole, or not there\n")
    _prefetcher = subprocess.Popen([sys.executable, "-c", code, PROFILE, str(OUT), *chosen], cwd=ROOT,
                                   stdout=subprocess.DEVNULL, stderr=open(folder / "log.txt", "w"))


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _prefetcher is not None and _prefetcher.poll() is None:  # tests stopped early (-x, Ctrl-C)
        _prefetcher.kill()
        _prefetcher.wait()


def _prefetched(prefix: str) -> dict | None:
    """The background run's summary of this notebook, waiting for it; None if there is none (run it here)."""
    path = _prefetch.pop(prefix, None)
    if path is None or _prefetcher is None:
        return None
    while not path.exists() and _prefetcher.poll() is None:
        try:
            _prefetcher.wait(timeout=1)
        except subprocess.TimeoutExpired:
            pass
    return json.loads(path.read_text()) if path.exists() else None


def _background_done() -> None:
    """Wait for the background run to finish every notebook it was given."""
    if _prefetcher is not None:
        _prefetcher.wait()


def pytest_report_header(config: pytest.Config) -> str:
    return f"course notebooks run at profile {PROFILE} (COURSE_TEST_PROFILE), into {OUT}"


def pytest_terminal_summary(terminalreporter) -> None:
    """Each notebook the session executed, with its time: what `COURSE_TEST_PROFILE=cpu make test` cost."""
    if _cache:
        terminalreporter.write_sep("-", f"notebooks executed at profile {PROFILE}")
        terminalreporter.write_line(runner.summary([_cache[k] for k in sorted(_cache)], PROFILE))


def notebook_claims(prefix: str) -> dict:
    """Execute ``notebooks/<prefix>_*.ipynb`` at the test profile (once) and return its recorded claims.

    Fails the test with the notebook's error when it does not run through.
    """
    if prefix not in _cache:
        if prefix not in PREFETCH:
            _background_done()
        _cache[prefix] = _prefetched(prefix) or runner.execute(runner.find_notebooks([prefix])[0], PROFILE, OUT)
    result = _cache[prefix]
    if result["error"]:
        pytest.fail(f"{result['notebook']} failed at profile {PROFILE}:\n{result['error'][-3000:]}")
    return result["results"]


@pytest.fixture(scope="session")
def profile() -> str:
    return PROFILE
