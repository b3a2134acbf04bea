"""Device choice, seeding and profiles (chapter 00).

A *profile* names how big the experiments are:

- ``smoke``: CI, about a minute per notebook on two CPU cores;
- ``cpu``: a laptop, a few minutes per notebook;
- ``gpu``: one modern GPU, full sizes.
"""

from __future__ import annotations

import os
import random
from typing import TYPE_CHECKING, Any, Mapping, TypeVar

if TYPE_CHECKING:
    import torch

# torch is imported inside the functions that need it, so that `course --help`,
# `course grade` and other commands that never touch a tensor start quickly.

PROFILES = ("smoke", "cpu", "gpu")
T = TypeVar("T")


def check_profile(profile: str) -> str:
    """Return ``profile`` if it is known, else raise a ``ValueError`` that lists the choices."""
    if profile not in PROFILES:
        raise ValueError(
            f"unknown profile {profile!r}: choose one of {', '.join(PROFILES)} "
            "(set COURSE_PROFILE or pass --profile)"
        )
    return profile


def pick_profile(requested: str | None = None) -> str:
    """The profile to run: ``requested``, else ``$COURSE_PROFILE``, else ``gpu`` with CUDA, else ``cpu``."""
    import torch

    profile = requested or os.environ.get("COURSE_PROFILE") or ("gpu" if torch.cuda.is_available() else "cpu")
    return check_profile(profile)


def sizes(profile: str, table: Mapping[str, T]) -> T:
    """Look up this profile's entry in a notebook's size table, with a clear error if it is missing."""
    check_profile(profile)
    if profile not in table:
        raise KeyError(f"the size table has no entry for profile {profile!r}; it has {sorted(table)}")
    return table[profile]


def pick_device(profile: str | None = None) -> "torch.device":
    """CUDA when the profile is ``gpu`` and a GPU is present, else the CPU.

    ``smoke`` and ``cpu`` stay on the CPU even on a GPU machine, so that their
    numbers match what CI measures.
    """
    import torch

    if profile in (None, "gpu") and torch.cuda.is_available():
        return torch.device("cuda")
    return torch.device("cpu")


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


def describe() -> dict[str, Any]:
    """Versions and hardware, for chapter 00 and ``course doctor``."""
    import torch

    info: dict[str, Any] = {
        "python": f"{os.sys.version_info.major}.{os.sys.version_info.minor}.{os.sys.version_info.micro}",
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "cpu_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
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
