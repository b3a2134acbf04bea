"""Recording a notebook's claims (every chapter).

A notebook calls ``record("ch03/grad_max_abs_diff", value)`` for each number
its text relies on. The runner sets ``COURSE_RESULTS`` to one file per
notebook; the tests read those files and assert the claims.
"""

from __future__ import annotations

import dis
import json
import math
import os
import sys
import time
from pathlib import Path
from types import FrameType
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


def _result_is_echoed(frame: FrameType | None) -> bool:
    """Whether the caller hands our return value straight to ``sys.displayhook``.

    That is what Jupyter (and Python's prompt) does with the last expression of a
    cell: it compiles it in "single" mode, where the call is followed by
    PRINT_EXPR (CALL_INTRINSIC_1 INTRINSIC_PRINT from Python 3.12). Reading the
    caller's next instruction costs a few microseconds; when it cannot be read,
    the answer is no.
    """
    if frame is None:
        return False
    try:
        following = next(i for i in dis.get_instructions(frame.f_code) if i.offset > frame.f_lasti)
    except (StopIteration, ValueError, TypeError):
        return False
    return following.opname == "PRINT_EXPR" or (following.opname == "CALL_INTRINSIC_1"
                                                 and following.argrepr == "INTRINSIC_PRINT")


def record(key: str, value: Any, note: str = "") -> Any:
    """Append one claim to the results file, print it, and return ``value`` unchanged.

    As the last line of a notebook cell it returns None instead: Jupyter would
    echo the value a second time under the printed line, and nothing else can
    use it there. ``x = record(...)`` still gets the value.
    """
    if "/" not in key:
        raise ValueError(f"record key {key!r} should look like 'ch03/name' (chapter, slash, name)")
    entry = {"key": key, "value": _plain(value), "note": note, "time": time.time()}
    path = results_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(entry) + "\n")
    print(f"recorded {key} = {entry['value']}" + (f"  ({note})" if note else ""))
    return None if _result_is_echoed(sys._getframe(1)) else value


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
