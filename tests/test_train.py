"""Unit tests of course_lib.train: exact gradient accumulation, the fit loop, checkpoints."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from course_lib.data import make_loader
from course_lib.models import MLP
from course_lib.train import accumulate, fit, load_model_state, save_checkpoint, History

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
    assert hist_big.loss[-1] < hist_big.loss[0], "the model should learn something in 8 steps"
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


def test_fit_under_bf16_autocast_runs() -> None:
    model = _mlp()
    hist = fit(model, make_loader(_dataset(32), 8), torch.optim.SGD(model.parameters(), lr=0.1),
               autocast_dtype=torch.bfloat16, progress=False)
    assert len(hist.loss) == 4 and all(torch.isfinite(torch.tensor(hist.loss)))


def _dropout_net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 5))


def _run(tmp_path, resume_after: int | None) -> tuple[History, nn.Module]:
    """Two epochs of 8 steps with dropout, shuffling and a scheduler; optionally interrupted and resumed."""
    ds = _dataset(64)
    ckpt = tmp_path / "run.pt"

    def parts(seed: int):
        model = _dropout_net(seed)
        opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return model, opt, sched, make_loader(ds, 8, seed=11)

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


@pytest.mark.parametrize("resume_after", [5, 8, 11])  # mid-epoch, at an epoch boundary, in the second epoch
def test_resume_gives_the_uninterrupted_run(tmp_path, resume_after: int) -> None:
    ref_hist, ref_model = _run(tmp_path / "ref", None)
    hist, model = _run(tmp_path / "resumed", resume_after)
    assert hist.step == ref_hist.step
    assert hist.loss == pytest.approx(ref_hist.loss, abs=1e-7)
    assert hist.eval_step == ref_hist.eval_step == [8, 16]
    assert hist.eval_loss == pytest.approx(ref_hist.eval_loss, abs=1e-7)
    assert _max_diff(list(model.parameters()), list(ref_model.parameters())) < 1e-7


def test_checkpoint_from_another_model_names_the_keys(tmp_path) -> None:
    small = MLP(in_features=12, hidden=(8,), num_classes=5)
    opt = torch.optim.SGD(small.parameters(), lr=0.1)
    path = tmp_path / "small.pt"
    save_checkpoint(path, small, opt, None, {"step": 0, "epoch": 0, "batches": 0}, History(), None)
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
