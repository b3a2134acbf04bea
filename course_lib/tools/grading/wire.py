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
the decoder treats it as untrusted input.
"""

from __future__ import annotations

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


class _Decoder:
    def __init__(self, blob: bytes, sizes: list) -> None:
        if type(sizes) is not list or not all(type(s) is int and s >= 0 for s in sizes):
            raise WireError("the tensor table is malformed")
        if sum(sizes) != len(blob):
            raise WireError(f"the file holds {len(blob)} bytes of tensors, the table says {sum(sizes)}")
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        self.sizes, self.blob, self.items = sizes, blob, 0

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
            try:
                return {"tuple": tuple, "set": set, "frozenset": frozenset}[tag](items)
            except TypeError:
                raise WireError(f"a {tag} holds an unhashable value") from None
        if tag == "dict" and type(body) is list:
            out = {}
            for pair in body:
                if type(pair) is not list or len(pair) != 2:
                    raise WireError("a dict entry is not a [key, value] pair")
                key = self.value(pair[0], depth + 1)
                try:
                    out[key] = self.value(pair[1], depth + 1)
                except TypeError:
                    raise WireError("a dict key is unhashable") from None
            return out
        if tag == "tensor":
            return self.tensor(body)
        raise WireError(f"unknown tag {tag!r}")

    def tensor(self, body: Any) -> Any:
        import torch

        if (type(body) is not list or len(body) != 3 or type(body[0]) is not int or type(body[1]) is not str
                or type(body[2]) is not list or not all(type(d) is int and d >= 0 for d in body[2])):
            raise WireError("a tensor entry is malformed")
        index, name, shape = body
        if name not in DTYPES:
            raise WireError(f"unknown dtype {name!r}")
        if not 0 <= index < len(self.sizes):
            raise WireError(f"tensor {index} is not in the table")
        dtype = getattr(torch, DTYPES[DTYPES.index(name)])
        numel = math.prod(shape)
        size = numel * torch.empty((), dtype=dtype).element_size()
        if size != self.sizes[index]:
            raise WireError(f"tensor {index} of shape {shape} and dtype {name} needs {size} bytes, "
                            f"the file holds {self.sizes[index]}")
        start = self.offsets[index]
        raw = bytearray(self.blob[start:start + size])
        flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        return flat.view(dtype).reshape(shape).clone()


def loads(data: bytes) -> Any:
    """Decode an answers file; raise ``WireError`` with what is wrong."""
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + 8:
        raise WireError("not an answers file (wrong header)")
    (n,) = struct.unpack("<Q", data[len(MAGIC):len(MAGIC) + 8])
    start = len(MAGIC) + 8
    if n > len(data) - start:
        raise WireError("the file is cut short")
    try:
        doc = json.loads(data[start:start + n].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise WireError(f"the answers are not valid JSON ({type(exc).__name__})") from None
    if type(doc) is not dict or set(doc) != {"value", "sizes"}:
        raise WireError("the answers document is malformed")
    return _Decoder(data[start + n:], doc["sizes"]).value(doc["value"], 0)


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
