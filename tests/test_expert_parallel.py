"""Chapter 11's expert parallelism: the formulas in one process, then launches on 2 and 4 gloo ranks.

Each launch checks the layer against the one-process ``MoEMLP`` in float64
(outputs and gradients), every byte count against the rows that crossed ranks,
and the parameters per rank against the formula.
"""

from __future__ import annotations

import pytest

from course_lib.distributed import launch
from course_lib.distributed.expert_parallel import (bytes_per_layer, dispatch_buffer_bytes, expert_dp_groups,
                                                    experts_per_rank, params_per_rank)
from course_lib.moe import MoEMLP, expert_capacity
from course_lib.workers.ep_results import EPReport

EXPERTS, D, H, TOKENS = 8, 8, 16, 16
ARGS = ["--experts", str(EXPERTS), "--d-model", str(D), "--hidden", str(H), "--tokens", str(TOKENS),
        "--pg-timeout", "60"]
FLOAT64 = 1e-12


def test_formulas_and_bad_input() -> None:
    assert experts_per_rank(8, 4) == 2
    for bad in (3, 0, 16):
        with pytest.raises(ValueError, match="cannot share 8 experts"):
            experts_per_rank(8, bad)
    assert expert_dp_groups(4, 2) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    assert expert_dp_groups(4, 4) == ([[0, 1, 2, 3]], [[0], [1], [2], [3]])
    with pytest.raises(ValueError, match="not a multiple"):
        expert_dp_groups(6, 4)
    moe = MoEMLP(D, H, EXPERTS)
    per = params_per_rank(D, H, EXPERTS, ep=1)
    assert per["router"] == moe.router.weight.numel()
    assert per["experts"] == sum(p.numel() for p in moe.experts.parameters())
    assert params_per_rank(D, H, EXPERTS, ep=4)["experts"] * 4 == per["experts"]
    assert bytes_per_layer(100, 16, 2, 4, 4) == 4 * 3 / 4 * 2 * 100 * 16 * 4
    assert bytes_per_layer(100, 16, 2, 1) == 0
    assert dispatch_buffer_bytes(100, 16, 2, 1.25) == 1.25 * 2 * 100 * 16 * 4


def _check_run(r, report: EPReport) -> None:
    """What every no-drop run must show, whatever the layout."""
    assert max(r.out_diff, r.input_grad_diff, r.router_grad_diff, r.expert_grad_diff) < FLOAT64, r
    assert r.drop_rate == [0.0] * report.world
    want = params_per_rank(D, H, EXPERTS, r.ep)
    assert all(p == want for p in r.params), r.params
    assert sum(r.send_rows) == sum(r.recv_rows) == report.world * r.k * TOKENS, "every choice goes out and comes in"
    if r.a2a == "by_hand":
        # four all-to-alls: dispatch and combine, and their backwards, each moving the rows that cross ranks
        assert r.sent == [2 * sum(off) * r.row_bytes for off in r.off_rank_rows]
        assert r.sent_counts == [(r.ep - 1) / r.ep * EXPERTS * 8] * report.world  # int64 counts to the others
        # even routing is the formula; a random router is uneven, but not wildly so at these sizes
        even = bytes_per_layer(TOKENS, D, r.k, r.ep, elem_bytes=8)
        assert 0.5 < sum(r.sent) / len(r.sent) / even < 1.5
    # gradient sync: the router over the world, the experts over their DP group (2(N-1)/N ring bytes)
    router, experts = 8 * want["router"], 8 * want["experts"]
    sync = 2 * (report.world - 1) / report.world * router + 2 * (r.dp - 1) / r.dp * experts
    assert all(g["all_reduce"] == pytest.approx(sync) for g in r.grad_sync)


@pytest.mark.slow
def test_two_ranks_equal_one_process() -> None:
    out = launch.run("course_lib.workers.ep_compare", 2, ARGS + ["--drop-factor", "1.0", "--api"], timeout=240)
    rep = EPReport.from_dict(out)
    for k in (1, 2):
        _check_run(rep.run(2, 1, k), rep)
        dropping = rep.run(2, 1, k, dropping=True)
        cap = expert_capacity(TOKENS, EXPERTS, 1.0, k)
        assert dropping.capacity == [cap, cap] and max(dropping.drop_rate) > 0
        # a rank receives at most the capacity from each rank for each of its experts: E x C rows
        assert all(rows <= EXPERTS * cap for rows in dropping.recv_rows)
        assert all(s == round((1 - d) * k * TOKENS) for s, d in zip(dropping.send_rows, dropping.drop_rate))
    api, mine = rep.run(2, 1, 2, a2a="torch"), rep.run(2, 1, 2)
    _check_run(api, rep)
    assert (api.out_diff, api.input_grad_diff, api.off_rank_rows) == (mine.out_diff, mine.input_grad_diff,
                                                                      mine.off_rank_rows)


@pytest.mark.slow
def test_four_ranks_expert_and_data_parallel() -> None:
    out = launch.run("course_lib.workers.ep_compare", 4, ARGS + ["--layouts", "4x1,2x2"], timeout=300)
    rep = EPReport.from_dict(out)
    for ep, dp in ((4, 1), (2, 2)):
        for k in (1, 2):
            _check_run(rep.run(ep, dp, k), rep)


@pytest.mark.slow
def test_world_that_does_not_divide_the_experts_fails_clearly() -> None:
    with pytest.raises(RuntimeError, match="cannot share 3 experts"):
        launch.run("course_lib.workers.ep_compare", 2, ["--experts", "3", "--tokens", "8", "--pg-timeout", "30"],
                   timeout=120)
