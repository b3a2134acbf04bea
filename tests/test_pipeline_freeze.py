"""Freeze training on a pipeline (course_lib/parallel/pipeline/freeze.py, chapter 08)."""

from __future__ import annotations

import collections
import copy

import pytest
import torch
from torch import nn

from course_lib.parallel.pipeline.schedules import check_schedule, frozen_prefix, inflight_counts, make_schedule, simulate
from course_lib.experiments.pipeline_freeze import CountedCache
from course_lib.experiments.pipeline_steps import peak_sends_held
from course_lib.parallel.pipeline.executor import op_links, send_releases
from course_lib.parallel.pipeline.freeze import (ActivationCache, freeze, frozen_schedule, progressive_freeze,
                                                    repack, simulate_repacked)
from course_lib.models import TinyTransformer, lm_loss


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "zb-h1"])
def test_frozen_stages_run_forwards_only(kind):
    for p, m, k in ((2, 3, 1), (4, 8, 2), (4, 5, 3)):
        schedule = frozen_schedule(kind, p, m, k)
        assert frozen_prefix(schedule) == k
        assert check_schedule(schedule) == (p, m, kind == "zb-h1")
        assert all(order == [("F", i) for i in range(m)] for order in schedule[:k])
        assert schedule[k:] == make_schedule(kind, p, m)[k:]             # the trainable stages keep their order
        assert [max(inflight_counts(o)) for o in schedule[:k]] == [0] * k  # no graph kept on a frozen stage


def test_bad_frozen_schedules_are_value_errors():
    with pytest.raises(ValueError, match="last stage"):
        frozen_schedule("1f1b", 3, 4, 3)
    with pytest.raises(ValueError, match="interleav"):
        frozen_schedule("interleaved", 2, 4, 1)
    with pytest.raises(ValueError, match="trainable last stage"):
        check_schedule([[("F", 0)], [("F", 0)]])
    # a forward-only stage after a trainable one is not a frozen prefix: it misses its backward
    with pytest.raises(ValueError, match="missing"):
        check_schedule([[("F", 0), ("B", 0)], [("F", 0)]])
    with pytest.raises(ValueError, match="frozen stage 0"):
        check_schedule([[("F", 0)], [("F", 0), ("F", 1), ("B", 0), ("B", 1)]])


@pytest.mark.parametrize("t_f, t_b", [(1.0, 2.0), (1.0, 1.0), (0.3, 1.7)])
def test_a_frozen_prefix_removes_its_backwards_from_the_critical_path(t_f, t_b):
    for kind in ("gpipe", "1f1b"):
        for p in (2, 3, 4, 6):
            for m in (1, 2, 5, 8):
                for k in range(p):
                    sim = simulate(frozen_schedule(kind, p, m, k), t_f, t_b)
                    # k forwards to reach the first trainable stage, then a (p - k)-stage pipeline
                    assert sim.makespan == pytest.approx(k * t_f + (m + p - k - 1) * (t_f + t_b)), (kind, p, m, k)
                    assert sim.busy == pytest.approx([m * t_f] * k + [m * (t_f + t_b)] * (p - k))
                    assert sim.peak_inflight[:k] == [0] * k


def test_the_first_trainable_stage_sends_no_gradient():
    p, m, k = 4, 6, 2
    schedule = frozen_schedule("1f1b", p, m, k)
    sends = [[op_links(o, s, p, 1, frozen_prefix(schedule))[1] for o in order] for s, order in enumerate(schedule)]
    backward_sends = [sum(1 for o, snd in zip(order, sends[s]) if o[0] == "B" and snd) for s, order in
                      enumerate(schedule)]
    assert backward_sends == [0, 0, 0, m]                                # only the last stage sends one back
    assert sum(1 for row in sends for snd in row if snd) == (p - 1) * m + (p - 1 - k) * m
    # a frozen stage's activations are never acknowledged by a gradient: held until the end of the step
    assert send_releases(schedule, 0) == [None] * m
    assert peak_sends_held(schedule, 0) == m


def test_progressive_freeze_and_its_bad_arguments():
    assert progressive_freeze(8, 4, 0.5) == [0, 4, 6, 7]                # the head (keep = 1) always trains
    assert progressive_freeze(8, 5, 1 / 3) == [0, 2, 4, 5, 6]
    assert progressive_freeze(4, 3, 1.0, keep=2) == [0, 2, 2]
    for bad in ((0, 3, 0.5), (8, 0, 0.5), (8, 3, 0.0), (8, 3, 1.5)):
        with pytest.raises(ValueError):
            progressive_freeze(*bad)


def test_repack_halves_the_pipeline_and_fills_the_devices_with_replicas():
    plans = [repack(8, f, 4, 2) for f in (0, 2, 4, 6, 7)]
    assert [(pl.stages, pl.replicas) for pl in plans] == [(4, 1), (4, 1), (2, 2), (1, 4), (1, 4)]
    assert plans[1].layers_per_stage == [2, 2, 1, 1]
    assert all(sum(pl.layers_per_stage) == pl.active_layers and pl.stages * pl.replicas == 4 for pl in plans)
    assert repack(16, 3, 8, 2).stages == 8 and repack(16, 12, 8, 2).stages == 2
    with pytest.raises(ValueError, match="power of two"):
        repack(8, 2, 3, 2)
    with pytest.raises(ValueError, match="do not fit"):
        repack(8, 0, 2, 2)
    with pytest.raises(ValueError):
        repack(8, 8, 4, 2)


def test_repacked_step_is_shorter_in_simulation():
    base = simulate(make_schedule("1f1b", 4, 8)).makespan                # (m + p - 1)(t_f + t_b) = 33
    assert base == pytest.approx(33.0)
    plan = repack(8, 4, 4, 2)
    sim = simulate_repacked(plan, 8, 1.0, 2.0, layers_per_old_stage=2)  # 2 replicas x 2 stages, m = 4 each
    assert sim.makespan == pytest.approx((4 + 2 - 1) * 3.0)
    assert sim.bubble_fraction == pytest.approx(1 / 5)
    half = simulate_repacked(repack(8, 7, 4, 2), 8, 1.0, 2.0, layers_per_old_stage=2)   # 1 layer on 1 stage
    assert half.makespan == pytest.approx(2 * 1.5)                       # 2 micro-batches of half a stage's time
    with pytest.raises(ValueError, match="replicas"):
        simulate_repacked(plan, 3, 1.0, 2.0, 2)


def _model() -> TinyTransformer:
    torch.manual_seed(0)
    return TinyTransformer(vocab=64, d_model=32, n_heads=2, n_layers=2, max_len=16)


def test_activation_cache_runs_the_prefix_once_per_sample():
    model = _model()
    prefix = nn.Sequential(*list(model.as_sequential())[:2])
    x = torch.randint(0, 64, (6, 16))
    cache = CountedCache(prefix, num_samples=6)
    calls = collections.Counter()
    prefix.register_forward_hook(lambda mod, inp, out: calls.update(samples=inp[0].shape[0]))
    for _epoch in range(3):
        for j in range(3):
            got = cache.get(torch.arange(2 * j, 2 * j + 2), x[2 * j:2 * j + 2])
            torch.testing.assert_close(got, prefix(x[2 * j:2 * j + 2]).detach())
    assert calls["samples"] == 6 + 18                    # 6 by the cache (first epoch), 18 by the check above
    assert cache.computed == 6 and cache.hits == 12
    assert cache.nbytes == 6 * 16 * 32 * 4               # samples x sequence x d_model x fp32 bytes
    partial = CountedCache(prefix, num_samples=4)
    partial.get(torch.tensor([0, 1]), x[:2])
    partial.get(torch.tensor([1, 2]), x[1:3])            # sample 1 cached, sample 2 new
    assert (partial.computed, partial.hits) == (3, 1)


def test_training_on_cached_prefix_outputs_equals_the_frozen_model():
    """The active layers trained on the cache get the gradients of the whole model with the prefix frozen."""
    model = _model()
    layers = list(model.as_sequential())
    freeze(layers[:2])
    reference = copy.deepcopy(model)
    x, y = torch.randint(0, 64, (4, 16)), torch.randint(0, 64, (4, 16))
    lm_loss(reference(x), y).backward()
    active = nn.Sequential(*layers[2:])
    cache = ActivationCache(nn.Sequential(*layers[:2]), num_samples=4)
    loss = lm_loss(active(cache.get(torch.arange(4), x)), y)
    loss.backward()
    assert loss.item() == pytest.approx(lm_loss(reference(x), y).item(), abs=1e-6)
    for p, r in zip(active.parameters(), nn.Sequential(*list(reference.as_sequential())[2:]).parameters()):
        torch.testing.assert_close(p.grad, r.grad)
    assert all(p.grad is None for p in nn.Sequential(*layers[:2]).parameters())


@pytest.mark.slow
@pytest.mark.alone
def test_real_frozen_and_repacked_pipelines_match_the_sequential_model():
    from course_lib.experiments import launch
    from course_lib.experiments.workers.pipeline_freeze_run import FreezeRun

    p, m = 2, 4
    r = FreezeRun.from_dict(launch.run(
        "course_lib.experiments.workers.pipeline_freeze_run", nproc=p, timeout=300, env={"COURSE_DIST_BACKEND": "gloo"},
        args=["--frozen-stages", "1", "--microbatches", str(m), "--t-forward-ms", "30", "--t-backward-ms", "60",
              "--repeats", "2"]))
    assert r.grad_max_abs_diff < 1e-5 and r.frozen_grads_none
    assert r.loss == pytest.approx(r.loss_reference, abs=1e-5)
    counts = collections.defaultdict(collections.Counter)
    for s, op, _, n in r.counted_ops:
        counts[(s, op)].update(n)
    assert set(counts) == {(0, "F"), (1, "F"), (1, "B")}                 # the frozen stage runs no backward
    assert not [name for name in counts[(0, "F")] if "backward" in name]  # and its forwards record none
    assert r.sent_messages == (p - 1) * m                                 # activations only: no gradient back
    assert r.peak_activation_bytes[0] == 0 < r.peak_activation_bytes[1]   # nothing saved on the frozen stage
    assert abs(r.bubble_measured - r.bubble_simulated) <= 0.05
    # repacked: 2 modules of 4 active, on 1 stage; the freed rank a second replica
    assert (r.stages, r.replicas) == (1, 2)
    assert r.repacked_grad_max_abs_diff < 1e-5
    assert r.repacked_loss == pytest.approx(r.loss_reference, abs=1e-5)
    assert r.cache_samples == (m // 2) * 2 and r.cache_computed == r.cache_samples   # computed once ...
    assert r.cache_hits == r.cache_samples                                           # ... read in the repeat
    assert r.cache_bytes == r.cache_samples * 16 * 32 * 4
    assert r.repacked_makespan_s < r.makespan_s
