"""The hand-written ZeRO of chapter 08: shard boundaries, formulas, clear errors, and real ranks.

The single-process tests use a gloo group of world size 1 in this process;
one launch on 3 ranks (an uneven split of the flat vector) checks the
collectives, the bytes held and sent, and equality with single-process Adam.
"""

from __future__ import annotations

import copy
import math
import tempfile

import pytest
import torch
import torch.distributed as dist

from course_lib import memory
from course_lib.distributed import launch
from course_lib.distributed.zero import (ZeroOptimizer, count_fsdp_traffic, held_bytes, shard_bounds,
                                         zero_bytes_per_rank)
from course_lib.models import lm_loss
from course_lib.workers.zero_common import RunConfig, build_model, global_batch


@pytest.mark.parametrize("numel", [0, 1, 7, 12, 30145])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_shard_bounds_cover_the_vector_once(numel: int, world: int) -> None:
    bounds = [shard_bounds(numel, world, r) for r in range(world)]
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    for (s0, e0), (s1, _) in zip(bounds, bounds[1:]):
        assert e0 == s1, f"gap or overlap between shards: {bounds}"
    assert all(e - s <= math.ceil(numel / world) for s, e in bounds)


def test_shard_bounds_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="rank"):
        shard_bounds(10, 2, 2)
    with pytest.raises(ValueError, match="world_size"):
        shard_bounds(10, 0, 0)


def test_bytes_per_rank_matches_the_paper_formula() -> None:
    for stage in range(4):
        parts = zero_bytes_per_rank(int(7.5e9), 64, stage, param_bytes=2, grad_bytes=2, optimizer_bytes=12)
        assert sum(parts.values()) == pytest.approx(memory.zero_memory(7.5e9, 64, stage))
    assert zero_bytes_per_rank(100, 4, 2) == {"params": 400, "grads": 100, "optimizer": 200}
    with pytest.raises(ValueError, match="stage"):
        zero_bytes_per_rank(100, 4, 4)


def test_zero_optimizer_rejects_bad_arguments() -> None:
    model = build_model(RunConfig(d_model=16, n_layers=1, seq_len=8))
    with pytest.raises(ValueError, match="fully_shard"):
        ZeroOptimizer(model, torch.optim.Adam, stage=3)
    with pytest.raises(ValueError, match="element-wise"):
        ZeroOptimizer(model, torch.optim.LBFGS, stage=1)
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="process group"):
            ZeroOptimizer(model, torch.optim.Adam, stage=1)


@pytest.fixture
def one_rank_group():
    """A gloo process group of one rank, in this process."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with tempfile.TemporaryDirectory() as d:  # FileStore removes its file itself at the end
        dist.init_process_group("gloo", store=dist.FileStore(f"{d}/store", 1), rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


@pytest.mark.parametrize("stage", [1, 2])
def test_one_rank_zero_is_adam(one_rank_group, stage: int) -> None:
    cfg = RunConfig(d_model=16, n_layers=1, seq_len=8, batch=4)
    model = build_model(cfg)
    ref = copy.deepcopy(model)
    opt = ZeroOptimizer(model, torch.optim.Adam, stage, lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    for step in range(3):
        x, y = global_batch(cfg, step)
        if step:  # the first step runs without zero_grad: gradients made by autograd are copied in
            opt.zero_grad()
        lm_loss(model(x), y).backward()
        opt.step()
        ref_opt.zero_grad()
        lm_loss(ref(x), y).backward()
        ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q), "one rank must reproduce Adam bit for bit"
    n = sum(p.numel() for p in model.parameters())
    held = opt.state_bytes()
    assert held == {"params": 4 * n, "grads": 4 * n, "optimizer": 8 * n + 4}
    assert opt.counter.bytes == 0  # nothing to send to oneself
    if stage == 2:
        assert all(p.grad is None for p in model.parameters()), "stage 2 frees the full gradients"


def test_meters_reject_plain_models(one_rank_group) -> None:
    model = build_model(RunConfig(d_model=16, n_layers=1, seq_len=8))
    from course_lib.distributed import comm
    with pytest.raises(ValueError, match="fully_shard"):
        count_fsdp_traffic(model, comm.ByteCounter())
    opt = torch.optim.Adam(model.parameters())
    assert held_bytes(model, opt) == {"params": memory.param_bytes(model), "grads": 0, "optimizer": 0}


@pytest.mark.slow
def test_zero_on_three_ranks() -> None:
    """Uneven shards on 3 ranks: equal to Adam (float64), 1/N of the state per rank, DDP's traffic."""
    cfg = RunConfig(vocab=50, d_model=48, n_heads=4, n_layers=1, seq_len=12, batch=6, steps=4)
    num_params = sum(p.numel() for p in build_model(cfg).parameters())
    assert num_params % 3, "the test wants a flat vector that does not split evenly"
    out = launch.run("course_lib.workers.zero_compare", 3,
                     ["--tasks", "exact,compare", "--methods", "ddp,zero1,zero2,fsdp2", "--cfg", cfg.to_json()],
                     timeout=180)
    for m, r in out["exact"]["methods"].items():
        assert r["max_param_diff"] < 1e-5, f"{m} drifted from whole-batch Adam by {r['max_param_diff']}"
    methods = out["compare"]["methods"]
    slots = math.ceil(num_params / 3)
    for m in ("zero1", "zero2"):
        held = methods[m]["held"]
        assert [h["optimizer"] for h in held] == [8 * slots + 4] * 3, "each rank: the Adam moments of its slice"
        total = sum(h["optimizer"] for h in held)
        assert abs(total / (8 * num_params) - 1) < 0.01, "together the ranks hold the optimizer state once"
        assert methods[m]["sent_per_step"][0] == pytest.approx(methods["ddp"]["sent_per_step"][0], rel=0.01)
    assert [h["grads"] for h in methods["zero2"]["held"]] == [4 * slots] * 3, "stage 2 keeps a gradient slice"
    assert [h["grads"] for h in methods["zero1"]["held"]] == [4 * slots * 3] * 3, "stage 1 keeps the full gradient"
    ratio = methods["fsdp2"]["sent_per_step"][0] / methods["ddp"]["sent_per_step"][0]
    assert abs(ratio / 1.5 - 1) < 0.05, f"FSDP2 sends {ratio:.3f} x DDP, expected 1.5"
    ddp_formula = 2 * 2 / 3 * 4 * num_params
    assert methods["ddp"]["sent_per_step"][0] == pytest.approx(ddp_formula, rel=1e-6)
