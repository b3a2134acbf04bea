"""course_lib.trace and course_lib.memory_profile: profiler traces read back, overlap measured, memory by category."""

import json

import pytest
import torch
from torch.profiler import record_function

from course_lib import memory, memory_profile, trace
from course_lib.experiments import launch
from course_lib.models import TinyTransformer, lm_loss


def test_union_covered_and_overlap():
    assert trace.union([(3, 4), (0, 2), (1, 2.5)]) == [(0, 2.5), (3, 4)]
    assert trace.covered([(0, 2), (1, 3), (5, 6)]) == 4
    assert trace.overlap([(0, 10)], [(2, 3), (9, 12)]) == 2
    assert trace.overlap([(0, 1), (4, 6)], [(0.5, 5)]) == pytest.approx(1.5)
    assert trace.overlap([(0, 1)], [(1, 2)]) == 0


def _event(name, ts, dur, tid=1, cat="cpu_op"):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "tid": tid, "cat": cat}


def test_read_step_pairs_gloo_runs_with_the_calls_that_queued_them(tmp_path):
    events = [_event("backward", 0, 100, cat="user_annotation"), _event("sync", 100, 50, cat="user_annotation"),
              _event("autograd::engine::evaluate_function: MmBackward0", 10, 5),
              _event("c10d::_reduce_scatter_base_", 20, 1), _event("gloo:all_reduce", 30, 40, tid=2),
              _event("c10d::allreduce_", 90, 1), _event("gloo:all_reduce", 110, 20, tid=2),
              _event("c10d::barrier", 140, 1), _event("gloo:barrier", 141, 1, tid=2)]
    path = tmp_path / "rank0.json"
    path.write_text(json.dumps({"traceEvents": events}))
    step = trace.read_step(path, 0)
    assert [c.kind for c in step.collectives] == ["reduce_scatter", "all_reduce"]  # the barrier left out
    assert step.collectives[0].queued == 20 and step.collectives[0].start == 30
    assert len(step.ops) == 1
    assert step.overlap_fraction("reduce_scatter") == 1.0 and step.overlap_fraction("all_reduce") == 0.0
    assert step.queued_in("all_reduce") == 1  # queued at 90, inside the backward, though it ran after it
    assert trace.mean_overlap([step], "reduce_scatter") == 1.0
    with pytest.raises(ValueError, match="backward"):
        (tmp_path / "bad.json").write_text(json.dumps({"traceEvents": events[2:]}))
        trace.read_step(tmp_path / "bad.json", 0)


def test_ddp_traces_on_two_ranks(tmp_path):
    """NaiveDDP sends after the backward, BucketedDDP from inside it: read from the ranks' own trace files."""
    out = launch.run("course_lib.experiments.workers.step_trace", 2, ["--what", "ddp", "--out", str(tmp_path)], timeout=120,
                     env={"COURSE_DIST_BACKEND": "gloo"})
    assert out["files"] == ["naive_rank0.json", "bucketed_rank0.json"]
    steps = {v: [trace.read_step(tmp_path / f"{v}_rank{r}.json", r) for r in range(2)] for v in ("naive", "bucketed")}
    for r in range(2):
        naive, bucketed = steps["naive"][r], steps["bucketed"][r]
        assert len(naive.of("all_reduce")) == 10       # one per gradient: no message besides them
        assert naive.queued_in("all_reduce") == 0 and naive.overlap_fraction("all_reduce") == 0.0
        assert bucketed.queued_in("all_reduce") == len(bucketed.of("all_reduce")) >= 3
        assert len(naive.ops) > 0 and set(naive.phases) == set(trace.PHASES)
    assert trace.mean_overlap(steps["bucketed"], "all_reduce") > 0
    assert sum(p.stat().st_size for p in tmp_path.glob("*.json")) < 2e6  # small enough to keep under build/
    fig = trace.draw_steps(steps, "test")
    assert len(fig.axes) == 2


def test_memory_by_category_agrees_with_the_exact_count(tmp_path):
    torch.manual_seed(0)
    model = TinyTransformer(vocab=32, d_model=32, n_heads=2, n_layers=2, max_len=32)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    idx = torch.randint(0, 32, (2, 33))
    x, y = idx[:, :-1], idx[:, 1:]

    def step():
        opt.zero_grad(set_to_none=True)
        with record_function("forward"):
            loss = lm_loss(model(x), y)
        with record_function("backward"):
            loss.backward()
        with record_function("optimizer"):
            opt.step()
    tl = memory_profile.memory_by_category(step, tmp_path / "step.json.gz")
    assert (tmp_path / "step.json.gz").exists() and (tmp_path / "step_memory.json").exists()
    exact = memory.measure(model, lm_loss, x, y, opt)
    kinds = memory_profile.saved_by_kind(lambda: lm_loss(model(x), y), exclude=model.parameters())
    assert kinds["float"] + kinds["other"] == exact["activations"]
    assert tl.peak("parameter") == exact["params"]
    assert tl.peak("gradient") == exact["grads"]
    assert tl.peak("optimizer_state") == exact["optimizer"]
    at = tl.at(tl.phases["backward"][0])  # the forward's end: what it left for the backward
    assert at["gradient"] == 0
    # the profiler files the saved ids and masks under "input"; the loss itself (4 bytes) is an activation
    assert abs(at["activation"] - kinds["float"]) <= 16
    assert set(tl.phases) == {"forward", "backward", "optimizer"}
    assert memory_profile.draw(tl, exact, "test") is not None
