"""What an exercise's test cells use: ``raised`` in their answers; ``check_types``, ``same`` and ``close`` in
their checks.

A test cell has three parts (see ``course_lib.tools.grading.exercise``): its
*inputs*, its *answers* (which call the learner's functions and collect what
they return in ``got``) and its *checks*. When grading, the answers run in
the learner's kernel and the checks in the grader, on what ``got`` held, so
``raised`` records an error as plain text that can travel; ``same`` and
``close`` compare with exact types (an ``int`` is not a ``float`` is not a
``bool``, a ``list`` is not a ``tuple``, tensors must agree in dtype and shape).
Since their ``False`` cannot say which type was wrong, a check calls
``check_types`` first where a wrong type would otherwise read as a wrong value.
"""

from __future__ import annotations

import math
import sys
from typing import Any, Callable

MAX_MESSAGE = 300  # characters of an error message kept by ``raised``
MAX_SHOWN = 60     # characters of a value that ``check_types`` quotes


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


def _kind(x: Any) -> str:
    """``a list``, ``an int``, ``a torch.float32 tensor of shape (3,)``, ``a numpy.float64``."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):  # a subclass (a Parameter) is named: it is no tensor here
        return f"a {x.dtype} {'tensor' if type(x) is torch.Tensor else type(x).__qualname__} of shape {tuple(x.shape)}"
    if x is None:
        return "None"
    t = type(x)
    name = t.__name__ if t.__module__ == "builtins" else f"{t.__module__.split('.')[0]}.{t.__qualname__}"
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def _like(x: Any, lead: str) -> str:
    """``lead`` and ``x``'s repr, cut short; nothing for None and tensors (their kind says it all)."""
    torch = sys.modules.get("torch")
    if x is None or (torch is not None and isinstance(x, torch.Tensor)):
        return ""
    text = repr(x)
    return lead + (text if len(text) <= MAX_SHOWN else text[:MAX_SHOWN - 3] + "...")


def _type_mismatch(got: Any, want: Any, where: str, numbers_alike: bool) -> str | None:
    torch = sys.modules.get("torch")
    alike = numbers_alike and _is_number(got) and _is_number(want)
    if type(got) is not type(want) and not alike:
        return f"{where} must be {_kind(want)}{_like(want, ' like ')}; got {_kind(got)}{_like(got, ' ')}"
    if torch is not None and type(want) is torch.Tensor:
        if got.dtype != want.dtype or got.shape != want.shape:
            return f"{where} must be {_kind(want)}; got {_kind(got)}"
    elif type(want) in (list, tuple):  # a length that differs is left to the value checks: the values say more
        for i, (g, w) in enumerate(zip(got, want)):
            found = _type_mismatch(g, w, f"{where}[{i}]", numbers_alike)
            if found:
                return found
    elif type(want) is dict:
        if set(got) != set(want):
            return f"{where} must have the keys {sorted(want, key=repr)}; got {sorted(got, key=repr)}"
        for key in want:
            found = _type_mismatch(got[key], want[key], f"{where}[{key!r}]", numbers_alike)
            if found:
                return found
    return None


def check_types(got: Any, want: Any, what: str = "the answer", numbers_alike: bool = False) -> None:
    """Raise an ``AssertionError`` naming the first part of ``got`` whose type differs from ``want``'s.

    Lists and tuples are compared item by item as far as both go, dicts key by key (their keys must agree),
    tensors by dtype and shape. ``what`` names ``got`` in the message, e.g. ``"one_f_one_b_order(4, 6, 0)"``
    gives "one_f_one_b_order(4, 6, 0)[0] must be a tuple like ('F', 0); got a list ['F', 0]".
    ``numbers_alike=True`` lets an ``int`` stand for a ``float`` (as ``close`` does); ``bool`` never does.
    """
    found = _type_mismatch(got, want, what, numbers_alike)
    if found:
        raise AssertionError(found)
