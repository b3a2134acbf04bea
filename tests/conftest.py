"""Shared fixtures: run a course notebook once per test session and hand its recorded claims to the tests.

The notebooks run at ``$COURSE_TEST_PROFILE`` (default ``smoke``, as in CI): ``COURSE_TEST_PROFILE=cpu make test``
asserts the claims at the laptop sizes, where the paper trends must show beyond their seed spread.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from course_lib import env, kernels
from course_lib.tools import runner

ROOT = Path(__file__).resolve().parent.parent
PROFILE = os.environ.get("COURSE_TEST_PROFILE", "smoke")
OUT = ROOT / "build" / f"test-{PROFILE}"
_cache: dict[str, dict] = {}
# Notebooks run one at a time, in order, in a background process from the start of the session, on the core the
# tests leave idle, while the tests go on: those whose kernel runs alone (single-threaded), and three that start
# ranks but whose claims are counts, bytes and memory, which a busy machine does not move (07 and 08 measure CPU
# time and bubbles, 09 what asynchronous buckets hold in flight: they run in the foreground).
# The others must not share the machine with it: they wait until the background run is done (ZeRO-2's saving in
# 09 fell to 0.59 of its formula once, with chapter 13's ranks running beside it).
PREFETCH = ("00", "01", "02", "03", "04", "05", "06", "11", "10", "12", "13")
# When the whole suite runs (plain `pytest`, as `make test` does), these test files run in the same background
# process once its notebooks are done, in a pytest of their own, so that its core is not idle while this one works
# through the unit tests; their results are printed and counted at the end of this session. None of them asserts a
# time that a busy machine moves (the ring's hop timers only must exist). They are chosen so that the two processes
# finish close together: in `CI=true bash .ci/run` on an AVX-512 EPYC (commit 5a2d092) the background's notebooks
# took 4.5 minutes and the side files 3.5, while the unit tests here took 7.2 and then waited 45 s for them; the
# launcher's tests (41 s, much of it waiting on timeouts) have since moved here from the side files. What needs
# the machine alone (07-09 and the tests marked `alone`, 3.8 minutes) runs last, after both.
SIDE = ("test_grading_adversarial.py", "test_expert_parallel.py", "test_context_parallel.py", "test_fsdp_offload.py")
ALONE = ("test_nb_07.py", "test_nb_08.py", "test_nb_09.py")
# Unit tests that assert a measured time (a pipeline's bubble, a makespan) are marked `alone` and run last too,
# once the background process is done. Their margin is thin on a slower CPU: held to AVX2 with a niced busy loop on
# each core (about 1.5 times slower), the bubbles came out 0.01-0.04 above their formulas (the messages and wake-ups
# the formulas leave out), against a tolerance of 0.05, and in one whole-suite run of two with these tests beside
# the background notebooks, PipeDream's went past it.
# The notebooks that read a low-precision kernel's verdict (course_lib.kernels) run again under forced verdicts, so
# that the paths of CPUs nobody here has (bf16 emulated, _scaled_mm thousands of times slower or raising) run in
# every test session, and their tests assert every claim on each path. A forced broken kernel raises when called,
# so a path that still reaches it fails. 06 runs under both: slow still calls the kernel once to compare it with
# its twin, broken does not. In 05 and 13 slow and broken take one path (the twin), so the stricter, broken, runs;
# 09 runs a slow bf16 kernel as it is (what it costs is its point), so only broken changes its path.
FORCED = {"05": ("bf16=broken",), "06": ("all=slow", "all=broken"), "09": ("bf16=broken",), "13": ("all=broken",)}
SIDE_OUT = OUT / "side"
_prefetch: dict[str, Path] = {}
_prefetcher: subprocess.Popen | None = None
_side: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
    # torch.compile's cache for this CPU and its ISA settings, as `course run` uses (kernels.inductor_cache_dir)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(kernels.inductor_cache_dir()))
    try:  # an unknown profile, or gpu without CUDA: one clear message instead of a failure per notebook
        env.pick_profile(PROFILE)
    except ValueError as exc:
        raise pytest.UsageError(f"COURSE_TEST_PROFILE={PROFILE}: {exc}") from None


def _background_allowed() -> bool:
    return os.environ.get("COURSE_TEST_PREFETCH", "1") != "0"


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list) -> None:
    """On a whole-suite run: hand the SIDE files to the background process, and order the rest (see _order)."""
    whole = (config.args_source == pytest.Config.ArgsSource.TESTPATHS and not config.option.keyword
             and not config.option.markexpr and not config.getoption("maxfail"))
    if not whole or not _background_allowed():
        return
    side = [it for it in items if it.path.name in SIDE]
    if side:
        _side[:] = sorted({str(it.path.relative_to(ROOT)) for it in side})
        config.hook.pytest_deselected(items=side)
    items[:] = sorted((it for it in items if it.path.name not in SIDE), key=_order)


def _order(item) -> int:
    """Unit tests first, while the background process executes the notebooks; then the notebooks' tests, whose
    runs are done by then (run earlier, they would wait for them with a core idle); the ALONE notebooks and the
    tests marked `alone` last."""
    name = item.path.name
    return 2 if name in ALONE or item.get_closest_marker("alone") else 1 if name.startswith("test_nb_") else 0


def pytest_runtest_setup(item) -> None:
    """A test marked `alone` waits for the background process: its measured times are not to share the cores."""
    if item.get_closest_marker("alone"):
        _background_done()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start executing, in the background, the single-process notebooks that the selected tests need."""
    global _prefetcher
    modules = {getattr(getattr(item, "module", None), "__name__", "") for item in session.items}
    wanted = sorted(m.removeprefix("test_nb_") for m in modules if m.startswith("test_nb_"))
    chosen = [p for p in wanted if p in PREFETCH]
    chosen += [f"{p}@{spec}" for p in chosen if p in FORCED for spec in FORCED[p]]  # after the plain runs
    if not (chosen or _side) or not _background_allowed():
        return
    folder = OUT / "prefetch"
    folder.mkdir(parents=True, exist_ok=True)
    for p in chosen:
        _prefetch[p] = folder / f"{p}.json"
        _prefetch[p].unlink(missing_ok=True)
    # one notebook after another, each summary written as JSON as soon as it is done
    code = ("import json, os, sys; from pathlib import Path; from course_lib.tools import runner\n"
            "for p in sys.argv[3:]:\n"
            "    prefix, _, forced = p.partition('@')\n"
            "    (nb,) = runner.find_notebooks([prefix])\n"
            "    r = runner.execute(nb, sys.argv[1], Path(sys.argv[2], forced_folder(forced)),\n"
            "                       progress=open(os.devnull, 'w'), kernels=forced)\n"
            "    part = Path(sys.argv[2], 'prefetch', p + '.part')\n"
            "    part.write_text(json.dumps(r))\n"
            "    part.replace(part.with_suffix('.json'))  # whole, or not there\n")
    if _side:  # then the SIDE test files, in a pytest of their own; its output and exit status are read at the end
        SIDE_OUT.mkdir(parents=True, exist_ok=True)
        (SIDE_OUT / "rc").unlink(missing_ok=True)
        side = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfE", "--durations=10",
                f"--basetemp={SIDE_OUT / 'tmp'}", *_side]
        code += ("import subprocess\n"
                 f"with open({str(SIDE_OUT / 'log.txt')!r}, 'w') as log:\n"
                 f"    rc = subprocess.run({side!r}, cwd={str(ROOT)!r}, stdout=log, stderr=subprocess.STDOUT,\n"
                 "                        env={**os.environ, 'COURSE_TEST_PREFETCH': '0'}).returncode\n"
                 f"Path({str(SIDE_OUT / 'rc')!r}).write_text(str(rc))\n")
    # a session of its own, so that an early stop can end the side pytest and its workers with it
    code = f"def forced_folder(spec):\n    return {_FORCED_FOLDER!r}.format(spec) if spec else ''\n" + code
    _prefetcher = subprocess.Popen([sys.executable, "-c", code, PROFILE, str(OUT), *chosen], cwd=ROOT,
                                   stdout=subprocess.DEVNULL, stderr=open(folder / "log.txt", "w"),
                                   start_new_session=True)


def _side_rc() -> str:
    """The side pytest's exit status as it wrote it, or 'missing' if it never finished."""
    rc = SIDE_OUT / "rc"
    return rc.read_text() if rc.exists() else "missing (the background run did not finish)"


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _prefetcher is None:
        return
    if _side and session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED) and not session.shouldstop:
        _background_done()  # the side tests are part of this run: wait for them, and count their result
        if _side_rc() != "0" and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
    if _prefetcher.poll() is None:  # tests stopped early (-x, Ctrl-C)
        os.killpg(_prefetcher.pid, signal.SIGKILL)
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
    """The side tests' result, and each notebook the session executed with its time."""
    if _side:
        log = SIDE_OUT / "log.txt"
        rc = _side_rc()
        terminalreporter.write_sep("-", f"{', '.join(_side)}: run in the background process, exit status {rc}")
        lines = log.read_text().splitlines() if log.exists() else ["(no output: the background run did not get there)"]
        # all of it when something failed, else its summary and slowest tests
        for line in lines if rc != "0" else lines[-16:]:
            terminalreporter.write_line(line)
    if _cache:
        terminalreporter.write_sep("-", f"notebooks executed at profile {PROFILE}")
        terminalreporter.write_line(runner.summary([_cache[k] for k in sorted(_cache)], PROFILE))


_FORCED_FOLDER = "forced-{}"  # where a notebook run under COURSE_KERNELS=spec writes, beside OUT's own runs


def variants(prefix: str) -> list[str]:
    """The kernel verdicts a notebook's tests run under: as measured here (""), then FORCED's."""
    return ["", *FORCED.get(prefix, ())]


def notebook_claims(prefix: str, forced: str = "") -> dict:
    """Execute ``notebooks/<prefix>_*.ipynb`` at the test profile (once) and return its recorded claims;
    ``forced``: under those kernel verdicts (``COURSE_KERNELS``), in a run of its own.

    Fails the test with the notebook's error when it does not run through.
    """
    key = f"{prefix}@{forced}" if forced else prefix
    if key not in _cache:
        if prefix not in PREFETCH:
            _background_done()
        out = OUT / _FORCED_FOLDER.format(forced) if forced else OUT
        _cache[key] = _prefetched(key) or runner.execute(runner.find_notebooks([prefix])[0], PROFILE, out,
                                                         kernels=forced)
        if forced:  # its own row in the session's table: 06_fp8_training@all=slow
            _cache[key]["notebook"] = _cache[key]["notebook"].replace(".ipynb", f"@{forced}.ipynb")
    result = _cache[key]
    if result["error"]:
        under = f" under {kernels.FORCE_ENV}={forced}" if forced else ""
        pytest.fail(f"{result['notebook']} failed at profile {PROFILE}{under}:\n{result['error'][-3000:]}")
    return result["results"]


@pytest.fixture(scope="session")
def profile() -> str:
    return PROFILE
