"""Device choice, seeding, profiles and progress bars (chapter 00); timing is ``timing``'s.

A *profile* names how big the experiments are:

- ``smoke``: CI, about a minute per notebook on two CPU cores;
- ``cpu``: a laptop, at most three minutes per notebook and twenty for the course (``BUDGET_S``);
- ``gpu``: one modern GPU, full sizes (it needs CUDA: see ``pick_profile``).

Not every CPU runs bf16 at speed: ``cpu_speed`` reads ``kernels.probe("bf16")`` (the capability and the ratio
chapter 00 prints), and ``bf16_is_slow`` says whether bf16 is anything but native there.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Mapping, TypeVar

from course_lib import kernels
from course_lib.timing import time_s  # env.time_s is timing.time_s (kernels' probes time with it)

if TYPE_CHECKING:
    import torch
    from tqdm import tqdm

# torch is imported inside the functions that need it, so that `course --help`,
# `course grade` and other commands that never touch a tensor start quickly.

PROFILES = ("smoke", "cpu", "gpu")
T = TypeVar("T")

# The course's time budgets, the one place they are stated (docs/running.md, chapter 00, `course run`'s table and
# benchmarks/bench_notebooks.py read them from here): seconds (a notebook, the whole course) at each profile, on two
# idle CPU cores of either kind (with or without native bf16; see cpu_speed). smoke is what the tests run.
BUDGET_S = {"smoke": (90.0, 15 * 60.0), "cpu": (3 * 60.0, 20 * 60.0)}
# What each notebook took at cpu on two idle cores: (wall, CPU) seconds from `course run`'s summary, on one machine
# with each kind of CPU kernel (MEASURED_ON). docs/running.md's table shows these figures (a test holds the two equal)
# and each notebook's first cell prints its own row (budget_line): the one place they are stated.
MEASURED_MACHINE = "a 2-core AMD EPYC"
MEASURED_ON = {"AVX512": "with AVX-512 (native bf16)", "AVX2": "with PyTorch held to AVX2 kernels (bf16 emulated)"}
MEASURED_CPU_S: dict[str, dict[str, tuple[int, int]]] = {
    "00": {"AVX512": (6, 6), "AVX2": (7, 6)},
    "01": {"AVX512": (12, 11), "AVX2": (12, 12)},
    "02": {"AVX512": (44, 70), "AVX2": (48, 75)},
    "03": {"AVX512": (19, 19), "AVX2": (22, 22)},
    "04": {"AVX512": (64, 117), "AVX2": (83, 152)},
    "05": {"AVX512": (48, 47), "AVX2": (50, 49)},
    "06": {"AVX512": (44, 44), "AVX2": (45, 45)},
    "07": {"AVX512": (34, 47), "AVX2": (35, 49)},
    "08": {"AVX512": (124, 80), "AVX2": (124, 81)},
    "09": {"AVX512": (69, 96), "AVX2": (77, 112)},
    "10": {"AVX512": (40, 57), "AVX2": (36, 57)},
    "11": {"AVX512": (62, 64), "AVX2": (71, 73)},
    "12": {"AVX512": (34, 48), "AVX2": (31, 46)},
    "13": {"AVX512": (74, 94), "AVX2": (71, 91)},
}
# A bf16 matmul this many times slower than the same fp32 one means the CPU emulates bf16 (kernels.SLOW_RATIO says
# where the figure comes from).
BF16_SLOW_RATIO = kernels.SLOW_RATIO["bf16"]


def check_profile(profile: str) -> str:
    """The known profile ``profile`` names, in lowercase, else a ``ValueError`` that lists the choices.

    ``"CPU"`` and ``" cpu "`` are forgiven: a name typed into a parameters cell need not match in case or spaces.
    """
    where = "edit PROFILE in the notebook's parameters cell, set COURSE_PROFILE, or pass --profile"
    if not isinstance(profile, str):
        raise ValueError(f"a profile is a name such as 'cpu', not {type(profile).__name__} {profile!r}: "
                         f"choose one of {', '.join(PROFILES)} ({where})")
    name = profile.strip().lower()
    if name not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}: choose one of {', '.join(PROFILES)} ({where})")
    return name


def pick_profile(requested: str | None = None) -> str:
    """The profile to run: ``requested``, else ``$COURSE_PROFILE``, else ``gpu`` with CUDA, else ``cpu``.

    The name comes back lowercase and stripped (``check_profile``), so ``PROFILE = "CPU"`` runs the cpu sizes.

    Asking for ``gpu`` where PyTorch sees no CUDA device is an error, not a
    warning: the gpu sizes would run on the CPU for hours (a warning would
    scroll past while the first cell runs), and no CUDA-only measurement would
    happen. The message says what to choose instead.
    """
    import torch

    profile = check_profile(
        requested or os.environ.get("COURSE_PROFILE") or ("gpu" if torch.cuda.is_available() else "cpu"))
    if profile == "gpu" and not torch.cuda.is_available():
        source = "asked for" if requested else "set by COURSE_PROFILE"
        raise ValueError(
            f"profile 'gpu' ({source}) needs a CUDA GPU, and PyTorch sees none "
            f"(torch {torch.__version__}, torch.cuda.is_available() is False). Its sizes would run on the CPU "
            "for hours. Choose 'cpu' (at most 3 minutes a notebook) or 'smoke' (about a minute): "
            'PROFILE = "cpu" in the parameters cell, COURSE_PROFILE=cpu, or `course run --profile cpu`. '
            "If this machine has a GPU, `course doctor` shows what PyTorch sees (a CPU-only torch build, or a "
            "driver older than the build needs); on a hosted notebook, choose a GPU runtime."
        )
    return profile


def sizes(profile: str, table: Mapping[str, T]) -> T:
    """Look up this profile's entry in a notebook's size table, with a clear error if it is missing."""
    profile = check_profile(profile)  # "CPU" is cpu here too
    if profile not in table:
        raise KeyError(f"the size table has no entry for profile {profile!r}; it has {sorted(table)}")
    return table[profile]


def duration(seconds: float) -> str:
    """``45 s``, ``3 min 10 s``, ``1 h 02 min``: a time a reader takes in at a glance."""
    s = round(seconds)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


def budget_line(profile: str, notebook: str) -> str:
    """What ``notebook`` (``"04"``) may take at ``profile``, what it took on the machines measured, and this CPU."""
    import torch

    profile = check_profile(profile)
    if profile == "gpu":
        return ("gpu profile: sizes for one modern GPU (each notebook's parameters cell estimates its time; the "
                "course has not yet been timed on a GPU)")
    one, whole = BUDGET_S[profile]
    line = f"{profile} profile: budget {duration(one)} for this notebook ({duration(whole)} for the course) on two idle cores"
    if profile == "cpu" and notebook in MEASURED_CPU_S:
        line += f"; measured on {MEASURED_MACHINE}: " + ", ".join(
            f"{duration(wall)} {MEASURED_ON[kind]}" for kind, (wall, _) in MEASURED_CPU_S[notebook].items())
    return line + f". This CPU: {torch.backends.cpu.get_cpu_capability()}; `course run` prints this run's time."


def pick_device(profile: str | None = None) -> "torch.device":
    """CUDA when the profile is ``gpu`` and a GPU is present, else the CPU.

    ``smoke`` and ``cpu`` stay on the CPU even on a GPU machine, so that their
    numbers match what CI measures.
    """
    import torch

    if profile in (None, "gpu") and torch.cuda.is_available():
        return torch.device("cuda")
    return torch.device("cpu")


def show_progress() -> bool:
    """Whether progress bars are shown: yes, unless ``COURSE_PROGRESS=0``.

    ``course run`` sets it to 0: a bar inside a kernel would only fill the
    executed notebook with redrawn lines; the runner prints its own line per cell.
    """
    return os.environ.get("COURSE_PROGRESS", "1") != "0"


def progress(iterable: Iterable[T], desc: str, total: int | None = None) -> "tqdm":
    """``iterable`` wrapped in a text progress bar (tqdm) for a long cell; silent when ``show_progress()`` is off."""
    from tqdm import tqdm

    # Plain text tqdm, not the widget one: it renders in JupyterLab, a terminal and a stored notebook alike.
    return tqdm(iterable, desc=desc, total=total, disable=not show_progress(), mininterval=1.0)


def seed_everything(seed: int) -> "torch.Generator":
    """Seed Python, NumPy and PyTorch (CPU and CUDA); return a CPU generator seeded the same.

    The same seed gives the same numbers on the same machine. Different
    machines (or thread counts) can still differ in the last bits of float sums.
    """
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device
    return torch.Generator().manual_seed(seed)


@dataclass(frozen=True)
class CpuSpeed:
    """What this CPU's vector units are, and how fast it runs bf16 against fp32 (see ``cpu_speed``)."""

    capability: str        # torch.backends.cpu.get_cpu_capability(): "AVX512", "AVX2", "DEFAULT", ...
    bf16_over_fp32: float  # time of a bf16 matmul over the same matmul in fp32, on one thread (nan: not measured)
    verdict: str = ""      # kernels.probe("bf16")'s verdict; "" derives it from the ratio

    @property
    def bf16_is_slow(self) -> bool:
        """True where bf16 is emulated (or broken, or forced so): its matmuls take several times fp32's."""
        return self.verdict in ("slow", "broken") if self.verdict else self.bf16_over_fp32 > BF16_SLOW_RATIO

    def summary(self) -> str:
        """One line: the capability, the measured ratio, and what it means for the course."""
        speed = ("bf16 matmuls are broken or forced slow (`course doctor` says which)" if self.bf16_over_fp32 != self.bf16_over_fp32
                 else f"a bf16 matmul takes {self.bf16_over_fp32:.1f}x as long as fp32" if self.bf16_over_fp32 >= 1
                 else f"a bf16 matmul takes {self.bf16_over_fp32:.2f} of fp32's time")
        meaning = ("bf16 is emulated on this CPU: chapter 05 runs its bf16 steps through an emulated twin at fp32's "
                   "speed, chapter 13 leaves bf16 out (each says so), and bf16 times say nothing about a GPU"
                   if self.bf16_is_slow else "bf16 runs natively on this CPU")
        return f"{self.capability}, {speed} ({meaning})"


def cpu_speed() -> CpuSpeed:
    """This CPU's capability and its bf16 / fp32 matmul time ratio: ``kernels.probe("bf16")``, measured once per
    machine (a batched 4 x 256 x 256 product, the shape class of attention's matmuls, on one thread)."""
    import torch

    v = kernels.probe("bf16")
    return CpuSpeed(torch.backends.cpu.get_cpu_capability(), v.ratio if v.ratio is not None else float("nan"),
                    v.verdict)


def bf16_is_slow(device: "torch.device | str") -> bool:
    """Whether bf16 matmuls on ``device`` are not native: slow (a CPU without bf16 instructions) or broken.

    The planner (chapter 13) asks this before it searches bf16; a chapter that runs bf16 asks
    ``kernels.bf16_matmuls`` for the kernel or its emulated twin instead.
    """
    import torch

    return torch.device(device).type == "cpu" and cpu_speed().bf16_is_slow


def describe() -> dict[str, Any]:
    """Versions and hardware, for chapter 00 and ``course doctor``."""
    import torch

    info: dict[str, Any] = {
        "python": f"{os.sys.version_info.major}.{os.sys.version_info.minor}.{os.sys.version_info.micro}",
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "cpu_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "cpu": cpu_speed().summary(),
    }
    try:
        import torchvision

        info["torchvision"] = torchvision.__version__
    except Exception as exc:  # a broken torchvision should not stop the course
        info["torchvision"] = f"unavailable ({exc})"
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        info["bf16_supported"] = torch.cuda.is_bf16_supported()
    return info
