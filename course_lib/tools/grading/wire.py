"""The answers a learner's kernel hands to the grader: plain data and tensors, in a format without code.

The kernel calls ``dump(got, path)``; the grader calls ``load(path)``, which
never unpickles and never imports anything the file names. The file is a
JSON document followed by the raw bytes of its tensors::

    COURSE-ANSWERS-1\\n <8-byte JSON length> <JSON> <tensor bytes>

What can travel: ``None``, ``bool``, ``int``, ``float``, ``str``, ``list``,
``tuple``, ``dict``, ``set``, ``frozenset`` and dense ``torch.Tensor``. The
decoder builds every value itself, so what the checks receive has exactly
these types (a genuine ``float``, a genuine ``torch.Tensor``): an object
whose ``__eq__`` is always true, a tensor subclass or a patched ``torch``
in the kernel cannot reach the checks. The encoder runs in the learner's
kernel and is only a convenience: a learner may write any file there, and
the decoder treats it as untrusted input. Its time is linear in the file's
size: it counts the document's brackets and commas before parsing it, bounds
every integer (and so every dimension) below 2**63 as it is parsed, requires
each tensor of the table to be used exactly once, and refuses a set or dict
whose values were made to share a hash (building one costs time quadratic in
their number).
"""

from __future__ import annotations

import itertools
import json
import math
import numbers
import os
import stat
import struct
import sys
from typing import Any

MAGIC = b"COURSE-ANSWERS-1\n"
MAX_BYTES = 64 * 2**20      # a bigger answer file is refused (answers are small tensors and numbers)
MAX_DEPTH = 64              # nesting of lists and dicts
MAX_ITEMS = 1_000_000       # values in one file, tensors counted once
MAX_TOKENS = 4 * MAX_ITEMS  # brackets and commas in the JSON, counted before parsing it (each costs ~50 bytes)
MAX_TENSORS = 10_000        # tensors in one file (each costs ~20 us to rebuild; answers hold a few)
MAX_DIMS = 32               # dimensions of one tensor
MAX_INT = 2**63             # integers and dimensions: magnitude below this (an int64; a longer one costs time)
MAX_SAME_HASH = 8           # values of one set, or keys of one dict, that may share a hash
# dtype names the decoder accepts (a name is looked up here, never with getattr on torch)
DTYPES = ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
          "complex64", "complex128")


class WireError(ValueError):
    """An answer cannot travel (encoding) or a file is not a valid answers file (decoding)."""


# ----- in the learner's kernel --------------------------------------------------------------------


def _encode(value: Any, tensors: list, where: str, depth: int) -> Any:
    torch = sys.modules.get("torch")  # not imported: no value can be a tensor (and importing it costs seconds)
    if depth > MAX_DEPTH:
        raise WireError(f"{where} is nested more than {MAX_DEPTH} levels deep")
    if value is None or type(value) in (bool, str):
        return value
    if isinstance(value, numbers.Integral):   # int subclasses, numpy integers
        if not -MAX_INT < int(value) < MAX_INT:
            raise WireError(f"{where} is an integer of {int(value).bit_length()} bits; the grader reads integers "
                            "below 2**63 in magnitude: send it as a float or a string")
        return int(value)
    if isinstance(value, numbers.Real):       # float subclasses, numpy floats
        v = float(value)
        return {"float": repr(v)} if not math.isfinite(v) else v
    if isinstance(value, str):
        return str(value)
    if torch is not None and isinstance(value, torch.Tensor):
        return _encode_tensor(value, tensors, where)
    if isinstance(value, (list, tuple, set, frozenset)):
        kind = {list: "list", tuple: "tuple", set: "set", frozenset: "frozenset"}
        tag = next(k for t, k in kind.items() if isinstance(value, t))
        items = sorted(value, key=repr) if tag in ("set", "frozenset") else value
        encoded = [_encode(v, tensors, f"{where}[{i}]", depth + 1) for i, v in enumerate(items)]
        return encoded if tag == "list" else {tag: encoded}
    if isinstance(value, dict):
        return {"dict": [[_encode(k, tensors, f"a key of {where}", depth + 1),
                          _encode(v, tensors, f"{where}[{k!r}]", depth + 1)] for k, v in value.items()]}
    raise WireError(f"{where} is a {type(value).__module__}.{type(value).__qualname__}, which cannot be sent to "
                    "the grader: return plain data (numbers, strings, lists, tuples, dicts, sets) or tensors")


def _encode_tensor(t: Any, tensors: list, where: str) -> dict:
    import torch

    if t.layout != torch.strided or t.is_quantized or t.device.type == "meta":
        raise WireError(f"{where} is a {t.layout} tensor on {t.device}: return a dense tensor")
    name = str(t.dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise WireError(f"{where} has dtype {t.dtype}, which the grader does not read (use one of {', '.join(DTYPES)})")
    if t.dim() > MAX_DIMS:
        raise WireError(f"{where} has {t.dim()} dimensions; the grader reads at most {MAX_DIMS}")
    if len(tensors) == MAX_TENSORS:
        raise WireError(f"{where} is tensor number {MAX_TENSORS + 1}; the grader reads at most {MAX_TENSORS} in "
                        "one answer: stack them into fewer tensors")
    plain = t.detach().cpu().contiguous().as_subclass(torch.Tensor)
    tensors.append(plain.reshape(-1).view(torch.uint8).numpy().tobytes() if plain.numel() else b"")
    return {"tensor": [len(tensors) - 1, name, list(plain.shape)]}


def dumps(value: Any) -> bytes:
    """The answers file for ``value`` (raises ``WireError`` naming the part that cannot travel)."""
    tensors: list[bytes] = []
    doc = json.dumps({"value": _encode(value, tensors, "got", 0), "sizes": [len(b) for b in tensors]},
                     allow_nan=False).encode()
    return MAGIC + struct.pack("<Q", len(doc)) + doc + b"".join(tensors)


def dump(value: Any, path: str) -> None:
    """Write the answers ``value`` to ``path`` (called at the end of a test's answers in the kernel)."""
    data = dumps(value)
    tmp = f"{path}.part"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


# ----- in the grader ---------------------------------------------------------------------------------


_DIGITS = len(str(MAX_INT))


def _integer(text: str) -> int:
    """An integer of the document, refused before it is converted when it has more digits than any below
    ``MAX_INT`` (converting a long one costs time quadratic in its digits)."""
    value = int(text) if len(text) <= _DIGITS + 1 else MAX_INT  # a sign and 19 digits hold every int64
    if -MAX_INT < value < MAX_INT:
        return value
    raise WireError(f"an integer of {len(text.lstrip('-'))} digits: the grader reads integers below 2**63 in "
                    "magnitude")


def _hashable(items: list, what: str) -> None:
    """Refuse ``items`` (``what``: "a set's values", "a dict's keys") if one is unhashable, or if more than
    ``MAX_SAME_HASH`` share a hash: a set of them costs time quadratic in their number (the integers
    k * (2**61 - 1) all hash to 0, and so do tuples of them), and honest values almost never share one.
    Costs one ``hash`` per item."""
    count: dict[int, int] = {}
    for item in items:
        try:
            h = hash(item)
        except TypeError:
            raise WireError(f"{what} include an unhashable value") from None
        count[h] = count.get(h, 0) + 1
        if count[h] > MAX_SAME_HASH:
            raise WireError(f"more than {MAX_SAME_HASH} of {what} share one hash (made to collide?), which the "
                            "grader refuses: send a list instead")


class _Decoder:
    def __init__(self, blob: bytes, sizes: list) -> None:
        if type(sizes) is not list or not all(type(s) is int and s >= 0 for s in sizes):
            raise WireError("the tensor table is malformed")
        if len(sizes) > MAX_TENSORS:
            raise WireError(f"the tensor table lists {len(sizes)} tensors; the grader reads at most {MAX_TENSORS}")
        if sum(sizes) != len(blob):
            raise WireError(f"the file holds {len(blob)} bytes of tensors, the table says {sum(sizes)}")
        self.offsets = [0, *itertools.accumulate(sizes)][:-1]   # linear: a sum per entry was quadratic
        self.sizes, self.blob, self.items = sizes, blob, 0
        self.used = [False] * len(sizes)

    def value(self, v: Any, depth: int) -> Any:
        self.items += 1
        if self.items > MAX_ITEMS or depth > MAX_DEPTH:
            raise WireError("the answers are too large or too deeply nested")
        if v is None or type(v) in (bool, int, float, str):
            return v
        if type(v) is list:
            return [self.value(x, depth + 1) for x in v]
        if type(v) is not dict or len(v) != 1:
            raise WireError(f"unexpected JSON value of type {type(v).__name__}")
        (tag, body), = v.items()
        if tag == "float" and body in ("nan", "inf", "-inf"):
            return float(body)
        if tag in ("tuple", "set", "frozenset") and type(body) is list:
            items = [self.value(x, depth + 1) for x in body]
            if tag == "tuple":
                return tuple(items)
            _hashable(items, f"a {tag}'s values")
            return set(items) if tag == "set" else frozenset(items)
        if tag == "dict" and type(body) is list:
            if not all(type(pair) is list and len(pair) == 2 for pair in body):
                raise WireError("a dict entry is not a [key, value] pair")
            pairs = [(self.value(k, depth + 1), self.value(x, depth + 1)) for k, x in body]
            _hashable([k for k, _ in pairs], "a dict's keys")
            return dict(pairs)
        if tag == "tensor":
            return self.tensor(body)
        raise WireError(f"unknown tag {tag!r}")

    def tensor(self, body: Any) -> Any:
        if (type(body) is not list or len(body) != 3 or type(body[0]) is not int or type(body[1]) is not str
                or type(body[2]) is not list or not all(type(d) is int and d >= 0 for d in body[2])):
            raise WireError("a tensor entry is malformed")
        index, name, shape = body
        if name not in DTYPES:
            raise WireError(f"unknown dtype {name!r}")
        if not 0 <= index < len(self.sizes) or self.used[index]:
            raise WireError(f"tensor {index} is not in the table, or is used twice")
        self.used[index] = True
        if len(shape) > MAX_DIMS or math.prod(d for d in shape if d) >= MAX_INT:
            raise WireError(f"tensor {index}, of {len(shape)} dimensions, is too large: the grader reads at most "
                            f"{MAX_DIMS} dimensions, whose product (zeros left out) is below 2**63")
        import torch  # only now: a malformed file is refused without the seconds that importing it costs

        dtype = getattr(torch, DTYPES[DTYPES.index(name)])
        size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if size != self.sizes[index]:
            raise WireError(f"tensor {index} of shape {shape} and dtype {name} needs {size} bytes, "
                            f"the file holds {self.sizes[index]}")
        start = self.offsets[index]
        raw = bytearray(self.blob[start:start + size])
        flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        return flat.view(dtype).reshape(shape).clone()

    def check_used(self) -> None:
        """Every tensor of the table was used (a file the encoder wrote has no other)."""
        if not all(self.used):
            raise WireError(f"the tensor table lists {len(self.sizes)} tensors, the answers use {sum(self.used)}")


def _loads(data: bytes) -> Any:
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + 8:
        raise WireError("not an answers file (wrong header)")
    (n,) = struct.unpack("<Q", data[len(MAGIC):len(MAGIC) + 8])
    start = len(MAGIC) + 8
    if n > len(data) - start:
        raise WireError("the file is cut short")
    text = data[start:start + n]
    # parsing builds every value before the decoder counts them: 64 MiB of "[]," would take gigabytes
    tokens = text.count(b"[") + text.count(b"{") + text.count(b",")
    if tokens > MAX_TOKENS:
        raise WireError(f"the answers hold {tokens} brackets and commas; the grader reads at most {MAX_TOKENS}")
    try:
        doc = json.loads(text.decode("utf-8"), parse_int=_integer)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise WireError(f"the answers are not valid JSON ({type(exc).__name__})") from None
    if type(doc) is not dict or set(doc) != {"value", "sizes"}:
        raise WireError("the answers document is malformed")
    decoder = _Decoder(data[start + n:], doc["sizes"])
    value = decoder.value(doc["value"], 0)
    decoder.check_used()
    return value


def loads(data: bytes) -> Any:
    """Decode an answers file; raise ``WireError`` with what is wrong, in the grader's words only (an error
    the checks above did not foresee is named by its type: its text may be torch's, with paths and addresses)."""
    try:
        return _loads(data)
    except WireError:
        raise
    except RecursionError:
        raise WireError("the answers are nested too deeply to decode") from None
    except MemoryError:
        raise WireError("the answers take too much memory to decode") from None
    except Exception as exc:
        raise WireError(f"the answers cannot be decoded ({type(exc).__name__})") from None


def read_plain(folder: str, name: str, max_bytes: int = MAX_BYTES) -> bytes:
    """The bytes of ``folder/name``: a regular file, at most ``max_bytes``; neither the folder nor the file may
    be a link (the kernel owns both and may have put one there)."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)
    try:
        dir_fd = os.open(folder, flags | getattr(os, "O_DIRECTORY", 0))
    except OSError as exc:
        raise WireError(f"the answers folder cannot be opened ({exc.strerror}): the kernel is gone or moved it")
    try:
        fd = os.open(name, flags | getattr(os, "O_NONBLOCK", 0), dir_fd=dir_fd)
    except FileNotFoundError:
        raise WireError("no answers were saved: the test cell did not finish") from None
    except OSError as exc:
        raise WireError(f"the answers file cannot be opened ({exc.strerror}); it must be a plain file") from None
    finally:
        os.close(dir_fd)
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise WireError("the answers file is not a plain file")
        if info.st_size > max_bytes:
            raise WireError(f"the answers take {info.st_size / 2**20:.0f} MiB; the grader reads at most "
                            f"{max_bytes / 2**20:.0f} MiB")
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise WireError(f"the answers take more than {max_bytes / 2**20:.0f} MiB")
    return data


def load(path: str, max_bytes: int = MAX_BYTES) -> Any:
    """Read and decode the answers file at ``path``: a regular file (never a link), at most ``max_bytes``."""
    return loads(read_plain(os.path.dirname(path) or ".", os.path.basename(path), max_bytes))
