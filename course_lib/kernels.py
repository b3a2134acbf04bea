"""Low-precision kernels, measured on this machine before a chapter trusts them (chapter 00).

A CPU may run a bf16 or FP8 matmul natively, convert element by element and take tens or thousands of times
fp32's time, or raise. ``probe(name)`` times one small call of each kernel in ``KERNELS`` against the same call in
fp32, on one thread, and gives a ``Verdict``: ``native``, ``slow`` (past ``SLOW_RATIO``) or ``broken`` (it raised;
the error is kept). A chapter that loops over a kernel asks ``native(name, device)`` and runs the kernel only
there, else an emulated twin with the same numerics (``bf16_matmuls`` here, ``fp8_linear.scaled_mm_emulated``
and ``fp8_linear.ScaledMMEmulation``), and prints which it ran (``Verdict.summary``). GPUs are not probed: their kernels run.

Verdicts are cached per machine (the CPU, its capability, torch's version, the settings that change kernels) in
``cache_dir()``. ``COURSE_KERNELS="fp8=broken,bf16=slow"`` (or ``all=slow``) forces verdicts: the tests run the
chapters under forced slow and broken verdicts, so the paths of CPUs nobody here has run too; a forced broken
``_scaled_mm`` raises when called (``guard_forced``), so no path that still calls it goes unnoticed.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
from contextlib import nullcontext, suppress
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable

import torch
from torch import nn
# no public API: a dispatch mode is the only way to see every matmul, _push_mode the only way to put one at the
# bottom of the stack for good (guard_forced), tree_map the one that walks an op's nested arguments
from torch.utils._python_dispatch import TorchDispatchMode, _push_mode
from torch.utils._pytree import tree_map

from course_lib.timing import time_s

FORCE_ENV = "COURSE_KERNELS"
VERDICTS = ("native", "slow", "broken")
KERNELS = {
    "bf16": "bf16 matmul (autocast's), a 4 x 256 x 256 bmm",
    "fp16": "fp16 matmul, a 4 x 256 x 256 bmm",
    "fp8": "FP8 torch._scaled_mm, e4m3 x e4m3 and e5m2 x e4m3 -> fp32, 128 x 128 x 128",
    "torchao": "torchao's Float8Linear, forward + backward of 128 -> 128 on 128 tokens",
}
# Past these ratios of the kernel's time over fp32's, a chapter that loops over the kernel runs its emulated twin.
# bf16, fp16: measured 0.2-0.5 with AVX512-BF16 or AMX, 20-60 on AVX2-only CPUs (oneDNN converts element by
# element); anything above 3 makes a bf16 cell several times slower than its fp32 twin. fp8: 2-4 on the AVX-512
# EPYC the course was timed on (chapter 06 fits its budget there), 7 with oneDNN held to AVX2 on an AMX Xeon, and
# 2,900 on that Xeon's default path; the emulated twin (an fp32 matmul of the dequantized values) took 2.2 at
# 256 x 256 on the EPYC. torchao: its eager layer adds casts and amax reductions around each small matmul: 3.4-4.5
# on the EPYC, where its _scaled_mm took 3.
SLOW_RATIO = {"bf16": 3.0, "fp16": 3.0, "fp8": 10.0, "torchao": 30.0}


@dataclass(frozen=True)
class Verdict:
    """One kernel on this CPU: ``native``, ``slow`` or ``broken``, its time over fp32's, and why if forced."""

    kernel: str
    verdict: str
    ratio: float | None      # kernel time / fp32 time, one thread; None where it raised or was not measured
    error: str | None = None  # what it raised
    forced: bool = False      # set by COURSE_KERNELS, not measured

    def _how(self, brief: bool) -> str:
        return ("forced" + ("" if brief else f" by {FORCE_ENV}") if self.forced else
                f"raises {self.error.split(':')[0] if brief else self.error}" if self.error else
                f"{self.ratio:.2g}x fp32" + ("" if brief else "'s time") if self.ratio is not None else "not measured")

    def summary(self) -> str:
        """One line: the verdict, the measured ratio or the error, and what the course runs."""
        runs = ("the kernel runs" if self.verdict == "native" else
                f"past {SLOW_RATIO[self.kernel]:g}x: its emulated twin runs" if self.verdict == "slow" else
                "its emulated twin runs")
        return f"{self.kernel}: {self.verdict} ({self._how(brief=False)}; {runs})"

    def short(self) -> str:
        """A few words: ``fp8 native (3.1x fp32)``, ``fp8 broken (raises RuntimeError)``, ``bf16 slow (forced)``."""
        return f"{self.kernel} {self.verdict} ({self._how(brief=True)})"


def forced() -> dict[str, str]:
    """The verdicts ``COURSE_KERNELS`` forces (``"fp8=broken,bf16=slow"``, ``"all=slow"``), checked."""
    spec = os.environ.get(FORCE_ENV, "").strip()
    out: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, verdict = (s.strip().lower() for s in item.partition("="))
        if verdict not in VERDICTS or name not in (*KERNELS, "all"):
            raise ValueError(f"{FORCE_ENV}={spec!r}: {item!r} is not KERNEL=VERDICT with KERNEL one of "
                             f"{', '.join(KERNELS)} or all, and VERDICT one of {', '.join(VERDICTS)}")
        out.update(dict.fromkeys(KERNELS, verdict) if name == "all" else {name: verdict})
    return out


def _cpu_name() -> str:
    """The CPU's model name on Linux, macOS (Apple silicon included) or anything else Python can name."""
    with suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "hardware", "cpu model")):
                return line.split(":", 1)[1].strip()
    if sys.platform == "darwin":
        with suppress(OSError, subprocess.SubprocessError):
            return subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                                  timeout=5).stdout.strip()
    return platform.processor() or platform.machine()


_ISA_SETTINGS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")  # each changes which kernels run


def machine_key() -> str:
    """What the verdicts depend on: the CPU, the ISA PyTorch picked, its version, and the settings that cap it."""
    return "|".join([platform.machine(), _cpu_name(), torch.backends.cpu.get_cpu_capability(), torch.__version__,
                     *(f"{k}={os.environ.get(k, '')}" for k in _ISA_SETTINGS)])


def cache_dir() -> Path:
    """``$COURSE_CACHE_DIR``, else ``$XDG_CACHE_HOME/fit-course``, else ``~/.cache/fit-course``."""
    base = os.environ.get("COURSE_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fit-course"
    return Path(base)


def _cache_file() -> Path:
    return cache_dir() / f"kernels-{hashlib.sha256(machine_key().encode()).hexdigest()[:16]}.json"


def inductor_cache_dir() -> Path:
    """A torch.compile cache for this CPU and these ISA settings (chapter 11 compiles): a run held to AVX2
    (``ATEN_CPU_CAPABILITY=avx2``) gets a folder of its own, so nothing it builds is loaded by a run that is not.
    Without torch: ``course lab`` sets it before any kernel starts (inductor keys its entries by torch's version)."""
    key = "|".join([platform.machine(), _cpu_name(), *(f"{k}={os.environ.get(k, '')}" for k in _ISA_SETTINGS)])
    return cache_dir() / f"inductor-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def _ratio(kernel: Callable[[], object], fp32: Callable[[], object], limit: float) -> float:
    """The kernel's time over fp32's, the fastest of three calls each after a warm-up; one call if clearly slow."""
    fp32()
    base = min(time_s(fp32, "cpu") for _ in range(3))
    first = time_s(kernel, "cpu")  # the warm-up, timed: 10x past its limit is verdict enough (a 3,000x kernel
    if first > 10 * limit * base:  # is not called twice)
        return first / base
    return min(time_s(kernel, "cpu") for _ in range(3)) / base


def _matmul_pair(dtype: torch.dtype) -> tuple[Callable, Callable]:
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(4, 256, 256, generator=gen), torch.randn(4, 256, 256, generator=gen)  # host: a CPU probe
    x, y = a.to(dtype), b.to(dtype)
    return (lambda: torch.bmm(x, y)), (lambda: torch.bmm(a, b))


def _fp8_pair() -> tuple[Callable, Callable]:
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(128, 128, generator=gen), torch.randn(128, 128, generator=gen)  # host: a CPU probe
    one = torch.tensor(1.0)  # host
    w = b.to(torch.float8_e4m3fn).t().contiguous().t()  # _scaled_mm wants its second operand column-major
    x, g = a.to(torch.float8_e4m3fn), a.to(torch.float8_e5m2)

    def both() -> None:  # the forward's e4m3 x e4m3 and the backward's e5m2 x e4m3, as chapter 06's layer runs them
        for lhs in (x, g):
            torch._scaled_mm(lhs, w, scale_a=one, scale_b=one, out_dtype=torch.float32)

    return both, (lambda: [a @ b for _ in range(2)])


def _torchao_pair() -> tuple[Callable, Callable]:
    from course_lib.fp8_linear import torchao_float8  # it imports this module

    torch.manual_seed(0)
    plain, x = nn.Linear(128, 128), torch.randn(128, 128, requires_grad=True)  # host: a CPU probe
    converted = torchao_float8(nn.Linear(128, 128))
    return (lambda: converted(x).sum().backward()), (lambda: plain(x).sum().backward())


_PAIRS = {"bf16": lambda: _matmul_pair(torch.bfloat16), "fp16": lambda: _matmul_pair(torch.float16),
          "fp8": _fp8_pair, "torchao": _torchao_pair}


def measure(kernel: str) -> Verdict:
    """Time ``kernel`` against fp32 on one thread now (well under a second; one call where it is far too slow)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a busy second core does not move a one-thread ratio
    try:
        ratio = _ratio(*_PAIRS[kernel](), SLOW_RATIO[kernel])
    except Exception as exc:  # any error is the verdict: this CPU and library cannot run the kernel
        return Verdict(kernel, "broken", None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
    finally:
        torch.set_num_threads(threads)
    return Verdict(kernel, "slow" if ratio > SLOW_RATIO[kernel] else "native", ratio)


def _read_cache() -> dict:
    with suppress(OSError, ValueError):
        return json.loads(_cache_file().read_text())
    return {}


def _write_cache(entries: dict) -> None:
    path = _cache_file()
    with suppress(OSError):  # a read-only home (the grader's sandbox) only costs a new measurement next time
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entries, indent=1))
        tmp.replace(path)  # whole, or not there: another process may probe at the same time


@lru_cache(maxsize=None)
def probe(kernel: str) -> Verdict:
    """This machine's verdict on ``kernel``: forced by ``COURSE_KERNELS``, else cached, else measured now."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}: choose one of {', '.join(KERNELS)}")
    if kernel in forced():
        return Verdict(kernel, forced()[kernel], None, forced=True)
    cached = _read_cache().get(kernel)
    if cached:
        return Verdict(**cached)
    verdict = measure(kernel)
    _write_cache({**_read_cache(), kernel: asdict(verdict)})
    return verdict


def probe_all() -> dict[str, Verdict]:
    """Every kernel's verdict (measured once per machine: about a second, torchao's import included)."""
    return {k: probe(k) for k in KERNELS}


def native(kernel: str, device: torch.device | str = "cpu") -> bool:
    """Whether to run ``kernel`` itself on ``device``: always on a GPU, on a CPU where its verdict is native."""
    return torch.device(device).type != "cpu" or probe(kernel).verdict == "native"


_GUARD: list = []  # what breaks the forced kernels, kept alive for the process
_BF16_OPS = frozenset({torch.ops.aten.mm, torch.ops.aten.bmm, torch.ops.aten.addmm, torch.ops.aten.baddbmm,
                       torch.ops.aten.addbmm, torch.ops.aten.convolution, torch.ops.aten.convolution_backward,
                       torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
                       torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward})


def _bf16_matmul(func, args, device_type: str | None = None) -> bool:
    """Whether ``func(*args)`` is a matmul or convolution of a bf16 tensor (on ``device_type``, if given)."""
    return func.overloadpacket in _BF16_OPS and any(
        isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 and device_type in (None, a.device.type)
        for a in args)


def _refuse(what: str):
    raise RuntimeError(f"{what} is broken on this CPU ({FORCE_ENV} forces it): a chapter should have run its "
                       "emulated twin")


class RefuseBF16(TorchDispatchMode):
    """Raises at a bf16 matmul on the CPU, as a broken kernel does (``COURSE_KERNELS`` with ``bf16=broken``)."""

    @classmethod
    def is_infra_mode(cls) -> bool:  # so that torch.compile still compiles under it (chapter 11)
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _bf16_matmul(func, args, "cpu"):
            _refuse(f"a bf16 {func.overloadpacket.__name__}")
        return func(*args, **(kwargs or {}))


def guard_forced() -> None:
    """Where ``COURSE_KERNELS`` forces a kernel broken, make it raise on a CPU, as a broken one does (called at import).

    fp8: the CPU kernel of ``_scaled_mm`` is overridden where it is registered, below autograd and the Python
    dispatch modes, so an emulation (``fp8_linear.ScaledMMEmulation``) still catches the call first. bf16: a dispatch
    mode at the bottom of the stack refuses bf16 matmuls; ``bf16_matmuls``' emulation, entered above it, hands it
    float32 ones (not in torchrun's ranks, see below). Every op then passes through Python: forced runs are slower,
    and only the tests force."""
    if _GUARD:
        return
    if forced().get("fp8") == "broken":
        lib = torch.library.Library("aten", "IMPL")
        lib.impl("_scaled_mm", lambda *a, **k: _refuse("torch._scaled_mm"), "CPU")
        _GUARD.append(lib)
    # bf16's guard stays out of the ranks torchrun starts: a mode under every op changes what their profiler traces
    # record (chapter 09 reads its collectives from them)
    if forced().get("bf16") == "broken" and "LOCAL_RANK" not in os.environ:
        _GUARD.append(RefuseBF16())
        _push_mode(_GUARD[-1])


class EmulatedBF16(TorchDispatchMode):
    """bf16 matmuls and convolutions computed in float32 from the same bf16 inputs, the result rounded to bf16:
    what a native bf16 kernel computes (it too accumulates in float32), at about fp32's speed. The fp32 copies
    of the inputs are transient bytes a native kernel would not allocate."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _bf16_matmul(func, args):
            return func(*args, **kwargs)
        up = tree_map(lambda t: t.float() if isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 else t,
                      (args, kwargs))
        return tree_map(lambda t: t.bfloat16() if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
                        func(*up[0], **up[1]))


def bf16_matmuls(device: torch.device | str = "cpu", emulate: tuple[str, ...] = ("slow", "broken")):
    """A context in which bf16 matmuls run as this machine allows: natively, or emulated (``EmulatedBF16``) where
    ``kernels.probe("bf16")``'s verdict is in ``emulate``. Wrap a bf16 region in it, its backward included:
    ``with kernels.bf16_matmuls(DEVICE): ...``. Chapter 09 passes ``("broken",)``: it times the slow kernel."""
    cpu = torch.device(device).type == "cpu"
    return EmulatedBF16() if cpu and probe("bf16").verdict in emulate else nullcontext()


guard_forced()
