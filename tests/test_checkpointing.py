"""course_lib.checkpointing: segment plans, the checkpointed forward, selective checkpointing (chapter 05)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint_sequential

from course_lib import memory
from course_lib.checkpointing import (ATTENTION_OPS, LINEAR_OPS, Checkpointed, best_segments, chain,
                                      checkpoint_blocks, checkpointed_sequential, chen_peak_units,
                                      count_forward_calls, fastest_times, fit_parabola, longest_fitting,
                                      predict_longest, recomputed_blocks, save_ops_policy, segment_plan)
from course_lib.models import TinyTransformer, lm_loss


def _grads(model: nn.Module, params: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    params.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    return [p.grad.clone() for p in params.parameters()]


# ----- the arithmetic ------------------------------------------------------------------


@pytest.mark.parametrize("n,k", [(16, 4), (16, 5), (16, 7), (16, 1), (16, 16), (7, 3), (1, 1)])
def test_segment_plan_covers_the_blocks_in_balanced_order(n, k):
    plan = segment_plan(n, k)
    assert len(plan) == k
    assert [i for span in plan for i in span] == list(range(n))
    sizes = [len(span) for span in plan]
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # longer segments first


@pytest.mark.parametrize("k", [0, -1, 17])
def test_segments_outside_one_to_n_are_rejected(k):
    with pytest.raises(ValueError, match="between 1 and"):
        segment_plan(16, k)
    with pytest.raises(ValueError, match="between 1 and"):
        checkpointed_sequential(chain(16, 4), k)


def test_checkpointed_sequential_wants_a_sequential():
    with pytest.raises(ValueError, match="nn.Sequential"):
        checkpointed_sequential(nn.Linear(3, 3), 1)  # type: ignore[arg-type]


@pytest.mark.parametrize("n,expected", [(1, 1), (2, 1), (4, 2), (9, 3), (16, 4), (25, 5), (8, 3), (100, 10)])
def test_best_segments_is_next_to_sqrt_n(n, expected):
    assert best_segments(n) == expected
    assert abs(best_segments(n) - math.sqrt(n)) < 1
    with pytest.raises(ValueError):
        best_segments(0)


def test_chen_formula_and_recomputed_blocks():
    assert chen_peak_units(16, 4) == 8
    assert chen_peak_units(16, 1) == chen_peak_units(16, 16) == 17
    assert recomputed_blocks(16, 1) == 0  # one segment: nothing is checkpointed
    assert recomputed_blocks(16, 4) == 12
    assert recomputed_blocks(16, 16) == 15
    with pytest.raises(ValueError):
        chen_peak_units(4, 5)


# ----- the checkpointed forward ------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 3, 4, 16])
def test_checkpointed_sequential_gives_the_same_output_and_gradients(k):
    torch.manual_seed(0)
    blocks = chain(16, 8)
    x = torch.randn(32, 8, requires_grad=True)
    plain = _grads(blocks, blocks, x)
    ckpt = checkpointed_sequential(blocks, k)
    assert torch.equal(ckpt(x), blocks(x))
    for a, b in zip(_grads(ckpt, blocks, x), plain):
        assert torch.equal(a, b)
    assert list(ckpt.parameters()) == list(blocks.parameters())  # same modules, not copies


def test_checkpointed_sequential_agrees_with_torch_checkpoint_sequential():
    torch.manual_seed(0)
    blocks = chain(16, 8)
    x = torch.randn(32, 8)
    ours = _grads(checkpointed_sequential(blocks, 4), blocks, x)
    theirs = _grads(lambda h: checkpoint_sequential(blocks, 4, h, use_reentrant=False), blocks, x)
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("k", [1, 2, 4, 5, 16])
def test_one_extra_forward_per_checkpointed_block(k):
    blocks = chain(16, 8)
    model = checkpointed_sequential(blocks, k)
    x = torch.randn(4, 8)
    with count_forward_calls(blocks) as calls:
        model(x).sum().backward()
    assert sum(calls.values()) == 16 + recomputed_blocks(16, k)
    assert max(calls.values()) <= 2
    last = segment_plan(16, k)[-1]
    assert all(calls[i] == 1 for i in last)  # the last segment is never recomputed


def test_no_checkpointing_without_grad():
    blocks = chain(8, 4)
    with count_forward_calls(blocks) as calls, torch.no_grad():
        checkpointed_sequential(blocks, 4)(torch.randn(2, 4))
    assert sum(calls.values()) == 8


def test_count_forward_calls_removes_its_hooks():
    blocks = chain(3, 4)
    with count_forward_calls(blocks) as calls:
        blocks(torch.randn(2, 4))
    blocks(torch.randn(2, 4))
    assert sum(calls.values()) == 3


def test_dropout_masks_are_replayed():
    torch.manual_seed(0)
    blocks = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Dropout(0.5)) for _ in range(8)])
    x = torch.randn(16, 8)
    torch.manual_seed(1)
    plain = _grads(blocks, blocks, x)
    torch.manual_seed(1)
    ckpt = _grads(checkpointed_sequential(blocks, 3), blocks, x)
    for a, b in zip(ckpt, plain):
        assert torch.equal(a, b)


def test_peak_memory_of_a_chain_follows_n_over_k_plus_k():
    torch.manual_seed(0)
    n, batch, width = 16, 1024, 32
    blocks = chain(n, width)
    x = torch.randn(batch, width)
    unit = batch * width * 4

    def peak(model: nn.Module) -> float:
        blocks.zero_grad(set_to_none=True)
        return memory.peak_bytes(lambda: model(x).sum().backward(), "cpu") / unit

    peak(blocks)  # warm-up
    plain, best = peak(blocks), peak(checkpointed_sequential(blocks, 4))
    assert abs(plain - 17) < 1  # 16 block outputs + one gradient in flight
    assert abs(best - 8) < 1
    assert best / plain < 0.6


# ----- selective checkpointing --------------------------------------------------------------


def test_save_ops_policy():
    policy = save_ops_policy(LINEAR_OPS)
    assert policy(None, torch.ops.aten.addmm.default) == CheckpointPolicy.MUST_SAVE
    assert policy(None, torch.ops.aten.bmm.default) == CheckpointPolicy.PREFER_RECOMPUTE
    assert policy(None, torch.ops.aten.gelu.default) == CheckpointPolicy.PREFER_RECOMPUTE
    assert not LINEAR_OPS & ATTENTION_OPS


def _tiny_lm(mode: str) -> TinyTransformer:
    torch.manual_seed(0)
    model = TinyTransformer(vocab=32, d_model=32, n_heads=2, n_layers=3, max_len=64)
    model.blocks = checkpoint_blocks(model.blocks, mode)
    return model


def test_checkpoint_blocks_modes_keep_gradients_and_order_memory():
    idx = torch.randint(0, 32, (2, 64))
    tgt = torch.randint(0, 32, (2, 64))
    grads, peaks, kept = {}, {}, {}
    for mode in ("none", "full", "selective"):
        model = _tiny_lm(mode)
        step = lambda: lm_loss(model(idx), tgt).backward()  # noqa: E731
        step()
        grads[mode] = torch.cat([p.grad.flatten() for p in model.parameters()])
        kept[mode] = memory.saved_activation_bytes(lambda: lm_loss(model(idx), tgt), exclude=model.parameters())
        model.zero_grad(set_to_none=True)
        peaks[mode] = memory.peak_bytes(step, "cpu")
    assert torch.equal(grads["full"], grads["none"])
    assert torch.equal(grads["selective"], grads["none"])
    assert peaks["full"] < peaks["selective"] < peaks["none"]
    assert kept["full"] < kept["selective"] < kept["none"]


def test_checkpoint_blocks_rejects_unknown_modes_and_wraps_each_block():
    blocks = _tiny_lm("none").blocks
    with pytest.raises(ValueError, match="unknown checkpoint mode"):
        checkpoint_blocks(blocks, "some")
    wrapped = checkpoint_blocks(blocks, "selective")
    assert all(isinstance(b, Checkpointed) and b.policy is not None for b in wrapped)
    assert all(isinstance(b, Checkpointed) and b.policy is None for b in checkpoint_blocks(blocks, "full"))


def test_fastest_times():
    calls = []
    times = fastest_times({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, repeats=3)
    assert calls == ["a", "b"] * 4  # a warm-up, then three rounds in turns
    assert set(times) == {"a", "b"} and all(t >= 0 for t in times.values())
    with pytest.raises(ValueError):
        fastest_times({"a": lambda: None}, repeats=0)


def test_fastest_times_with_another_clock():
    ticks = iter(range(100))
    times = fastest_times({"a": lambda: None}, repeats=2, clock=lambda: next(ticks) * 0.5)
    assert times == {"a": 0.5}  # each run reads the clock twice, one tick apart


def test_fastest_times_on_a_given_number_of_threads():
    before = torch.get_num_threads()
    seen = []
    fastest_times({"a": lambda: seen.append(torch.get_num_threads())}, repeats=2, threads=1)
    assert seen == [1, 1, 1] and torch.get_num_threads() == before  # restored afterwards


# ----- the longest sequence that fits --------------------------------------------------


def test_fit_parabola_and_predict_longest():
    peak = lambda t: 1000 + 30 * t + 0.5 * t * t  # noqa: E731
    assert fit_parabola([10, 20, 40], [peak(10), peak(20), peak(40)]) == pytest.approx((1000, 30, 0.5))
    budget = peak(300) + 1  # the parabola reaches the budget just past T = 300
    assert predict_longest([10, 20, 40], [peak(10), peak(20), peak(40)], budget) == 300
    assert predict_longest([10, 20, 40], [peak(10), peak(20), peak(40)], budget, step=16) == 288
    line = lambda t: 100 + 4 * t  # noqa: E731
    assert predict_longest([1, 2, 3], [line(1), line(2), line(3)], line(50)) == 50
    assert predict_longest([10, 20, 40], [peak(10), peak(20), peak(40)], 999) == 0  # not even T = 0 fits
    with pytest.raises(ValueError, match="three different lengths"):
        predict_longest([10, 10, 20], [1, 2, 3], 100)
    with pytest.raises(ValueError, match="do not grow"):
        predict_longest([1, 2, 3], [5, 5, 5], 100)


@pytest.mark.parametrize("guess", [0, 16, 500, 992, 1008, 3000, 9999])
def test_longest_fitting_searches_from_the_guess(guess):
    calls = []

    def fits(t: int) -> bool:
        calls.append(t)
        return t <= 1000

    length, tried = longest_fitting(fits, guess, step=16, limit=4096)
    assert length == 992 and tried == calls and len(set(calls)) == len(calls)
    assert 992 in tried and 1008 in tried  # the boundary itself was measured
    assert all(t % 16 == 0 and 16 <= t <= 4096 for t in tried)
    if guess == 992:
        assert tried == [992, 1008]  # a right guess costs two calls
    assert len(tried) <= 2 * math.ceil(math.log2(4096 / 16)) + 2


def test_longest_fitting_at_the_ends():
    assert longest_fitting(lambda t: True, 64, step=16, limit=200)[0] == 192  # everything up to the limit fits
    assert longest_fitting(lambda t: False, 64, step=16, limit=200)[0] == 0  # nothing fits
    with pytest.raises(ValueError):
        longest_fitting(lambda t: True, 64, step=16, limit=8)


def test_chain_rejects_bad_sizes():
    with pytest.raises(ValueError):
        chain(0, 4)
