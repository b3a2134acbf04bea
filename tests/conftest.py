"""Shared fixtures: run a course notebook once per test session and hand its recorded claims to the tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from course_lib import runner

ROOT = Path(__file__).resolve().parent.parent
PROFILE = os.environ.get("COURSE_TEST_PROFILE", "smoke")
OUT = ROOT / "build" / f"test-{PROFILE}"
_cache: dict[str, dict] = {}


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
