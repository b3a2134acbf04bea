"""The hand-written ZeRO of chapter 09: shard boundaries, formulas, clear errors, and real ranks.

The single-process tests use a gloo group of world size 1 in this process;
one launch on 3 ranks (an uneven split of every bucket) checks the
collectives, when the buckets leave, the bytes held, sent and at the peak,
and equality with single-process Adam, with and without accumulation.
"""

from __future__ import annotations

import copy
import math
import tempfile

import pytest
import torch
import torch.distributed as dist

from course_lib import memory
from course_lib.experiments import zero_meters
from course_lib.experiments.counting import ByteCounter, counted
from course_lib.experiments.run_config import RunConfig, build_model, global_batch
from course_lib.experiments.workers.zero_common import run_workers
from course_lib.experiments.zero_meters import count_collectives, count_fsdp_traffic, held_bytes
from course_lib.models import lm_loss
from course_lib.parallel.sharding import zero
from course_lib.parallel.sharding.agreement import GuardedZeroOptimizer
from course_lib.parallel.sharding.zero import ZeroOptimizer, shard_bounds, zero_bytes_per_rank
from course_lib.parallel.sharding.zero_buckets import bucket_sizes


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


def test_bytes_per_rank_reproduce_the_papers_example() -> None:
    # Rajbhandari et al. 2020, Figure 1: 7.5B parameters, 64 GPUs, 2 + 2 + 12 bytes: 120, 31.4, 16.6, 1.88 GB
    totals = [sum(zero_bytes_per_rank(7.5e9, 64, s, 2, 2, 12).values()) / 1e9 for s in range(4)]
    assert [round(t, 2) for t in totals] == [120.0, 31.41, 16.64, 1.88]
    assert zero_bytes_per_rank(7.5e9, 64, 2, 2, 2, 12) == pytest.approx(
        {"params": 15e9, "grads": 15e9 / 64, "optimizer": 90e9 / 64})  # 2 psi, 2 psi / N, K psi / N
    assert zero_bytes_per_rank(100, 4, 2) == {"params": 400, "grads": 100, "optimizer": 200}  # fp32 Adam
    assert sum(zero_bytes_per_rank(7.5e9, 64, 1, 2, 2, 12).values()) == pytest.approx(
        memory.zero_memory(7.5e9, 64, 1))  # the parts add up to chapter 01's total
    with pytest.raises(ValueError, match="stage"):
        zero_bytes_per_rank(100, 4, 4)


def test_buckets_follow_the_backward_order_and_the_cap() -> None:
    params = [torch.zeros(n) for n in (10, 300, 20, 30, 5)]
    # bytes 40, 1200, 80, 120, 20 walked from the end, at most 200 per bucket; the 1200 alone
    assert bucket_sizes(params, bucket_cap_mb=200 / 2**20) == [140, 80, 1200, 40]
    assert bucket_sizes(params, bucket_cap_mb=1.0) == [1460]
    with pytest.raises(ValueError, match="positive"):
        bucket_sizes(params, bucket_cap_mb=0)


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


@pytest.mark.parametrize("bucket_mb", [zero.DEFAULT_BUCKET_MB, 0.004], ids=["one-bucket", "many-buckets"])
@pytest.mark.parametrize("stage", [1, 2])
def test_one_rank_zero_is_adam(one_rank_group, stage: int, bucket_mb: float) -> None:
    cfg = RunConfig(d_model=16, n_layers=1, seq_len=8, batch=4)
    model = build_model(cfg)
    ref = copy.deepcopy(model)
    opt = ZeroOptimizer(model, torch.optim.Adam, stage, bucket_cap_mb=bucket_mb, lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    assert (len(opt.buckets) > 3) == (bucket_mb < 1)
    counter = ByteCounter()
    for step in range(3):
        x, y = global_batch(cfg, step)
        with counted(counter):
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
    # Adam: two fp32 moments per element and a 4-byte step counter per tensor (one per bucket slice)
    assert held == {"params": 4 * n, "grads": 4 * n, "optimizer": 8 * n + 4 * len(opt.buckets)}
    assert counter.bytes == 0  # nothing to send to oneself
    assert counter.calls["reduce_scatter"] == 3 * len(opt.buckets)  # one per bucket per backward
    if stage == 2:
        assert all(p.grad is None for p in model.parameters()), "stage 2 keeps only the slices of the gradient"


def test_stage2_accumulates_slices_and_reduces_unused_parameters(one_rank_group) -> None:
    cfg = RunConfig(d_model=16, n_layers=2, seq_len=8, batch=4, dtype="float64")
    model, ref = build_model(cfg), build_model(cfg)
    opt = ZeroOptimizer(model, torch.optim.Adam, 2, bucket_cap_mb=0.004, lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    x, y = global_batch(cfg, 0)
    counter = ByteCounter()
    opt.zero_grad()
    for xm, ym in zip(x.chunk(2), y.chunk(2)):  # two micro-batches: every bucket reduced after each
        with counted(counter):
            lm_loss(model(xm), ym).div(2).backward()
        assert counter.calls["reduce_scatter"] % len(opt.buckets) == 0
    opt.step()
    ref_opt.zero_grad()
    lm_loss(ref(x), y).backward()
    ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-12)
    # the last block unused in a step: its buckets never fill, the end of the backward reduces them anyway
    calls = counter.calls["reduce_scatter"]
    opt.zero_grad()
    with counted(counter):
        lm_loss(model.head(model.blocks[0](model.embed(x))), y).backward()
    assert counter.calls["reduce_scatter"] == calls + len(opt.buckets)
    assert all(b.piece.grad is not None for b in opt.buckets)
    opt.step()


@pytest.mark.parametrize("stage", [1, 2])
def test_a_step_issues_zeros_collectives_and_nothing_else(one_rank_group, stage: int) -> None:
    # ZeRO's step: a reduce-scatter and an all-gather per bucket. Every collective handed to torch.distributed counts,
    # so a hidden barrier or a flag all-reduce read on the host (a sync per backward) would show
    cfg = RunConfig(d_model=16, n_layers=1, seq_len=8, batch=4)
    model = build_model(cfg)
    opt = ZeroOptimizer(model, torch.optim.Adam, stage, bucket_cap_mb=0.004, lr=1e-2)
    x, y = global_batch(cfg, 0)
    for _ in range(2):
        with count_collectives() as issued:
            opt.zero_grad()
            lm_loss(model(x), y).backward()
            opt.step()
        buckets = len(opt.buckets)
        assert [i.op for i in issued] == (["reduce_scatter"] * buckets + ["all_gather"] * buckets)
        assert sum(i.sent for i in issued) == 0  # nothing to send to oneself; two ranks: tests/test_zero_faults.py


def test_stage2_without_the_guards_reduces_an_unused_layer_as_zeros(one_rank_group) -> None:
    # the plain version does not look ahead: the unused layer's bucket leaves at the end of the backward, with zeros
    # (Adam's momentum may still move it: GuardedZeroOptimizer leaves it without a gradient instead)
    model = _WithSpare()
    opt = ZeroOptimizer(model, torch.optim.Adam, 2, bucket_cap_mb=1e-4, lr=1e-2)
    seen, counter = [], ByteCounter()
    model.first.weight.register_hook(lambda g: seen.append(counter.calls.get("reduce_scatter", 0)))
    opt.zero_grad()
    with counted(counter):
        model(torch.randn(4, 8)).pow(2).mean().backward()
    assert seen == [0], "the spare layer's bucket comes first: every bucket waits for the end of the backward"
    assert counter.calls["reduce_scatter"] == len(opt.buckets)
    spare = [b for b in opt.buckets if all(i >= 4 for i in b.params)]
    assert spare and all(b.piece.grad is not None and not b.piece.grad.any() for b in spare)
    opt.step()


def test_a_gradient_arriving_twice_raises_on_this_rank(one_rank_group) -> None:
    lin = torch.nn.Linear(4, 4)
    opt = ZeroOptimizer(lin, torch.optim.Adam, 2, lr=1e-2)
    x = torch.randn(2, 4, requires_grad=True)
    opt.zero_grad()
    with pytest.raises(RuntimeError, match="arrived twice"):
        lin(torch.utils.checkpoint.checkpoint(lin, x, use_reentrant=True)).sum().backward()
    opt.zero_grad()  # a fresh start: nothing left of the failed backward
    lin(lin(x)).sum().backward()
    opt.step()


def test_meters_reject_plain_models(one_rank_group) -> None:
    model = build_model(RunConfig(d_model=16, n_layers=1, seq_len=8))
    with pytest.raises(ValueError, match="fully_shard"):
        count_fsdp_traffic(model, ByteCounter())
    opt = torch.optim.Adam(model.parameters())
    assert held_bytes(model, opt) == {"params": memory.param_bytes(model), "grads": 0, "optimizer": 0}


@pytest.mark.slow
def test_zero_on_three_ranks() -> None:
    """Uneven shards on 3 ranks: equal to Adam (float64, with accumulation), 1/N of the state per rank, DDP's
    traffic, buckets that leave during the backward, and a lower peak for stage 2."""
    cfg = RunConfig(vocab=50, d_model=48, n_heads=4, n_layers=2, seq_len=12, batch=6, steps=4, bucket_mb=0.01)
    model = build_model(cfg)
    num_params = sum(p.numel() for p in model.parameters())
    sizes = bucket_sizes(list(model.parameters()), cfg.bucket_mb)
    slots = sum(math.ceil(b / 4 / 3) for b in sizes)  # per rank: each bucket padded to a multiple of 3
    assert any((b // 4) % 3 for b in sizes), "the test wants buckets that do not split evenly"
    out = run_workers(3, ["exact", "compare", "timeline"], cfg, ["ddp", "zero1", "zero2", "fsdp2", "zero2_sync"],
                      timeout=240)
    exact = out.exact
    assert exact.accumulation == 2
    for m, r in exact.methods.items():
        assert r.max_param_diff < 1e-5, f"{m} drifted from whole-batch Adam by {r.max_param_diff}"
    ddp_sent = exact.methods["ddp"].sent_per_step[0]
    # accumulation: DDP and ZeRO-1 reduce once per step, ZeRO-2 after each of the 2 micro-batches: (A+1)/2
    assert exact.methods["zero1"].sent_per_step[0] == pytest.approx(ddp_sent, rel=0.01)
    assert exact.methods["zero2"].sent_per_step[0] == pytest.approx(1.5 * ddp_sent, rel=0.01)
    methods = out.compare.methods
    for m in ("zero1", "zero2"):
        held = methods[m].held
        assert [h["optimizer"] for h in held] == [8 * slots + 4 * len(sizes)] * 3, "the Adam moments of its slices"
        total = sum(h["optimizer"] for h in held)
        assert abs(total / (8 * num_params) - 1) < 0.02, "together the ranks hold the optimizer state once"
        assert methods[m].sent_per_step[0] == pytest.approx(methods["ddp"].sent_per_step[0], rel=0.01)
        assert methods[m].calls_per_step == {"reduce_scatter": len(sizes), "all_gather": len(sizes)}
    assert [h["grads"] for h in methods["zero2"].held] == [4 * slots] * 3, "stage 2 keeps a gradient slice"
    assert [h["grads"] for h in methods["zero1"].held] == [4 * slots * 3] * 3, "stage 1 keeps the full gradient"
    ratio = methods["fsdp2"].sent_per_step[0] / methods["ddp"].sent_per_step[0]
    assert abs(ratio / 1.5 - 1) < 0.05, f"FSDP2 sends {ratio:.3f} x DDP, expected 1.5"
    assert methods["ddp"].sent_per_step[0] == pytest.approx(2 * 2 / 3 * 4 * num_params, rel=1e-6)
    # the peak: what stage 1 holds and stage 2 does not, the full gradient less one slice, (N-1)/N x G
    saving = [a - b for a, b in zip(methods["zero1"].peak, methods["zero2_sync"].peak)]
    assert min(saving) >= 0.7 * 2 / 3 * 4 * num_params, f"stage 2 saves only {saving} bytes of peak"
    # the price of the overlap: each reduce-scatter in flight keeps its bucket's gradient and gloo's copy of it
    overlap = [a - b for a, b in zip(methods["zero2"].peak, methods["zero2_sync"].peak)]
    assert all(0 < o <= zero.MAX_IN_FLIGHT * (2 + 1 / 3) * max(sizes) for o in overlap), (overlap, max(sizes))
    for m, r in methods.items():  # resident at the start of a step: the model states and the batch
        assert all(res < peak for res, peak in zip(r.resident, r.peak)), m
    # when the buckets leave: stage 2 during the backward, stage 1 only in step()
    one, two = out.timeline
    assert one.stage == 1 and set(one.reduce_scatters_seen) == {0} and one.after_backward == 0
    assert one.full_grad_bytes_after_backward == 4 * num_params and one.slice_grad_bytes == 0
    assert two.names[-1].startswith("embed"), "the backward ends at the embedding"
    assert two.reduce_scatters_seen[-1] >= 1, "a bucket left before the backward reached its last gradient"
    assert two.reduce_scatters_seen == sorted(two.reduce_scatters_seen) and two.after_backward == len(sizes)
    assert two.full_grad_bytes_after_backward == 0 and two.slice_grad_bytes == 4 * slots


class _WithSpare(torch.nn.Module):
    """A tiny model whose ``spare`` layer is never used: first in the backward order, then unreached."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        self.spare = torch.nn.Linear(8, 8)  # registered last: its bucket is the first the backward would fill

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.first(x)))


def test_stage2_starts_reduce_scatters_without_waiting_and_skips_unused_ones(one_rank_group, monkeypatch) -> None:
    # unused parameters counted as the backward starts, and a bucket no rank used left without a gradient: the
    # guarded layer's (agreement), as DDP's find_unused_parameters is an option
    model = _WithSpare()
    spare_before = [p.detach().clone() for p in model.spare.parameters()]
    opt = GuardedZeroOptimizer(model, torch.optim.Adam, 2, bucket_cap_mb=1e-4, lr=1e-2)  # about a bucket per tensor
    assert len(opt.buckets) >= 5
    started, in_flight = [], []
    real = zero.comm.reduce_scatter

    def spy(out, inp, **kw):
        started.append(kw.get("async_op", False))
        return real(out, inp, **kw)
    monkeypatch.setattr(zero.comm, "reduce_scatter", spy)
    seen, counter = [], ByteCounter()
    for p in (model.first.weight, model.first.bias):  # the last gradients of the backward
        p.register_hook(lambda g: seen.append((counter.calls.get("reduce_scatter", 0), len(opt._pending))))
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: in_flight.append(len(opt._pending)))
    opt.zero_grad()
    with counted(counter):
        model(torch.randn(4, 8)).pow(2).mean().backward()
    assert started and all(started), "every reduce-scatter is started asynchronously"
    assert max(in_flight) == opt.max_in_flight == zero.MAX_IN_FLIGHT, "left running while the backward goes on"
    assert not opt._pending, "every reduce-scatter finished by the end of the backward"
    # the spare layer's bucket comes first in the backward order: counted unused at once, it holds nothing back
    assert seen[-1][0] >= len(opt.buckets) - 2, f"buckets waited for the unused layer: {seen}"
    spare = [b for b in opt.buckets if all(i >= 4 for i in b.params)]  # parameters 4 and 5: spare.weight, .bias
    assert spare and all(b.piece.grad is None for b in spare), "no rank had a gradient for it: Adam must skip it"
    opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.spare.parameters(), spare_before))
    assert not torch.equal(model.first.weight, _WithSpare().first.weight), "the used layers were updated"


def test_stage1_refuses_gradients_changed_after_the_backward(one_rank_group) -> None:
    model = build_model(RunConfig(d_model=16, n_layers=1, seq_len=8))
    opt = GuardedZeroOptimizer(model, torch.optim.Adam, 1, lr=1e-2)  # the check is the guarded layer's
    x, y = global_batch(RunConfig(d_model=16, n_layers=1, seq_len=8), 0)
    opt.zero_grad()
    lm_loss(model(x), y).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    with pytest.raises(RuntimeError, match="ZeroOptimizer.clip_grad_norm_"):
        opt.step()
    opt.zero_grad()  # the right way: clip through the optimizer, which sees the averaged slices
    lm_loss(model(x), y).backward()
    assert opt.clip_grad_norm_(1e-3) > 1e-3
    assert sum(b.piece.grad.pow(2).sum() for b in opt.buckets).sqrt() == pytest.approx(1e-3, rel=1e-3)
    opt.step()
    with pytest.raises(ValueError, match="positive"):
        opt.clip_grad_norm_(0)
    # after step() each rank's .grad is the mean only in its own slice: a norm read from the model is wrong too
    torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
    with pytest.raises(RuntimeError, match="after step"):
        opt.zero_grad()
    opt.zero_grad()  # said once; the next step starts clean


@pytest.mark.parametrize("main_backend", ["gloo", "cpu:gloo,cuda:nccl", "nccl"])
def test_flags_travel_on_the_host_through_gloo(one_rank_group, monkeypatch, main_backend: str) -> None:
    # an NCCL main group gets a gloo side group for the flags (read on the host at once: summed on the GPU, reading
    # them would wait for the device inside the backward); a group with gloo in it keeps them, as before
    real_backend, real_all_reduce = dist.get_backend, dist.all_reduce
    monkeypatch.setattr(dist, "get_backend", lambda group=None: main_backend if group is None else real_backend(group))
    flags = []

    def spy(t, *args, group=None, **kw):
        if t.dtype == torch.int32:
            flags.append((t.device.type, group))
        return real_all_reduce(t, *args, group=group, **kw)
    monkeypatch.setattr(dist, "all_reduce", spy)
    model = _WithSpare()
    opt = GuardedZeroOptimizer(model, torch.optim.Adam, 2, lr=1e-2)  # the flags are the guarded layer's
    side = opt._flag_group
    assert (side is not None) == (main_backend == "nccl")
    if side is not None:
        assert real_backend(side) == "gloo"
    opt.zero_grad()
    model(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()
    assert len(flags) == opt.control_calls == 3  # the backward's start and end, and step()'s join
    assert flags == [("cpu", side)] * 3


def test_fsdp2_steps_on_one_rank_are_adam_and_held_bytes_are_counted_by_device(one_rank_group) -> None:
    from course_lib.experiments.dp_methods import fsdp2_adam, train_steps
    from course_lib.experiments.run_config import reference

    cfg = RunConfig(d_model=16, n_layers=1, seq_len=8, batch=4, steps=3)
    model, opt = fsdp2_adam(cfg, torch.device("cpu"))
    times: list[float] = []
    done: list[int] = []
    losses = train_steps(model, opt, cfg, torch.device("cpu"), on_step=lambda n, _: done.append(n), times=times)
    assert len(times) == cfg.steps and done == [1, 2, 3]
    assert max(abs(a - b) for a, b in zip(losses, reference(cfg)[0])) < 1e-5
    assert zero_meters.held_bytes_by_device(model, opt) == {"cpu": sum(held_bytes(model, opt).values()), "cuda": 0}


def test_the_sharding_modules_import_no_experiment_or_tool() -> None:
    import ast
    import pathlib

    import course_lib.parallel.sharding as sharding

    for path in pathlib.Path(sharding.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not [n for n in names if n.startswith(("course_lib.experiments", "course_lib.tools"))], path.name
