"""Chapter 12's mixture-of-experts MLP in one process: capacity, dispatch, routing, the auxiliary loss."""

from __future__ import annotations

import pytest
import torch

from course_lib.experiments.moe_runs import balance_run
from course_lib.moe import (MoEMLP, dispatch_indices, expert_capacity, load_balancing_loss,
                            no_drop_factor, route)


def test_capacity_formula_and_bad_input() -> None:
    assert expert_capacity(64, 8, 1.0) == 8
    assert expert_capacity(64, 8, 1.25) == 10
    assert expert_capacity(64, 8, 1.0, k=2) == 16
    assert expert_capacity(10, 4, 1.0) == 3  # ceil(2.5)
    assert expert_capacity(64, 8, no_drop_factor(8, 2), k=2) == 64
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match="capacity_factor must be > 0"):
            expert_capacity(64, 8, bad)
    with pytest.raises(ValueError, match="9 experts for 8 tokens"):
        expert_capacity(8, 9, 1.0)
    with pytest.raises(ValueError, match="capacity_factor"):
        MoEMLP(8, 16, 4, capacity_factor=0.0)
    with pytest.raises(ValueError, match="k must be"):
        MoEMLP(8, 16, 4, k=5)
    with pytest.raises(ValueError, match="experts for 3 tokens"):
        MoEMLP(8, 16, 4)(torch.randn(3, 8))


def test_dispatch_indices_by_hand() -> None:
    # 5 tokens, top-1 over 3 experts, capacity 2: expert 0 gets tokens 0, 2, 4 (token 4 dropped)
    expert = torch.tensor([[0], [1], [0], [2], [0]])
    order, position, kept = dispatch_indices(expert, 3, 2)
    assert order.tolist() == [0, 2, 4, 1, 3]
    assert position.tolist() == [0, 0, 1, 0, 2]
    assert kept.tolist() == [True, True, True, True, False]
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        dispatch_indices(torch.tensor([[3]]), 3, 1)


def test_second_choices_queue_behind_first_choices() -> None:
    # top-2, 3 tokens: choice a = slot * 3 + token. Expert 1 is token 0's *second* choice but tokens 1
    # and 2's first: at capacity 2 token 0's second choice is the one dropped, though token 0 comes first.
    expert = torch.tensor([[0, 1], [1, 2], [1, 0]])
    order, position, kept = dispatch_indices(expert, 3, 2)
    assert order.tolist() == [0, 5, 1, 2, 3, 4]  # expert 0: a=0, 5; expert 1: a=1, 2, 3; expert 2: a=4
    assert position.tolist() == [0, 0, 1, 2, 0, 1]
    assert kept.tolist() == [True, True, True, False, True, True]


def test_routing_gates() -> None:
    logits = torch.randn(32, 4, dtype=torch.float64)
    r1, r2 = route(logits, 1, 1.0), route(logits, 2, 1.0)
    assert torch.equal(r1.gate[:, 0], logits.softmax(-1).max(-1).values)
    assert torch.allclose(r2.gate.sum(-1), torch.ones(32, dtype=torch.float64))
    assert torch.equal(r2.expert[:, 0], logits.argmax(-1))
    assert r1.tokens_per_expert().sum() == 32 and r2.tokens_per_expert().sum() == 64
    assert r1.capacity == 8 and r2.capacity == 16


def naive_moe(moe: MoEMLP, x: torch.Tensor) -> torch.Tensor:
    """Token by token: the gated sum of its chosen experts, skipping the choices the routing dropped."""
    r = moe.routing
    n = x.shape[0]
    out = torch.zeros_like(x)
    for t in range(n):
        for s in range(moe.k):
            if r.kept[s * n + t]:
                out[t] += r.gate[t, s] * moe.experts[int(r.expert[t, s])](x[t])
    return out


@pytest.mark.parametrize("k, capacity_factor", [(1, 1.0), (1, 8.0), (2, 1.0), (2, 4.0)])
def test_moe_equals_token_by_token(k: int, capacity_factor: float) -> None:
    torch.manual_seed(0)
    moe = MoEMLP(6, 12, 8, k, capacity_factor).double()
    x = torch.randn(40, 6, dtype=torch.float64)
    out = moe(x)
    assert torch.allclose(out, naive_moe(moe, x), atol=1e-13, rtol=0)
    dropped = moe.routing.drop_rate()
    if capacity_factor == no_drop_factor(8, k):
        assert dropped == 0.0
    else:
        assert dropped > 0, "at capacity factor 1 some expert overflows (40 tokens, 8 untrained experts)"
        # a token whose every choice was dropped gets exactly zero: only the residual carries it
        n = x.shape[0]
        lost = [t for t in range(n) if not any(moe.routing.kept[s * n + t] for s in range(k))]
        if lost:
            assert out[lost].abs().max() == 0


def test_moe_keeps_the_input_shape_and_backpropagates() -> None:
    torch.manual_seed(0)
    moe = MoEMLP(8, 16, 4, k=2)
    x = torch.randn(2, 10, 8, requires_grad=True)
    out = moe(x)
    assert out.shape == x.shape
    (out.square().sum() + moe.aux_loss).backward()
    assert x.grad.abs().sum() > 0 and moe.router.weight.grad.abs().sum() > 0


def test_load_balancing_loss() -> None:
    e = 4
    even = torch.full((8, e), 1 / e)
    assert load_balancing_loss(even, torch.arange(8) % e).item() == pytest.approx(1.0)
    collapsed = torch.zeros(8, e)
    collapsed[:, 0] = 1.0
    assert load_balancing_loss(collapsed, torch.zeros(8, dtype=torch.long)).item() == pytest.approx(e)
    # the gradient pushes probability away from the over-loaded expert (through P only)
    logits = torch.zeros(8, e, requires_grad=True)
    load_balancing_loss(logits.softmax(-1), torch.zeros(8, dtype=torch.long)).backward()
    assert (logits.grad[:, 0] > 0).all() and (logits.grad[:, 1:] < 0).all()


@pytest.fixture
def one_thread():
    """Tiny matrices: a second thread costs more than it saves (and on a busy machine, much more)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_auxiliary_loss_balances_the_experts(one_thread) -> None:
    kw = dict(n_tokens=256, steps=40, n_experts=8, k=1)
    a = balance_run(0, 0.0, **kw)
    assert a == balance_run(0, 0.0, **kw), "a seed gives the same numbers"
    for seed in (0, 1):
        free, balanced = balance_run(seed, 0.0, **kw), balance_run(seed, 0.1, **kw)
        assert balanced["imbalance"][-1] < free["imbalance"][-1] - 0.3, (seed, free["imbalance"][-1],
                                                                          balanced["imbalance"][-1])
        assert balanced["drop_rate"] < free["drop_rate"]
        assert sum(balanced["tokens_per_expert"]) == 256


def test_moe_trains_under_bf16_autocast() -> None:
    # the experts' bf16 outputs are summed in the tokens' dtype (index_add takes one dtype)
    torch.manual_seed(0)
    layer = MoEMLP(8, 16, 4, k=2)
    x = torch.randn(32, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
    assert out.dtype == torch.float32
    (out.pow(2).mean() + layer.aux_loss).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in layer.experts.parameters())
