"""Datasets and loaders (chapter 00).

``shapes``: the offline default. Ten classes of procedurally drawn shapes in
CIFAR's format (3x32x32 float images, labels 0-9), drawn deterministically
from a seed: random position, scale, rotation, colours, background gradient
and pixel noise. No download, no files; 10,000 images take under a second of CPU time.

``cifar10``: torchvision's CIFAR-10, used when it is under ``data/`` or when
the learner passes ``download=True``.

``tokens``: integer sequences for the tiny transformer (chapters 03, 08, 09, 11 and 13).
"""

from __future__ import annotations

import hashlib
import http.client
import math
import shutil
import tarfile
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

DATA_ROOT = Path(__file__).resolve().parent.parent / "data"
SHAPE_CLASSES = (
    "circle", "ring", "square", "triangle", "plus",
    "star", "ellipse", "crescent", "ell", "half-disc",
)
DATASETS = ("shapes", "cifar10")
# Per-channel mean and std of CIFAR-10's training set (the values torchvision's
# examples use); the shapes set is drawn to have similar statistics.
CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)
# Where torchvision.datasets.CIFAR10 downloads from, and the archive's MD5 (its `url` and `tgz_md5`).
CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
CIFAR10_MD5 = "c58f30108f718f92721af3b95e74349a"
CIFAR10_FOLDER = "cifar-10-batches-py"


# How the shapes are drawn. Tuned by measurement (data/README.md has the numbers):
# big, high-contrast shapes make the set quick to learn (a 7-conv ResNet of width 16
# reaches 3-4% test error with BatchNorm at batch 32 in three epochs on one CPU
# thread), while the random colours vary each image's channel statistics enough that
# BatchNorm at batch 2 is clearly worse (7-12% over three seeds). A background range of [0, 1]
# made BatchNorm at batch 2 collapse (70% error); small shapes (radius 7-14 pixels,
# centred anywhere) learnt too slowly for the ``cpu`` profile (27% at batch 32).
SCALE_RANGE = (0.6, 0.95)       # the shape's radius as a fraction of the image's half-width (10 to 15 pixels)
CENTRE_RANGE = 0.6              # centres drawn uniformly in [-0.3, 0.3] of the half-width on each axis
BACKGROUND_RANGE = (0.3, 0.7)   # each background channel uniform in this range
GRADIENT = 0.15                 # strength of the background's linear brightness ramp
MIN_COLOUR_DISTANCE = 0.5       # foreground and background RGB colours at least this far apart


def _shape_mask(label: int, u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Foreground mask of shape ``label`` in local coordinates where the shape spans about [-1, 1]."""
    r = torch.sqrt(u**2 + v**2)
    if label == 0:   # circle
        return r < 0.8
    if label == 1:   # ring
        return (r > 0.5) & (r < 0.9)
    if label == 2:   # square
        return (u.abs() < 0.7) & (v.abs() < 0.7)
    if label == 3:   # triangle
        return (v > -0.45) & (v < 0.9 - math.sqrt(3) * u.abs())
    if label == 4:   # plus
        return ((u.abs() < 0.25) & (v.abs() < 0.85)) | ((v.abs() < 0.25) & (u.abs() < 0.85))
    if label == 5:   # five-pointed star
        return r < 0.55 + 0.35 * torch.cos(5 * torch.atan2(v, u))
    if label == 6:   # ellipse
        return (u / 0.95) ** 2 + (v / 0.45) ** 2 < 1
    if label == 7:   # crescent
        return (r < 0.85) & ((u - 0.4) ** 2 + v**2 > 0.6**2)
    if label == 8:   # ell
        return ((u > -0.7) & (u < -0.2) & (v.abs() < 0.8)) | ((u.abs() < 0.7) & (v > -0.8) & (v < -0.3))
    return (r < 0.85) & (v > -0.1)  # half-disc


def make_shapes(n: int, seed: int = 0, size: int = 32, noise: float = 0.05) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw ``n`` labelled shape images: ``(images (n, 3, size, size) in [0, 1], labels (n,))``.

    The same ``(n, seed)`` always gives the same tensors; different seeds give
    independent sets (train and test use different seeds). Each image: one of
    the ten ``SHAPE_CLASSES`` at a random position, scale and rotation, in a
    random colour on a random background colour with a linear gradient, plus
    Gaussian pixel noise of standard deviation ``noise``.
    """
    if n <= 0:
        raise ValueError(f"n must be positive, got {n}")
    if size < 8:
        raise ValueError(f"size must be at least 8 pixels to draw a recognisable shape, got {size}")
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.rand(*shape, generator=g)  # noqa: E731
    labels = torch.randint(0, len(SHAPE_CLASSES), (n,), generator=g)
    # Pixel grid in [-1, 1]; each shape gets its own centre, scale and rotation.
    axis = torch.linspace(-1, 1, size)
    y, x = torch.meshgrid(axis, axis, indexing="ij")
    cx, cy = (rand(n) - 0.5) * CENTRE_RANGE, (rand(n) - 0.5) * CENTRE_RANGE
    lo, hi = SCALE_RANGE
    scale = lo + (hi - lo) * rand(n)
    angle = rand(n) * 2 * math.pi
    dx = (x[None] - cx[:, None, None]) / scale[:, None, None]  # (n, H, W)
    dy = (y[None] - cy[:, None, None]) / scale[:, None, None]
    cos, sin = torch.cos(angle)[:, None, None], torch.sin(angle)[:, None, None]
    u, v = cos * dx + sin * dy, -sin * dx + cos * dy
    mask = torch.empty(n, size, size, dtype=torch.bool)
    for label in range(len(SHAPE_CLASSES)):  # each image's own shape only: 10x less work than all ten
        idx = (labels == label).nonzero().squeeze(1)
        mask[idx] = _shape_mask(label, u[idx], v[idx])
    mask = mask.unsqueeze(1)  # (n, 1, H, W)
    # Background: a mid-range colour with a random linear gradient. Foreground: a
    # random colour; one too close to the background is replaced by the background
    # shifted half-way round each channel's range (0.5 away in every channel).
    bg_lo, bg_hi = BACKGROUND_RANGE
    bg = bg_lo + (bg_hi - bg_lo) * rand(n, 3, 1, 1)
    grad_dir = rand(n, 2, 1, 1) * 2 - 1
    background = bg + GRADIENT * (grad_dir[:, :1] * x + grad_dir[:, 1:] * y)  # (n, 3, H, W)
    fg = rand(n, 3, 1, 1)
    too_close = (fg - bg).norm(dim=1, keepdim=True) < MIN_COLOUR_DISTANCE
    fg = torch.where(too_close, (bg + 0.5) % 1, fg)
    images = torch.where(mask, fg, background)
    images += noise * torch.randn(images.shape, generator=g)
    return images.clamp_(0, 1), labels


def normalize(images: torch.Tensor) -> torch.Tensor:
    """Standardise channels with CIFAR-10's mean and std, as torchvision's examples do."""
    mean = torch.tensor(CIFAR_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(CIFAR_STD).view(1, 3, 1, 1)
    return (images - mean) / std


def load_dataset(name: str = "shapes", split: str = "train", n: int | None = None, seed: int = 0,
                 root: str | Path = DATA_ROOT, download: bool = False, size: int = 32) -> Dataset:
    """A CIFAR-shaped dataset of normalised ``(image, label)`` pairs.

    ``shapes`` (default, offline): ``n`` images (8,000 train / 2,000 test by
    default) drawn from ``seed``, ``size`` pixels square (32 as in CIFAR; a
    smaller size draws the same scenes with fewer pixels, and costs a model
    proportionally less compute). ``cifar10``: read from ``root``; missing
    files are an error unless ``download=True``. ``n`` keeps the first ``n``.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if name == "shapes":
        count = n or (8000 if split == "train" else 2000)
        # Train and test come from different seeds, so they share no image.
        images, labels = make_shapes(count, seed=2 * seed + (split == "test"), size=size)
        return TensorDataset(normalize(images), labels)
    if name == "cifar10":
        if size != 32:
            raise ValueError(f"CIFAR-10's images are 32x32 pixels; size={size} applies to the shapes dataset only")
        return _cifar10(split, n, Path(root), download)
    raise ValueError(f"unknown dataset {name!r}: choose one of {', '.join(DATASETS)}")


def cifar10_available(root: str | Path = DATA_ROOT) -> bool:
    """True when torchvision's CIFAR-10 files are under ``root``."""
    return (Path(root) / CIFAR10_FOLDER / "data_batch_1").exists()


def download_cifar10(root: str | Path = DATA_ROOT, timeout: float = 60.0) -> Path:
    """Download and unpack CIFAR-10 (about 170 MB) into ``root``; returns its folder.

    The archive goes to a temporary file and the folder is unpacked beside it, each renamed into place only when
    complete, so a failed or interrupted download leaves nothing that looks like CIFAR-10. ``timeout`` is in seconds
    for each network read (a stalled connection fails instead of hanging). Raises ``ConnectionError`` with the
    offline alternative when the host cannot be reached.
    """
    root = Path(root)
    folder = root / CIFAR10_FOLDER
    if cifar10_available(root):
        return folder
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=".cifar10-download-") as tmp:  # removed however this ends
        archive = Path(tmp) / "cifar-10-python.tar.gz"
        md5, done = hashlib.md5(), 0
        try:
            with urllib.request.urlopen(CIFAR10_URL, timeout=timeout) as response, open(archive, "wb") as out:
                total, shown = int(response.headers.get("Content-Length") or 0), 0
                while chunk := response.read(1 << 20):
                    md5.update(chunk)
                    out.write(chunk)
                    done += len(chunk)
                    if total and done * 10 // total > shown:  # a line every tenth: minutes on a slow line
                        shown = done * 10 // total
                        print(f"CIFAR-10: {done / 2**20:.0f} of {total / 2**20:.0f} MiB", flush=True)
        except (urllib.error.URLError, http.client.HTTPException, ConnectionError, TimeoutError) as exc:
            host, reason = urllib.parse.urlsplit(CIFAR10_URL).netloc, getattr(exc, "reason", None) or exc
            what = f"the download from {host} broke off after {done / 2**20:.0f} MiB" if done else \
                f"could not reach the download host {host}"
            raise ConnectionError(
                f"{what}: {reason}. "
                f"Offline: copy torchvision's {CIFAR10_FOLDER} folder (from a machine that has it) into {root}, "
                "where `course doctor` then finds it") from exc
        if md5.hexdigest() != CIFAR10_MD5:
            raise ValueError(f"the CIFAR-10 download from {CIFAR10_URL} is damaged (MD5 {md5.hexdigest()}, expected "
                             f"{CIFAR10_MD5}); run `course download cifar10` again")
        with tarfile.open(archive) as tar:
            # the MD5 vouches for the archive; where tarfile has filters (3.10.12+), "data" also keeps it inside tmp
            tar.extractall(tmp, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
        if not (Path(tmp) / CIFAR10_FOLDER / "data_batch_1").exists():
            raise ValueError(f"the archive from {CIFAR10_URL} holds no {CIFAR10_FOLDER}/data_batch_1")
        shutil.rmtree(folder, ignore_errors=True)  # an incomplete folder from an earlier attempt
        (Path(tmp) / CIFAR10_FOLDER).rename(folder)
    return folder


def _cifar10(split: str, n: int | None, root: Path, download: bool) -> Dataset:
    if not download and not cifar10_available(root):
        raise FileNotFoundError(
            f"CIFAR-10 is not under {root}. Download it once (about 170 MB) with\n"
            "    course download cifar10\n"
            "or pass download=True; or use the offline default, load_dataset('shapes')."
        )
    if download:
        download_cifar10(root)
    import torchvision

    ds = torchvision.datasets.CIFAR10(str(root), train=split == "train")
    images = torch.from_numpy(ds.data).permute(0, 3, 1, 2).float() / 255  # (N, 32, 32, 3) uint8 -> (N, 3, 32, 32)
    labels = torch.tensor(ds.targets)
    if n is not None:
        images, labels = images[:n], labels[:n]
    return TensorDataset(normalize(images), labels)


def make_tokens(n: int, seq_len: int, vocab: int = 64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences for next-token prediction: ``(inputs (n, seq_len), targets (n, seq_len))``.

    Each sequence counts in steps of a hidden stride modulo ``vocab``
    (``x[t+1] = x[t] + stride``), so a model must infer the stride from the
    context: learnable, but not from one token alone.
    """
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (n, 1), generator=g)
    stride = torch.randint(1, 8, (n, 1), generator=g)
    seq = (start + stride * torch.arange(seq_len + 1)) % vocab
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


class AugmentedDataset(Dataset):
    """A dataset whose every sample is padded, randomly cropped and flipped in Python: a CPU-bound loader (chapter 02).

    Real pipelines decode and augment each image on the CPU; this costs about
    as much per sample, so the data loader, not the model, can be the bottleneck.
    """

    def __init__(self, base: TensorDataset, pad: int = 4, rounds: int = 4):
        self.images, self.labels = base.tensors
        self.pad, self.rounds = pad, rounds

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        img = self.images[i]
        size = img.shape[-1]
        for _ in range(self.rounds):  # several passes stand in for decoding and heavier augmentation
            padded = torch.nn.functional.pad(img, (self.pad,) * 4, mode="reflect")
            dx, dy = torch.randint(0, 2 * self.pad + 1, (2,)).tolist()
            img = padded[:, dy:dy + size, dx:dx + size]
            if torch.rand(()) < 0.5:
                img = img.flip(-1)
        return img.contiguous(), self.labels[i]


def make_loader(dataset: Dataset, batch_size: int, shuffle: bool = True, seed: int = 0, num_workers: int = 0,
                pin_memory: bool = False, drop_last: bool = True) -> DataLoader:
    """A ``DataLoader`` whose shuffling order depends only on ``seed``."""
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, num_workers=num_workers,
                      pin_memory=pin_memory, drop_last=drop_last, generator=torch.Generator().manual_seed(seed))


def checksum(*tensors: torch.Tensor) -> str:
    """Short SHA-256 of the tensors' bytes: the same data gives the same checksum."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]
