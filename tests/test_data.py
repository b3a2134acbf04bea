"""Tests of course_lib.data: the offline shapes set, CIFAR-10's offline error, tokens, loaders, checksums."""

from __future__ import annotations

import hashlib
import io
import tarfile
import urllib.request

import pytest
import torch

from course_lib import data
from course_lib.data import SHAPE_CLASSES, checksum, load_dataset, make_loader, make_shapes, make_tokens


@pytest.fixture(scope="module")
def shapes() -> tuple[torch.Tensor, torch.Tensor]:
    return make_shapes(2000, seed=0)


def test_shapes_format(shapes) -> None:
    images, labels = shapes
    assert images.shape == (2000, 3, 32, 32) and images.dtype == torch.float32
    assert labels.shape == (2000,) and labels.dtype == torch.int64
    assert images.min() >= 0 and images.max() <= 1
    assert set(labels.tolist()) == set(range(len(SHAPE_CLASSES))) and len(SHAPE_CLASSES) == 10


def test_shapes_other_size() -> None:
    images, _ = make_shapes(5, seed=0, size=16)
    assert images.shape == (5, 3, 16, 16)


def test_shapes_are_deterministic(shapes) -> None:
    again = make_shapes(2000, seed=0)
    assert torch.equal(shapes[0], again[0]) and torch.equal(shapes[1], again[1])
    assert checksum(*shapes) == checksum(*again)


def test_seeds_differ(shapes) -> None:
    other = make_shapes(2000, seed=1)
    assert not torch.equal(shapes[0], other[0])
    assert checksum(*shapes) != checksum(*other)


def test_classes_are_balanced(shapes) -> None:
    counts = torch.bincount(shapes[1], minlength=10).float()
    # 200 expected per class; a binomial standard deviation is about 13, so +-25% is over 3.5 sigma
    assert counts.min() > 150 and counts.max() < 250, counts.tolist()


def test_each_image_shows_a_shape(shapes) -> None:
    """The shape covers a fair part of every image and differs in colour from the background."""
    images, _ = shapes
    centre = images[:, :, 12:20, 12:20].mean(dim=(2, 3))   # inside the shape for nearly every draw
    corner = images[:, :, :3, :3].mean(dim=(2, 3))         # background (shapes stay clear of the corners)
    contrast = (centre - corner).norm(dim=1)
    assert (contrast > 0.15).float().mean() > 0.8, "most images should have a visible shape in the centre"


def test_labels_are_stable_across_machines(shapes) -> None:
    """Labels come from torch.randint on a seeded CPU generator: bit-identical everywhere.

    (The image pixels go through sin/cos/sqrt, whose last bits can differ between CPUs, so
    data/README.md records their checksum for this machine only.)
    """
    labels = shapes[1]
    assert labels[:10].tolist() == make_shapes(10, seed=0)[1].tolist(), "the first labels must not depend on n"
    assert labels[:16].tolist() == [4, 9, 3, 0, 3, 9, 7, 3, 7, 3, 1, 6, 6, 9, 8, 6], "the labels' draw has changed"


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="n must be positive"):
        make_shapes(0)
    with pytest.raises(ValueError, match="size"):
        make_shapes(4, size=4)


def test_train_and_test_are_disjoint() -> None:
    train = load_dataset("shapes", "train", n=300, seed=0)
    test = load_dataset("shapes", "test", n=300, seed=0)
    x_train, x_test = train.tensors[0], test.tensors[0]
    assert x_train.shape == (300, 3, 32, 32)
    # no test image equals any training image
    dist = torch.cdist(x_test.flatten(1), x_train.flatten(1))
    assert dist.min() > 1.0
    # split seeds never collide: train of seed s+1 is not test of seed s
    assert not torch.equal(load_dataset("shapes", "train", n=50, seed=1).tensors[0],
                           load_dataset("shapes", "test", n=50, seed=0).tensors[0])


def test_default_sizes_and_normalisation() -> None:
    train = load_dataset("shapes")
    assert len(train) == 8000 and len(load_dataset("shapes", "test")) == 2000
    x = train.tensors[0]
    mean, std = x.mean(dim=(0, 2, 3)), x.std(dim=(0, 2, 3))
    assert mean.abs().max() < 0.5 and (std - 1).abs().max() < 0.5, (mean, std)


def test_unknown_dataset_and_split() -> None:
    with pytest.raises(ValueError, match="unknown dataset 'mnist'"):
        load_dataset("mnist")
    with pytest.raises(ValueError, match="split"):
        load_dataset("shapes", "validation")


def test_missing_cifar_says_what_to_run(tmp_path) -> None:
    assert not data.cifar10_available(tmp_path)
    with pytest.raises(FileNotFoundError) as err:
        load_dataset("cifar10", root=tmp_path)
    assert "course download cifar10" in str(err.value) and str(tmp_path) in str(err.value)


class _Response(io.BytesIO):
    """What urlopen returns, for an archive of ``body``; ``fail_after`` bytes raise a dropped connection."""

    def __init__(self, body: bytes, fail_after: int | None = None) -> None:
        super().__init__(body)
        self.headers, self.fail_after = {"Content-Length": str(len(body))}, fail_after

    def read(self, size: int = -1) -> bytes:
        if self.fail_after is not None and self.tell() >= self.fail_after:
            raise ConnectionResetError(104, "Connection reset by peer")
        return super().read(size)


def _cifar_archive() -> bytes:
    """A gzipped tar shaped like CIFAR-10's: the folder with a (tiny) first batch."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        info = tarfile.TarInfo(f"{data.CIFAR10_FOLDER}/data_batch_1")
        info.size = 4
        tar.addfile(info, io.BytesIO(b"data"))
    return buffer.getvalue()


def test_download_cifar10_renames_only_a_complete_archive(tmp_path, monkeypatch) -> None:
    body = _cifar_archive()
    monkeypatch.setattr(data, "CIFAR10_MD5", hashlib.md5(body).hexdigest())
    # the connection drops half way: no archive, no folder, no temporary file is left
    monkeypatch.setattr(urllib.request, "urlopen", lambda url, timeout: _Response(body + bytes(2 << 20), 1 << 20))
    with pytest.raises(ConnectionError, match="broke off after 1 MiB: .*Connection reset by peer"):
        data.download_cifar10(tmp_path)
    assert list(tmp_path.iterdir()) == []
    # damaged bytes: refused by their MD5, nothing left either
    monkeypatch.setattr(urllib.request, "urlopen", lambda url, timeout: _Response(body[:-1] + b"x"))
    with pytest.raises(ValueError, match="damaged .* run `course download cifar10` again"):
        data.download_cifar10(tmp_path)
    assert list(tmp_path.iterdir()) == []
    # complete: the folder, and only the folder
    monkeypatch.setattr(urllib.request, "urlopen", lambda url, timeout: _Response(body))
    assert data.download_cifar10(tmp_path) == tmp_path / data.CIFAR10_FOLDER
    assert [p.name for p in tmp_path.iterdir()] == [data.CIFAR10_FOLDER] and data.cifar10_available(tmp_path)


def test_tokens_follow_a_hidden_stride() -> None:
    inputs, targets = make_tokens(32, 16, vocab=64, seed=0)
    assert inputs.shape == targets.shape == (32, 16) and inputs.dtype == torch.int64
    assert inputs.min() >= 0 and inputs.max() < 64
    assert torch.equal(inputs[:, 1:], targets[:, :-1]), "targets are the inputs shifted by one"
    stride = (targets - inputs) % 64
    assert (stride == stride[:, :1]).all(), "each sequence keeps one stride"
    assert ((stride >= 1) & (stride < 8)).all()
    assert torch.equal(make_tokens(32, 16, seed=0)[0], inputs)
    assert not torch.equal(make_tokens(32, 16, seed=1)[0], inputs)


def _order(loader) -> list[int]:
    return torch.cat([y for _, y in loader]).tolist()


def test_loader_order_depends_only_on_seed() -> None:
    ds = torch.utils.data.TensorDataset(torch.zeros(40, 1), torch.arange(40))
    a, b, c = (_order(make_loader(ds, 8, seed=s)) for s in (3, 3, 4))
    assert a == b and a != c
    assert sorted(a) == list(range(40))
    assert _order(make_loader(ds, 8, shuffle=False)) == list(range(40))
    assert len(make_loader(ds, 16)) == 2 and len(make_loader(ds, 16, drop_last=False)) == 3
    with pytest.raises(ValueError, match="batch_size"):
        make_loader(ds, 0)
