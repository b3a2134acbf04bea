"""Recording a notebook's claims (every chapter).

A notebook calls ``record("ch03/grad_max_abs_diff", value)`` for each number
its text relies on. The runner sets ``COURSE_RESULTS`` to one file per
notebook; the tests read those files and assert the claims.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

DEFAULT_RESULTS = Path("build") / "results" / "interactive.jsonl"


def results_path() -> Path:
    """Where records go: ``$COURSE_RESULTS``, else ``build/results/interactive.jsonl``."""
    return Path(os.environ.get("COURSE_RESULTS", DEFAULT_RESULTS))


def _plain(value: Any) -> Any:
    """Turn tensors, NumPy scalars and tuples into JSON values."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def record(key: str, value: Any, note: str = "") -> None:
    """Append one claim to the results file and print it.

    It returns nothing on purpose: as the last line of a notebook cell a
    returned value would be echoed a second time under the printed line.
    Keep the value in a variable of your own when later code needs it.
    """
    if "/" not in key:
        raise ValueError(f"record key {key!r} should look like 'ch03/name' (chapter, slash, name)")
    entry = {"key": key, "value": _plain(value), "note": note, "time": time.time()}
    path = results_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(entry) + "\n")
    print(f"recorded {key} = {entry['value']}" + (f"  ({note})" if note else ""))


def load(path: str | Path) -> dict[str, Any]:
    """Read a results file; a key recorded twice keeps its last value."""
    out: dict[str, Any] = {}
    p = Path(path)
    if not p.exists():
        return out
    for line in p.read_text().splitlines():
        if line.strip():
            entry = json.loads(line)
            out[entry["key"]] = entry["value"]
    return out
