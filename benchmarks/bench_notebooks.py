"""The time of each notebook at the ``smoke`` profile (the budget CI lives with: about a minute each)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from course_lib.tools import runner


def run() -> dict[str, dict]:
    out: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for nb in runner.find_notebooks():
            result = runner.execute(nb, "smoke", Path(tmp))
            seconds = float("nan") if result["error"] else result["seconds"]
            out[f"smoke_seconds_{nb.stem}"] = {"value": seconds, "goal": "<= 90"}
    return out
