"""Chapter 12's expert parallelism: the formulas in one process, then launches on 2 and 4 gloo ranks.

Each launch checks the layer against the one-process ``MoEMLP`` in float64
(outputs and gradients), every byte count against the rows that crossed ranks,
and the parameters per rank against the formula. The auxiliary load-balancing
loss is checked on ranks this file starts itself (``_run_ranks``): its value on
every rank against the one-process layer's on the EP group's tokens, and the
router gradients it gives, summed over the group, against the one-process ones.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import time
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from course_lib.experiments import launch
from course_lib.parallel.expert_parallel.moe_layer import (ExpertParallelMoE, bytes_per_layer, dispatch_buffer_bytes,
                                                    expert_dp_groups, experts_per_rank, params_per_rank)
from course_lib.moe import MoEMLP, expert_capacity, expert_counts, load_balancing_loss, no_drop_factor
from course_lib.experiments.counting import ByteCounter, counted
from course_lib.experiments.workers.ep_compare import EPReport

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
    out = launch.run("course_lib.experiments.workers.ep_compare", 2, ARGS + ["--drop-factor", "1.0", "--api"], timeout=240)
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
    out = launch.run("course_lib.experiments.workers.ep_compare", 4, ARGS + ["--layouts", "4x1,2x2"], timeout=300)
    rep = EPReport.from_dict(out)
    for ep, dp in ((4, 1), (2, 2)):
        for k in (1, 2):
            _check_run(rep.run(ep, dp, k), rep)


@pytest.mark.slow
def test_world_that_does_not_divide_the_experts_fails_clearly() -> None:
    with pytest.raises(RuntimeError, match="cannot share 3 experts"):
        launch.run("course_lib.experiments.workers.ep_compare", 2, ["--experts", "3", "--tokens", "8", "--pg-timeout", "30"],
                   timeout=120)


# ----- the auxiliary load-balancing loss over the EP group ----------------------------------------------------

PG_TIMEOUT_S, RUN_TIMEOUT_S = 60, 240


def _aux_rank(rank: int, world: int, folder: str, eps: tuple[int, ...]) -> None:
    """One rank: for each EP size (groups of consecutive ranks) and k, the layer's aux loss against one process."""
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", store=dist.FileStore(f"{folder}/store", world), rank=rank,
                                world_size=world, timeout=timedelta(seconds=PG_TIMEOUT_S))
        from torch.distributed.nn.functional import all_reduce as differentiable_all_reduce
        results = []
        # uneven shares (16, 24, 32, ... tokens), so that the group's token count must be reduced, not assumed
        starts = list(itertools.accumulate((TOKENS + 8 * r for r in range(world)), initial=0))
        for ep in eps:
            ep_groups, _ = expert_dp_groups(world, ep)
            made = [dist.new_group(g) for g in ep_groups]  # collective: every rank makes every group, in order
            group, members = made[rank // ep], ep_groups[rank // ep]
            for k, factor in ((1, no_drop_factor(EXPERTS, 1)), (2, 1.0)):  # k = 2 drops choices: f ignores that
                torch.manual_seed(0)
                full = MoEMLP(D, H, EXPERTS, k, factor).double()
                gen = torch.Generator().manual_seed(1)
                x = torch.randn(starts[-1], D, generator=gen, dtype=torch.float64)  # host: CPU ranks
                group_x = x[starts[members[0]]:starts[members[-1] + 1]]  # the EP group's tokens, in rank order
                mine = x[starts[rank]:starts[rank + 1]]
                counter = ByteCounter()
                layer = ExpertParallelMoE(full, group)
                full(group_x)
                full.aux_loss.backward()
                with counted(counter, group, all_to_all=True):  # the forward's collectives, from the harness
                    layer(mine)
                layer.aux_loss.backward()
                grad = layer.router.weight.grad.clone()
                summed = grad.clone()
                dist.all_reduce(summed, group=group)
                r = layer.routing
                own = load_balancing_loss(r.probs, r.expert[:, 0]).item()  # this rank's tokens alone
                # the road not taken: P_i through torch's differentiable all_reduce, whose backward all-reduces too
                probs = layer.router(mine).softmax(-1)
                counts = expert_counts(r.expert[:, 0], EXPERTS).double()
                dist.all_reduce(counts, group=group)
                n = starts[members[-1] + 1] - starts[members[0]]
                loss = EXPERTS * (counts / n * differentiable_all_reduce(probs.sum(0), group=group) / n).sum()
                via_api, = torch.autograd.grad(loss, layer.router.weight)
                dist.all_reduce(via_api, group=group)
                results.append({"ep": ep, "k": k, "aux": layer.aux_loss.item(), "ref": full.aux_loss.item(),
                                "own": own, "summed": summed, "grad": grad, "ref_grad": full.router.weight.grad,
                                "via_api": via_api, "reduced": counter.by_op["all_reduce"]})
        torch.save(results, f"{folder}/{rank}.pt")
        dist.destroy_process_group()
    except BaseException:
        Path(folder, f"{rank}.err").write_text(traceback.format_exc())
        raise
    # The results are saved: leave without the interpreter's teardown, where a rank aborted once ("terminate
    # called without an active exception", exit -6) after both had saved, on a loaded machine (a gloo thread
    # still joinable as C++ objects are destroyed); what this test checks was done by then
    os._exit(0)


def _run_ranks(world: int, folder: Path, eps: tuple[int, ...], timeout: float = RUN_TIMEOUT_S) -> list[list[dict]]:
    """Start ``world`` gloo ranks of ``_aux_rank`` (spawned processes), wait at most ``timeout`` s; their results."""
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_aux_rank, args=(r, world, str(folder), eps), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
    finally:
        late = [r for r, p in enumerate(procs) if p.is_alive()]
        for r in late:
            procs[r].kill()
            procs[r].join()
    assert not late, f"ranks {late} did not finish within {timeout:.0f} s (stopped)"
    for r, p in enumerate(procs):
        err = folder / f"{r}.err"
        assert p.exitcode == 0, f"rank {r} exited with {p.exitcode}:\n{err.read_text() if err.exists() else ''}"
    return [torch.load(folder / f"{r}.pt") for r in range(world)]


def _check_aux(ranks: list[list[dict]]) -> None:
    world = len(ranks)
    for runs in zip(*ranks):  # one (ep, k) on every rank
        ep, k = runs[0]["ep"], runs[0]["k"]
        for g in range(0, world, ep):
            group = runs[g:g + ep]
            where = f"ep={ep} k={k} ranks {g}..{g + ep - 1}"
            # the value: the one-process layer's on the group's tokens, on every rank of the group
            assert all(abs(r["aux"] - r["ref"]) < FLOAT64 for r in group), (where, [r["aux"] for r in group],
                                                                            group[0]["ref"])
            # a rank's own tokens give another, noisier loss (16 to 40 tokens over 8 experts)
            assert max(abs(r["own"] - r["ref"]) for r in group) > 1e-3, where
            # the gradient: each rank's share of the group's tokens, summing to the one-process gradient
            ref = group[0]["ref_grad"]
            assert all((r["summed"] - ref).abs().max() < FLOAT64 for r in group), where
            assert all((r["grad"] - ref).abs().max() > 1e-6 for r in group), (where, "a rank's share is not the whole")
            # a differentiable all_reduce would hand every rank the whole group's gradient: ep times too much
            assert all((r["via_api"] - ep * ref).abs().max() < FLOAT64 for r in group), where
            # one all-reduce of 2E + 1 float64 numbers (counts, probability sums, tokens), counted as a ring's
            assert all(r["reduced"] == pytest.approx(2 * (ep - 1) / ep * (2 * EXPERTS + 1) * 8) for r in group)


@pytest.mark.slow
def test_aux_loss_over_two_ranks_equals_one_process(tmp_path: Path) -> None:
    _check_aux(_run_ranks(2, tmp_path, eps=(2,)))


@pytest.mark.slow
def test_aux_loss_over_four_ranks_and_two_groups_of_two(tmp_path: Path) -> None:
    _check_aux(_run_ranks(4, tmp_path, eps=(4, 2)))


def test_the_layer_counts_nothing_itself() -> None:
    # the bytes are counted from the harness (counting.counted), around torch.distributed: the layer has no counter
    import inspect

    from course_lib.parallel.expert_parallel import moe_layer

    assert not [f for f in (moe_layer.ExpertParallelMoE, moe_layer.exchange_counts, moe_layer.group_load_balancing_loss)
                if "counter" in inspect.signature(f).parameters]
