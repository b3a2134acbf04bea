"""What an exercise's test cells use: ``raised`` in their answers, ``same`` and ``close`` in their checks.

A test cell has three parts (see ``course_lib.tools.grading.exercise``): its
*inputs*, its *answers* (which call the learner's functions and collect what
they return in ``got``) and its *checks*. When grading, the answers run in
the learner's kernel and the checks in the grader, on what ``got`` held, so
``raised`` records an error as plain text that can travel; ``same`` and
``close`` compare with exact types (an ``int`` is not a ``float`` is not a
``bool``, a ``list`` is not a ``tuple``, tensors must agree in dtype and shape).
"""

from __future__ import annotations

import math
import sys
from typing import Any, Callable

MAX_MESSAGE = 300  # characters of an error message kept by ``raised``


def raised(fn: Callable, *args: Any, **kwargs: Any) -> str | None:
    """Call ``fn(*args, **kwargs)``: ``None`` if it returns, else ``"<ExceptionName>: <message>"``.

    The name is that of the nearest built-in class, so a subclass of
    ``ValueError`` reads ``"ValueError: ..."``. Test cells call every input
    that should raise next to one that should not, so a ``raised`` that always
    claimed an error would fail.
    """
    try:
        fn(*args, **kwargs)
    except Exception as exc:  # KeyboardInterrupt (a time limit) and SystemExit still stop the cell
        base = next(c for c in type(exc).__mro__ if c.__module__ == "builtins")
        try:
            message = str(exc)
        except Exception:
            message = ""
        return f"{base.__name__}: {message}"[:MAX_MESSAGE]
    return None


def _is_number(x: Any) -> bool:
    return type(x) in (int, float)


def same(a: Any, b: Any) -> bool:
    """``a == b`` with exact types all the way down (tensors: dtype, shape and every element)."""
    torch = sys.modules.get("torch")
    if type(a) is not type(b):
        return False
    if torch is not None and type(a) is torch.Tensor:
        return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))
    if type(a) in (list, tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if type(a) is dict:
        return set(a) == set(b) and all(same(a[k], b[k]) for k in a)
    if type(a) is float and math.isnan(a):
        return math.isnan(b)
    return bool(a == b)


def close(a: Any, b: Any, atol: float = 0.0, rtol: float = 1e-9) -> bool:
    """``a`` and ``b`` agree within ``atol + rtol * |b|``: numbers (``int`` or ``float``, not ``bool``),
    tensors of the same dtype and shape, or lists, tuples and dicts of them with the same structure."""
    torch = sys.modules.get("torch")
    if _is_number(a) and _is_number(b):
        return math.isfinite(a) and math.isfinite(b) and abs(a - b) <= atol + rtol * abs(b)
    if type(a) is not type(b):
        return False
    if torch is not None and type(a) is torch.Tensor:
        return (a.dtype == b.dtype and a.shape == b.shape
                and bool(torch.allclose(a, b, rtol=rtol, atol=atol, equal_nan=False)))
    if type(a) in (list, tuple):
        return len(a) == len(b) and all(close(x, y, atol, rtol) for x, y in zip(a, b))
    if type(a) is dict:
        return set(a) == set(b) and all(close(a[k], b[k], atol, rtol) for k in a)
    return False
