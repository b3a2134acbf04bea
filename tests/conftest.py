"""Shared fixtures: run a course notebook once per test session and hand its recorded claims to the tests.

The notebooks run at ``$COURSE_TEST_PROFILE`` (default ``smoke``, as in CI): ``COURSE_TEST_PROFILE=cpu make test``
asserts the claims at the laptop sizes, where the paper trends must show beyond their seed spread.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from course_lib import env
from course_lib.tools import runner

ROOT = Path(__file__).resolve().parent.parent
PROFILE = os.environ.get("COURSE_TEST_PROFILE", "smoke")
OUT = ROOT / "build" / f"test-{PROFILE}"
_cache: dict[str, dict] = {}


def pytest_configure(config: pytest.Config) -> None:
    try:  # an unknown profile, or gpu without CUDA: one clear message instead of a failure per notebook
        env.pick_profile(PROFILE)
    except ValueError as exc:
        raise pytest.UsageError(f"COURSE_TEST_PROFILE={PROFILE}: {exc}") from None


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
        (nb,) = runner.find_notebooks([prefix])
        _cache[prefix] = runner.execute(nb, PROFILE, OUT)
    result = _cache[prefix]
    if result["error"]:
        pytest.fail(f"{result['notebook']} failed at profile {PROFILE}:\n{result['error'][-3000:]}")
    return result["results"]


@pytest.fixture(scope="session")
def profile() -> str:
    return PROFILE
