"""Each chapter's study time, as its first cell and README's chapter table state it, is at least a reading estimate
of the notebook: its prose at 150 words a minute (careful reading of technical text) plus its code at 10 lines a
minute (reading a line, running its cell and reading what it prints). The estimate does not replace reading the
chapter; it keeps a stated time from falling far below what the notebook holds as chapters grow."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
WORDS_PER_MIN, CODE_LINES_PER_MIN = 150, 10


def reading_minutes(path: Path) -> float:
    """Prose words / 150 + code lines (not blank, not comments) / 10."""
    cells = json.loads(path.read_text())["cells"]
    words = sum(len(re.findall(r"[A-Za-z0-9_']+", "".join(c["source"]))) for c in cells if c["cell_type"] == "markdown")
    code = sum(1 for c in cells if c["cell_type"] == "code" for line in "".join(c["source"]).splitlines()
               if line.strip() and not line.strip().startswith("#"))
    return words / WORDS_PER_MIN + code / CODE_LINES_PER_MIN


def stated_minutes(path: Path) -> tuple[int, int]:
    """(the first cell's **Time:**, README's table row) in minutes."""
    head = "".join(json.loads(path.read_text())["cells"][0]["source"])
    m = re.search(r"\*\*Time:\*\*\s*(?:about\s+)?(\d+) minutes", head)
    assert m, f"{path.name}: its first cell states no **Time:** N minutes"
    row = re.search(rf"^\| {path.name[:2]} \|.*\| (\d+) min \|$", (ROOT / "README.md").read_text(), re.M)
    assert row, f"README's chapter table has no study time for {path.name[:2]}"
    return int(m[1]), int(row[1])


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name[:2])
def test_study_time_is_stated_once_and_covers_the_reading(path: Path) -> None:
    head, readme = stated_minutes(path)
    assert head == readme, f"{path.name}: {head} minutes in its first cell, {readme} in README's table"
    need = 5 * math.ceil(reading_minutes(path) / 5)
    assert head >= need, (f"{path.name} states {head} minutes; its {reading_minutes(path):.0f} minutes of reading "
                          f"(prose at {WORDS_PER_MIN} words, code at {CODE_LINES_PER_MIN} lines a minute) need {need}")


def test_the_estimate_counts_what_a_notebook_holds(tmp_path: Path) -> None:
    nb = {"cells": [{"cell_type": "markdown", "source": ["word " * 300]},
                    {"cell_type": "code", "source": ["# a comment\n", "x = 1\n", "\n", "y = 2\n"]}]}
    (tmp_path / "n.ipynb").write_text(json.dumps(nb))
    assert reading_minutes(tmp_path / "n.ipynb") == pytest.approx(300 / 150 + 2 / 10)
