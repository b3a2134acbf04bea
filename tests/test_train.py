"""Unit tests of course_lib.train: exact gradient accumulation, the fit loop, checkpoints."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from course_lib.data import make_loader
from course_lib.models import MLP
from course_lib.resume import StepOrder, epoch_order, load_model_state, save_checkpoint
from course_lib.train import History, accumulate, fit

TOL = 1e-6  # float32 sums taken in a different order agree to about 1e-7 here


def _mlp(seed: int = 0) -> MLP:
    torch.manual_seed(seed)
    return MLP(in_features=12, hidden=(16, 16), num_classes=5)


def _batch(n: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 12, generator=g), torch.randint(0, 5, (n,), generator=g)


def _full_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters()]


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((u - v).abs().max().item() for u, v in zip(a, b))


@pytest.mark.parametrize("n, k", [(12, 1), (12, 3), (12, 12), (10, 3), (7, 4)])
def test_accumulate_gives_the_full_batch_gradient(n: int, k: int) -> None:
    model = _mlp()
    x, y = _batch(n)
    full_loss, full = _full_grads(model, x, y)
    model.zero_grad(set_to_none=True)
    loss = accumulate(model, F.cross_entropy, x, y, k)
    acc = [p.grad.clone() for p in model.parameters()]
    assert _max_diff(full, acc) < TOL, f"{k} micro-batches of {n} samples do not give the full-batch gradient"
    assert loss == pytest.approx(full_loss, abs=TOL), "accumulate should return the full batch's mean loss"


def test_uneven_split_needs_size_weights() -> None:
    """10 samples in 3 pieces (4, 3, 3): weighting each piece by 1/3 instead of n_i/N is measurably wrong."""
    model = _mlp()
    x, y = _batch(10)
    _, full = _full_grads(model, x, y)
    model.zero_grad(set_to_none=True)
    for xs, ys in zip(x.tensor_split(3), y.tensor_split(3)):
        (F.cross_entropy(model(xs), ys) / 3).backward()
    naive = [p.grad.clone() for p in model.parameters()]
    assert _max_diff(full, naive) > 100 * TOL, "the naive 1/k weighting should be visibly off for an uneven split"


def test_accumulate_adds_onto_existing_grads() -> None:
    model = _mlp()
    x, y = _batch(8)
    _, full = _full_grads(model, x, y)
    accumulate(model, F.cross_entropy, x, y, 2)  # not zeroed: adds a second copy
    twice = [p.grad for p in model.parameters()]
    assert _max_diff([2 * g for g in full], twice) < 2 * TOL


@pytest.mark.parametrize("k", [0, -1, 11])
def test_accumulate_rejects_impossible_splits(k: int) -> None:
    model = _mlp()
    x, y = _batch(10)
    with pytest.raises(ValueError, match="micro-batches"):
        accumulate(model, F.cross_entropy, x, y, k)


def _dataset(n: int = 64) -> TensorDataset:
    return TensorDataset(*_batch(n, seed=3))


def test_fit_with_accumulation_equals_big_batch_training() -> None:
    """Batch 16 versus micro-batch 4 with 4 accumulation steps: the same losses and weights, step by step."""
    ds = _dataset(64)
    big, small = _mlp(), _mlp()
    hist_big = fit(big, make_loader(ds, 16, seed=5), torch.optim.SGD(big.parameters(), lr=0.5, momentum=0.9),
                   epochs=2, progress=False)
    hist_small = fit(small, make_loader(ds, 4, seed=5), torch.optim.SGD(small.parameters(), lr=0.5, momentum=0.9),
                     epochs=2, accumulation_steps=4, progress=False)
    assert len(hist_big.loss) == len(hist_small.loss) == 8
    assert max(abs(a - b) for a, b in zip(hist_big.loss, hist_small.loss)) < TOL
    assert sum(hist_big.loss[4:]) < sum(hist_big.loss[:4]), "the second epoch's loss should be lower than the first's"
    assert _max_diff(list(big.parameters()), list(small.parameters())) < 1e-5


def test_fit_uneven_last_group() -> None:
    """5 batches with accumulation 2: steps of 2, 2 and 1 micro-batches, each weighted by its samples."""
    ds = _dataset(40)
    model = _mlp()
    hist = fit(model, make_loader(ds, 8, shuffle=False), torch.optim.SGD(model.parameters(), lr=0.1),
               accumulation_steps=2, progress=False)
    assert len(hist.step) == 3
    assert hist.samples_per_s and all(s > 0 for s in hist.samples_per_s)


def test_fit_rejects_bad_accumulation_steps() -> None:
    model = _mlp()
    with pytest.raises(ValueError, match="accumulation_steps"):
        fit(model, make_loader(_dataset(16), 4), torch.optim.SGD(model.parameters(), lr=0.1),
            accumulation_steps=0, progress=False)


def test_bf16_fit_learns_like_fp32_and_keeps_fp32_weights() -> None:
    """One seeded run in fp32 and under bf16 autocast, on labels a linear map of the inputs decides (learnable):
    the losses agree to bf16's precision at every step and fall alike; weights and gradients stay fp32."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(128, 12, generator=g)
    ds = TensorDataset(x, (x @ torch.randn(12, 5, generator=g)).argmax(-1))
    runs = {}
    for dtype in (None, torch.bfloat16):
        model = _mlp()
        hist = fit(model, make_loader(ds, 16, seed=2), torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                   epochs=3, autocast_dtype=dtype, progress=False)
        runs[dtype] = (hist.loss, model)
    (loss32, model32), (loss16, model16) = runs[None], runs[torch.bfloat16]
    assert loss16 != loss32, "the bf16 run gave fp32's numbers: autocast did not run"
    # measured: at most 0.0016 apart (0.1% of the loss; bf16's epsilon is 2^-8 = 0.4% per rounding)
    assert max(abs(a - b) for a, b in zip(loss16, loss32)) < 0.01 * loss32[0]
    assert loss32[-1] < 0.8 * loss32[0] and loss16[-1] < 0.8 * loss16[0], "both runs should learn in 24 steps"
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model16.parameters())
    assert _max_diff(list(model16.parameters()), list(model32.parameters())) < 0.05


def test_fit_reads_the_loss_once_per_step(monkeypatch) -> None:
    """No .item() per micro-batch: 2 steps of 4 micro-batches read a loss from the device twice, not 8 times."""
    reads = []

    def counting(read):
        def wrapper(t):
            if t.is_floating_point():  # values, not the integer sample indices the loop slices on the CPU
                reads.append(read.__name__)
            return read(t)
        return wrapper

    for name in ("item", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, counting(getattr(torch.Tensor, name)))
    model = _mlp()
    fit(model, make_loader(_dataset(32), 4), torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=4,
        max_steps=2, progress=False)
    assert len(reads) == 2, f"fit read values from the device {len(reads)} times in 2 steps: {reads}"


class _SlowDataset(Dataset):
    """Each sample takes at least ``delay`` seconds to load, as a decoding pipeline would."""

    def __init__(self, base: TensorDataset, delay: float):
        self.base, self.delay = base, delay

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int):
        time.sleep(self.delay)
        return self.base[i]


def test_samples_per_s_includes_waiting_for_the_loader() -> None:
    delay = 0.004  # per sample: the loader alone cannot deliver more than 1 / delay = 250 samples/s
    model = _mlp()
    hist = fit(model, make_loader(_SlowDataset(_dataset(32), delay), 8), torch.optim.SGD(model.parameters(), lr=0.1),
               progress=False)
    assert len(hist.samples_per_s) == 4 and max(hist.samples_per_s) < 1 / delay


class _Recording(Dataset):
    """A dataset that notes which samples are read."""

    def __init__(self, base: TensorDataset):
        self.base, self.read = base, []

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int):
        self.read.append(i)
        return self.base[i]


def test_the_batch_of_a_step_is_a_function_of_seed_and_step(tmp_path) -> None:
    """Each epoch is the permutation seeded by (seed, epoch); a resumed run reads only the steps it still has to do."""
    ds = _Recording(_dataset(40))
    model = _mlp()
    fit(model, make_loader(ds, 4, seed=7), torch.optim.SGD(model.parameters(), lr=0.1), epochs=2,
        accumulation_steps=2, progress=False)  # 10 batches an epoch, 5 steps
    expected = [epoch_order(40, 7, e).tolist() for e in (0, 1)]
    assert ds.read == expected[0] + expected[1] and expected[0] != expected[1]
    assert sorted(expected[0]) == list(range(40))
    order = StepOrder(40, 4, 2, shuffle=True, drop_last=True, seed=7)
    assert order.batches(7) == [expected[1][16:20], expected[1][20:24]]  # step 7 = epoch 1's third step

    ds.read.clear()
    ckpt = tmp_path / "run.pt"
    fit(model, make_loader(ds, 4, seed=7), torch.optim.SGD(model.parameters(), lr=0.1), epochs=2,
        accumulation_steps=2, progress=False, checkpoint_path=ckpt, stop_after=7)
    ds.read.clear()
    fit(model, make_loader(ds, 4, seed=7), torch.optim.SGD(model.parameters(), lr=0.1), epochs=2,
        accumulation_steps=2, progress=False, checkpoint_path=ckpt, resume=True)
    assert ds.read == expected[1][16:], "a resumed run should read steps 7-9 only: no batch replayed or skipped"


def _dropout_net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 5))


def _run(tmp_path, resume_after: int | None, num_workers: int = 0) -> tuple[History, nn.Module]:
    """Two epochs of 8 steps with dropout, shuffling and a scheduler; optionally interrupted and resumed."""
    ds = _dataset(64)
    ckpt = tmp_path / "run.pt"

    def parts(seed: int):
        model = _dropout_net(seed)
        opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return model, opt, sched, make_loader(ds, 8, seed=11, num_workers=num_workers)

    evaluation = make_loader(_dataset(32), 16, shuffle=False)

    torch.manual_seed(123)  # the dropout masks come from the global generator
    model, opt, sched, loader = parts(0)
    if resume_after is None:
        return fit(model, loader, opt, scheduler=sched, epochs=2, progress=False, eval_loader=evaluation), model
    fit(model, loader, opt, scheduler=sched, epochs=2, progress=False, eval_loader=evaluation,
        checkpoint_path=ckpt, stop_after=resume_after)
    # A new process would start from other weights and another RNG state: resume must restore all of it.
    torch.manual_seed(999)
    model, opt, sched, loader = parts(1)
    hist = fit(model, loader, opt, scheduler=sched, epochs=2, progress=False, eval_loader=evaluation,
               checkpoint_path=ckpt, resume=True)
    return hist, model


@pytest.mark.parametrize("resume_after, num_workers", [(5, 0), (8, 0), (11, 0), (5, 2)])
def test_resume_gives_the_uninterrupted_run(tmp_path, resume_after: int, num_workers: int) -> None:
    """Interrupted mid-epoch, at an epoch boundary or in the second epoch, and with loader workers: bit-identical."""
    ref_hist, ref_model = _run(tmp_path / "ref", None)
    hist, model = _run(tmp_path / "resumed", resume_after, num_workers)
    assert hist.step == ref_hist.step
    assert hist.loss == ref_hist.loss
    assert hist.eval_step == ref_hist.eval_step == [8, 16]
    assert hist.eval_loss == ref_hist.eval_loss
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref_model.parameters()))


def test_resume_with_another_batch_size_is_refused(tmp_path) -> None:
    model = _mlp()
    ckpt = tmp_path / "run.pt"
    fit(model, make_loader(_dataset(32), 8), torch.optim.SGD(model.parameters(), lr=0.1), checkpoint_path=ckpt,
        stop_after=2, progress=False)
    with pytest.raises(ValueError, match="same dataset size, batch size"):
        fit(model, make_loader(_dataset(32), 4), torch.optim.SGD(model.parameters(), lr=0.1), checkpoint_path=ckpt,
            resume=True, progress=False)


def test_checkpoint_from_another_model_names_the_keys(tmp_path) -> None:
    small = MLP(in_features=12, hidden=(8,), num_classes=5)
    opt = torch.optim.SGD(small.parameters(), lr=0.1)
    path = tmp_path / "small.pt"
    save_checkpoint(path, small, opt, None, 0, History(), StepOrder(16, 4, 1, True, True, 0))
    bigger = MLP(in_features=12, hidden=(8, 8), num_classes=5)
    state = torch.load(path, weights_only=False)["model"]
    with pytest.raises(ValueError) as err:
        load_model_state(bigger, state)
    message = str(err.value)
    assert "missing keys" in message and "net.5.weight" in message  # the extra layer's head
    # and fit(resume=True) reports the same thing rather than a bare PyTorch error
    with pytest.raises(ValueError, match="different model"):
        fit(bigger, make_loader(_dataset(16), 4), torch.optim.SGD(bigger.parameters(), lr=0.1),
            checkpoint_path=path, resume=True, progress=False)
