"""Pipeline schedules, the simulator, the Gantt chart, and one real multi-process run (chapter 08)."""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy

import pytest
import torch
from torch import nn

from course_lib.experiments.clock import CpuClock, CudaClock, clock_for
from course_lib.tools import plots
from course_lib.parallel.pipeline.pipedream import async_order, stash_formula, versions
from course_lib.experiments.pipedream_runs import CountedStash
from course_lib.parallel.pipeline.schedules import (KINDS, OpTiming, bubble_formula, check_schedule, inflight_counts,
                                             interleaved_order, make_schedule, one_f_one_b_order, simulate,
                                             zb_h1_bubble_formula)
from course_lib.parallel.pipeline.executor import (boundary_shapes, message_batches, op_links, run_stage,
                                                   send_releases, split_sequential)
from course_lib.experiments.pipeline_steps import peak_sends_held
from course_lib.experiments.pipeline_meter import OpCounter, metered_stage
from course_lib.experiments.pipeline_model import add_model_args, my_chunks, op_pads, staged
from course_lib.models import lm_loss

GRID = [(p, m) for p in (1, 2, 3, 4, 5, 8) for m in (1, 2, 3, 4, 7, 8, 16, 33)]


# ----- schedules -------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_every_stage_runs_every_op_once(kind):
    for p, m in GRID:
        if kind == "interleaved" and m % p:
            continue  # needs whole groups of p micro-batches (checked below)
        schedule = make_schedule(kind, p, m)
        assert len(schedule) == p
        assert check_schedule(schedule) == (p, m, kind == "zb-h1")


def test_gpipe_is_all_forward_then_all_backward():
    assert make_schedule("gpipe", 2, 3) == [[("F", 0), ("F", 1), ("F", 2), ("B", 0), ("B", 1), ("B", 2)]] * 2


def test_1f1b_phases():
    # stage 0 of 4: three warm-up forwards, then F/B pairs, then three cool-down backwards
    assert one_f_one_b_order(4, 6, 0) == [("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 0), ("F", 4), ("B", 1),
                                          ("F", 5), ("B", 2), ("B", 3), ("B", 4), ("B", 5)]
    # the last stage alternates from the start
    assert one_f_one_b_order(4, 3, 3) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)]
    # fewer micro-batches than stages: all forwards, then all backwards
    assert one_f_one_b_order(4, 2, 0) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]


@pytest.mark.parametrize("p, m", [(0, 4), (4, 0), (-1, 2), (2.0, 4), (2, 1.5), (True, 3)])
def test_invalid_sizes_are_value_errors(p, m):
    with pytest.raises(ValueError, match="positive integer"):
        make_schedule("1f1b", p, m)


def test_unknown_kind_and_bad_stage():
    with pytest.raises(ValueError, match="unknown schedule kind"):
        make_schedule("pipedream", 2, 2)
    with pytest.raises(ValueError, match="stage must be"):
        one_f_one_b_order(2, 4, 2)


# ----- simulator -------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("t_f, t_b", [(1.0, 2.0), (1.0, 1.0), (0.25, 1.5)])
def test_simulated_bubble_is_the_formula(kind, t_f, t_b):
    for p, m in GRID:
        sim = simulate(make_schedule(kind, p, m), t_f, t_b)
        assert sim.bubble_fraction == pytest.approx(bubble_formula(p, m), abs=1e-12), (kind, p, m)
        assert sim.makespan == pytest.approx((m + p - 1) * (t_f + t_b), rel=1e-12)
        assert sim.busy == pytest.approx([m * (t_f + t_b)] * p)


def test_peak_inflight():
    for p, m in GRID:
        assert simulate(make_schedule("gpipe", p, m)).peak_inflight == [m] * p
        assert simulate(make_schedule("1f1b", p, m)).peak_inflight == [min(p - s, m) for s in range(p)]
    assert inflight_counts(one_f_one_b_order(3, 4, 0)) == [1, 2, 3, 2, 3, 2, 1, 0]


def test_zero_bubble_h1():
    """Qi et al. 2024: with t_F = t_B = t_W the idle time is (p-1) t_F, a third of 1F1B's; p in flight per stage."""
    for p, m in GRID:
        if m < p:
            continue
        zb = simulate(make_schedule("zb-h1", p, m), t_forward=1.0, t_backward=2.0)  # B and W take 1.0 each
        assert zb.makespan == pytest.approx(3 * m + p - 1)
        assert zb.bubble_fraction == pytest.approx((p - 1) / (3 * m + p - 1), abs=1e-12)
        assert zb.peak_inflight == [p] * p
        assert zb.bubble_fraction <= bubble_formula(p, m)


def test_op_timings_respect_dependencies():
    sim = simulate(make_schedule("1f1b", 3, 5), 1.0, 2.0)
    end = {(t.op, t.stage, t.microbatch): t.end for t in sim.timings}
    for t in sim.timings:
        assert t.end - t.start == pytest.approx(1.0 if t.op == "F" else 2.0)
        if t.op == "F" and t.stage > 0:
            assert t.start >= end[("F", t.stage - 1, t.microbatch)]
        if t.op == "B":
            assert t.start >= end[("F", t.stage, t.microbatch)]
            if t.stage < 2:
                assert t.start >= end[("B", t.stage + 1, t.microbatch)]
    for s in range(3):  # a stage never runs two ops at once
        ops = sorted((t.start, t.end) for t in sim.timings if t.stage == s)
        assert all(a[1] <= b[0] + 1e-12 for a, b in zip(ops, ops[1:]))


def test_message_time_lengthens_the_critical_path():
    # GPipe's critical path crosses p-1 links forward and p-1 back
    p, m, c = 4, 6, 0.5
    sim = simulate(make_schedule("gpipe", p, m), 1.0, 2.0, t_comm=c)
    assert sim.makespan == pytest.approx((m + p - 1) * 3.0 + 2 * (p - 1) * c)


def test_bad_schedules_are_value_errors():
    with pytest.raises(ValueError, match="deadlocks"):
        simulate([[("B", 0), ("F", 0)]])
    with pytest.raises(ValueError, match="missing"):
        simulate([[("F", 0), ("F", 1), ("B", 0)]])
    with pytest.raises(ValueError, match="with op in"):
        simulate([[("X", 0), ("B", 0)]])
    with pytest.raises(ValueError, match="non-empty"):
        simulate([])
    with pytest.raises(ValueError, match="non-negative"):
        simulate(make_schedule("gpipe", 2, 2), t_forward=-1.0)


def test_gantt_draws_one_row_per_stage():
    sim = simulate(make_schedule("1f1b", 3, 4))
    fig = plots.gantt(sim.timings, 3, "test", time_unit="t_f")
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["stage 0", "stage 1", "stage 2"]
    assert ax.get_xlabel() == "time (t_f)" and ax.get_title() == "test"
    assert len(ax.collections) == len(sim.timings)           # one bar per op
    fig2 = plots.gantt([(0, "F", 0, 0.0, 1.0), (1, "B", 0, 1.0, 3.0)], 2, "tuples")  # tuples work too
    assert len(fig2.axes[0].collections) == 2
    assert isinstance(sim.timings[0], OpTiming)


def test_gantt_legend_names_every_colour_and_shade():
    sim = simulate(make_schedule("interleaved", 2, 4, chunks=2))
    ax = plots.gantt(sim.timings, 2, "interleaved", notes=("a note",)).axes[0]
    handles = ax.get_legend().legend_handles
    labels = [h.get_label() for h in handles]
    assert labels == ["forward (F), chunk a", "forward (F), chunk b", "backward (B), chunk a",
                      "backward (B), chunk b", "number in a bar: micro-batch, letter: the device's chunk", "a note"]
    assert handles[0].get_alpha() == 1.0 and handles[1].get_alpha() < 1.0    # the second chunk: lighter
    assert handles[0].get_facecolor()[:3] == handles[1].get_facecolor()[:3] != handles[2].get_facecolor()[:3]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["device 0", "device 1"]
    assert ax.get_ylabel() == "device (2 model chunks each)"
    zb = plots.gantt(simulate(make_schedule("zb-h1", 2, 2)).timings, 2, "zb", row_label="rank").axes[0]
    assert [h.get_label() for h in zb.get_legend().legend_handles][:3] == [
        "forward (F)", "input gradient (B)", "weight gradient (W)"]
    assert [t.get_text() for t in zb.get_yticklabels()] == ["rank 0", "rank 1"] and zb.get_ylabel() == "rank"


# ----- interleaved 1F1B ------------------------------------------------------------


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("v", [1, 2, 3, 4])
def test_interleaved_bubble_is_v_times_smaller(p, v):
    for m in (p, 2 * p, 4 * p):
        for t_f, t_b in [(1.0, 2.0), (1.0, 1.0), (0.5, 1.5)]:
            sim = simulate(make_schedule("interleaved", p, m, chunks=v), t_f, t_b)
            assert sim.bubble_fraction == pytest.approx(bubble_formula(p, m, chunks=v), abs=1e-12)
            assert sim.makespan == pytest.approx(m * (t_f + t_b) + (p - 1) * (t_f + t_b) / v)


def test_interleaved_order_and_memory():
    # device 0 of 2 with 2 chunks: forwards of group {0, 1} on chunk 0, then on chunk 1, then 1F1B
    assert interleaved_order(2, 4, 0, chunks=2)[:6] == [("F", 0, 0), ("F", 1, 0), ("F", 0, 1), ("F", 1, 1),
                                                        ("F", 2, 0), ("B", 0, 1)]
    # one chunk per device is plain 1F1B
    for p, m in [(2, 4), (4, 8), (3, 3)]:
        assert [o[:2] for o in make_schedule("interleaved", p, m, chunks=1)[0]] == one_f_one_b_order(p, m, 0)
    # the first device holds p (1 + (p-1)/(p v)) micro-batches' activations (Korthikanti et al. 2022, 4.2.3)
    for p, v in [(2, 2), (4, 2), (4, 4), (8, 2)]:
        sim = simulate(make_schedule("interleaved", p, 4 * p, chunks=v))
        assert sim.peak_inflight[0] == pytest.approx(p * (1 + (p - 1) / (p * v)))
        assert sim.peak_inflight[0] > simulate(make_schedule("1f1b", p, 4 * p)).peak_inflight[0]


def test_interleaved_timings_follow_virtual_stages():
    p, v = 3, 2
    sim = simulate(make_schedule("interleaved", p, 6, chunks=v), 1.0, 2.0, t_comm=0.1)
    end = {(t.op, t.chunk * p + t.stage, t.microbatch): t.end for t in sim.timings}
    for t in sim.timings:
        vs = t.chunk * p + t.stage
        assert t.end - t.start == pytest.approx((1.0 if t.op == "F" else 2.0) / v)
        if t.op == "F" and vs > 0:
            assert t.start >= end[("F", vs - 1, t.microbatch)] + 0.1 - 1e-12
        if t.op == "B" and vs < p * v - 1:
            assert t.start >= end[("B", vs + 1, t.microbatch)] + 0.1 - 1e-12


def test_interleaved_bad_sizes():
    with pytest.raises(ValueError, match="multiple of 3"):
        make_schedule("interleaved", 3, 4, chunks=2)
    with pytest.raises(ValueError, match="chunks must be"):
        interleaved_order(2, 4, 0, chunks=0)
    with pytest.raises(ValueError, match="pass 2 modules"):
        run_stage(nn.Linear(2, 2), make_schedule("interleaved", 2, 2), 0, ((1, 2), torch.float32))
    with pytest.raises(ValueError, match="at least 2 ranks"):
        run_stage([nn.Linear(2, 2)] * 2, make_schedule("interleaved", 1, 2), 0, [((1, 2), torch.float32)] * 2)


def test_zb_h1_simulated_bubble_is_the_papers_formula():
    """Qi et al. 2024: ZB-H1 idles (p-1)(T_F + T_B - T_W) per stage (when T_W <= T_F: the reserve fits)."""
    for p, m in GRID:
        if m < p:
            continue
        for t_f, t_b, t_w in [(1.0, 2.0, None), (1.0, 2.0, 0.8), (1.0, 1.5, 0.5), (1.0, 3.0, 1.0)]:
            sim = simulate(make_schedule("zb-h1", p, m), t_f, t_b, t_w)
            assert sim.bubble_fraction == pytest.approx(zb_h1_bubble_formula(p, m, t_f, t_b, t_w), abs=1e-12)
    assert zb_h1_bubble_formula(4, 8) == pytest.approx(3 / (3 * 8 + 3))          # T_F = T_B = T_W


# ----- executor pieces that need no processes --------------------------------------


def test_split_sequential_and_shapes():
    seq = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    parts = split_sequential(seq, 2)
    assert [len(p) for p in parts] == [3, 2]
    assert parts[0][0] is seq[0]                               # shared, not copied
    assert boundary_shapes(parts, torch.zeros(5, 4)) == [((5, 4), torch.float32), ((5, 8), torch.float32)]
    with pytest.raises(ValueError, match="cannot cut"):
        split_sequential(seq, 6)


def test_staged_model_cuts_the_model_and_takes_the_sequential_step():
    parser = argparse.ArgumentParser()
    add_model_args(parser)
    a = parser.parse_args(["--t-forward-ms", "10", "--t-backward-ms", "30"])
    ref = staged(a, 4, 3, frozen=1)
    assert len(ref.stages) == len(ref.refs) == 4 and [x.shape for x in ref.xs] == [(a.microbatch_size, a.seq_len)] * 3
    assert all(p.grad is None and not p.requires_grad for p in ref.refs[0].parameters())   # frozen in both
    assert all(p.grad is not None for r in ref.refs[1:] for p in r.parameters())
    assert all(p.grad is None for s in ref.stages for p in s.parameters())                 # left to the pipeline
    assert ref.loss == pytest.approx(lm_loss(ref.logits, ref.y).item())
    assert my_chunks(list(range(8)), rank=1, world=4, v=2) == [1, 5]
    assert op_pads(a, split=True) == pytest.approx({"F": 0.01, "B": 0.015, "W": 0.015})
    assert op_pads(parser.parse_args(["--t-forward-ms", "0"])) is None


def test_run_stage_checks_its_inputs_before_communicating():
    stage, two = nn.Linear(2, 2), [[("F", 0), ("B", 0)]] * 2
    with pytest.raises(ValueError, match="first stage needs"):
        run_stage(stage, two, rank=0, in_shape=((1, 2), torch.float32))
    with pytest.raises(ValueError, match="last stage needs"):
        run_stage(stage, two, rank=1, in_shape=((1, 2), torch.float32))
    with pytest.raises(TypeError, match="after_backward"):    # PipeDream runs a loop of its own (run_pipedream)
        run_stage(stage, make_schedule("zb-h1", 2, 2), 0, ((1, 2), torch.float32), inputs=[torch.zeros(1, 2)] * 2,
                  after_backward=lambda i: None)


def test_split_backward_gives_the_same_gradients():
    """B (input gradient) then W (weight gradient, deferred) add up to the plain backward's gradients."""
    xs, ys = [torch.randn(3, 4) for _ in range(4)], [torch.randn(3, 2) for _ in range(4)]
    grads = {}
    for kind in ("1f1b", "zb-h1"):
        torch.manual_seed(0)
        stage = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        run = metered_stage(stage, make_schedule(kind, 1, 4), 0, ((3, 4), torch.float32), inputs=xs, targets=ys,
                            loss_fn=nn.functional.mse_loss)
        grads[kind] = [p.grad.clone() for p in stage.parameters()]
        assert [op for op, *_ in run.busy] == [op for op, *_ in make_schedule(kind, 1, 4)[0]]
        assert run.peak_inflight == 1
    for a, b in zip(grads["1f1b"], grads["zb-h1"]):
        torch.testing.assert_close(a, b)


def _stage_and_input(s: int, p: int = 3):
    """Stage ``s`` of the chapter's TinyTransformer cut into ``p`` stages, a copy of it, and its input."""
    from course_lib.models import TinyTransformer
    torch.manual_seed(0)
    model = TinyTransformer(vocab=64, d_model=32, n_heads=2, n_layers=2 * p - 2, max_len=16)
    stages = split_sequential(model.as_sequential(), p)
    h = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        for st in stages[:s]:
            h = st(h)
    return stages[s], copy.deepcopy(stages[s]), h


@pytest.mark.parametrize("s", [0, 1, 2])
def test_split_backward_runs_each_op_of_one_backward_once(s):
    """B + W run exactly the ATen ops of one backward(): nothing computed twice, no weight product in B."""
    from course_lib.parallel.pipeline.split_backward import backward_input, backward_weight, recording_activations
    stage, twin, h = _stage_and_input(s)
    x = h if s == 0 else h.clone().requires_grad_()
    with recording_activations(stage) as acts:
        y = stage(x)
    g = torch.randn_like(y)
    with OpCounter(views=True) as b:
        dx, pending = backward_input(y, g, x, acts, list(stage.parameters()))
    with OpCounter(views=True) as w:
        backward_weight(pending)
    x1 = h if s == 0 else h.clone().requires_grad_()
    y1 = twin(x1)
    with OpCounter(views=True) as one:
        y1.backward(g)
    # views counted too: backward() stores the input's gradient in x.grad with one detach; B returns it instead
    stored = {"detach": 1} if s > 0 else {}
    assert b.counts + w.counts + collections.Counter(stored) == one.counts, (b.counts, w.counts, one.counts)
    linears = sum(isinstance(m, nn.Linear) for m in stage.modules())
    assert b.counts["mm"] == w.counts["mm"] == linears                  # dX = dY A in B, dA = dY^T X in W
    assert w.counts["native_layer_norm_backward"] == 2 * b.counts["native_layer_norm_backward"]  # its 2 weights
    assert not {"bmm", "gelu_backward", "_softmax_backward_data"} & set(w.counts)   # no activation chain in W
    assert "embedding_dense_backward" not in b.counts                    # a lookup's backward is weight side
    for p_, q in zip(stage.parameters(), twin.parameters()):
        torch.testing.assert_close(p_.grad, q.grad)
    if s > 0:
        torch.testing.assert_close(dx, x1.grad)
    else:
        assert dx is None                                                # stage 0: the input is data


def test_split_backward_in_the_executor_counts_and_grads():
    """On one rank the whole model is stage 0: ZB-H1's B_i + W_i equal 1F1B's B_i, op for op, and the gradients too.

    (Views left out: the executor's activation count unpacks saved tensors through a hook, one view each time.)
    """
    from course_lib.models import TinyTransformer, lm_loss
    xs = [torch.randint(0, 64, (2, 16)) for _ in range(3)]
    ys = [torch.randint(0, 64, (2, 16)) for _ in range(3)]
    runs, grads = {}, {}
    for kind in ("1f1b", "zb-h1"):
        torch.manual_seed(0)
        model = TinyTransformer(vocab=64, d_model=32, n_heads=2, n_layers=2, max_len=16)
        runs[kind] = metered_stage(model.as_sequential(), make_schedule(kind, 1, 3), 0, ((2, 16), torch.int64),
                                   inputs=xs, targets=ys, loss_fn=lm_loss, count_ops=True)
        grads[kind] = [p.grad.clone() for p in model.parameters()]
    for a, b in zip(grads["1f1b"], grads["zb-h1"]):
        torch.testing.assert_close(a, b)
    counts = {kind: {(op, i): collections.Counter(n) for (op, i, *_), n in zip(r.busy, r.op_counts)}
              for kind, r in runs.items()}
    for i in range(3):
        zb, one = counts["zb-h1"], counts["1f1b"]
        assert zb[("B", i)] + zb[("W", i)] == one[("B", i)], i
        assert zb[("F", i)] == one[("F", i)]
        assert zb[("B", i)]["mm"] == zb[("W", i)]["mm"] > 0


def test_split_backward_refuses_a_weight_used_twice():
    from course_lib.parallel.pipeline.split_backward import backward_input, recording_activations
    layer = nn.Linear(4, 4)
    stage = nn.Sequential(layer, nn.Tanh(), layer)                       # the same weight in two ops
    x = torch.randn(2, 4, requires_grad=True)
    with recording_activations(stage) as acts:
        y = stage(x)
    with pytest.raises(ValueError, match="used by two ops"):
        backward_input(y, torch.ones_like(y), x, acts, list(stage.parameters()))


# ----- sends are freed as soon as the peer has them ------------------------------------


def test_sends_are_released_once_the_peer_has_them():
    """A stage keeps a sent tensor only until a later message proves the peer took it: about p, not m."""
    for p, m in [(2, 8), (3, 6), (4, 8), (4, 16), (4, 32)]:
        for s in range(p):
            bound = peak_sends_held(make_schedule("1f1b", p, m), s)
            assert bound <= min(p - s, m) + 1, (p, m, s)          # whatever m: the stage's in-flight count + 1
            assert bound == (min(p, m) if s == 0 else min(p - s + 1, m)), (p, m, s)   # the docstring's bound
            assert peak_sends_held(make_schedule("zb-h1", p, m), s) <= min(p - s, m) + 1
            if 0 < s:                                             # GPipe's stages hold all m anyway
                assert peak_sends_held(make_schedule("gpipe", p, m), s) == m
    # stage 0 of 1F1B on 2 stages: F0 F1 B0 F2 B1 ... its activation send of F0 is freed when B0's gradient arrives
    order = make_schedule("1f1b", 2, 4)[0]
    assert order[:3] == [("F", 0), ("F", 1), ("B", 0)]
    assert send_releases(make_schedule("1f1b", 2, 4), 0)[0] == 2


@pytest.mark.parametrize("p, v", [(2, 2), (3, 2), (4, 2), (2, 3), (4, 3)])
def test_interleaved_messages_pair_up(p, v):
    """Every send of an interleaved schedule has one receive with the same (peer, tag) on its peer."""
    schedule = make_schedule("interleaved", p, 2 * p, chunks=v)
    sends, recvs = [], []
    for rank, order in enumerate(schedule):
        for recv, send in (op_links(o, rank, p, v) for o in order):
            if send:
                sends.append((rank, *send))
            if recv:
                recvs.append((recv[0], rank, recv[1]))           # (sender, receiver, tag)
    assert len(sends) == len(set(sends)) == 2 * (p * v - 1) * 2 * p    # 2 (p v - 1) crossings per micro-batch
    assert sorted(sends) == sorted(recvs)
    for rank in range(p):                                       # and none waits on itself
        assert all(l is None or l[0] != rank for o in schedule[rank] for l in op_links(o, rank, p, v))


# ----- PipeDream: asynchronous 1F1B with weight stashing ---------------------------------


def test_pipedream_versions_staleness_and_stash():
    for p in (2, 3, 4, 8):
        for s in range(p):
            ver = versions(async_order(p, 4 * p, s))
            assert ver.staleness == p - s - 1                   # updates between a forward and its own update
            assert ver.peak_stashed == stash_formula(p, s) == p - s
            assert all(ver.backward[i] == i for i in ver.backward)   # one update per micro-batch before it


def _two_stashed_forwards(stash: bool):
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))   # the second weight is saved for backward
    ws = CountedStash(layer, torch.optim.SGD(layer.parameters(), lr=0.5), stash=stash)
    xs = [torch.randn(4, 3) for _ in range(2)]
    outs = []
    for i, x in enumerate(xs):                                  # two forwards in flight, as on stage 0 of 2
        w = ws.weights(i)
        outs.append(torch.func.functional_call(layer, w, (x,)) if w is not None else layer(x))
    return layer, ws, xs, outs


def test_weight_stash_gives_the_gradient_at_the_forwards_version():
    layer, ws, xs, outs = _two_stashed_forwards(stash=True)
    w0 = {n: p.detach().clone().requires_grad_() for n, p in layer.named_parameters()}
    outs[0].sum().backward()
    ws.apply(0)                                                 # an update between micro-batch 1's F and B
    assert not torch.equal(layer[2].weight, w0["2.weight"])
    outs[1].sum().backward()                                    # runs on the stashed version 0
    expected = torch.autograd.grad(torch.func.functional_call(layer, w0, (xs[1],)).sum(), list(w0.values()))
    grads = [ws.copies[1][1][n].grad for n in w0]
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e)
    ws.apply(1)
    assert ws.used == [(0, 0, 0), (1, 0, 1)] and ws.peak_copies == 2 and not ws.copies


def test_without_stashing_autograd_refuses_the_mixed_versions():
    _, ws, _, outs = _two_stashed_forwards(stash=False)
    outs[0].sum().backward()
    ws.apply(0)                                                 # updates the weights micro-batch 1 saved
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        outs[1].sum().backward()


# ----- messages: batched so that NCCL cannot deadlock --------------------------------


def _nccl_completes(groups_per_rank: list[list[list[tuple[str, int]]]]) -> bool:
    """Play each rank's message groups with NCCL's rules; False if they deadlock.

    A rank's groups run one after the other on its stream; a group finishes
    when each of its messages has met its partner in the peer's running group.
    NCCL ignores tags and pairs the messages of a (sender, receiver) pair in
    order. Messages are ``("send" | "recv", peer)``.
    """
    p = len(groups_per_rank)
    current = [0] * p                                      # the running group of each rank
    done = [[set() for _ in groups] for groups in groups_per_rank]

    def nth(rank, g, j):
        kind, peer = groups_per_rank[rank][g][j]
        key = (rank, peer) if kind == "send" else (peer, rank)
        n = sum(1 for gg in range(g + 1) for jj, (k2, q2) in enumerate(groups_per_rank[rank][gg])
                if (gg < g or jj < j) and k2 == kind and q2 == peer)
        return key, n

    progress = True
    while progress:
        progress = False
        for r in range(p):
            while current[r] < len(groups_per_rank[r]) and \
                    len(done[r][current[r]]) == len(groups_per_rank[r][current[r]]):
                current[r] += 1
                progress = True
            if current[r] == len(groups_per_rank[r]):
                continue
            g = current[r]
            for j, (kind, peer) in enumerate(groups_per_rank[r][g]):
                if j in done[r][g] or kind != "send" or current[peer] >= len(groups_per_rank[peer]):
                    continue
                key, n = nth(r, g, j)
                pg = current[peer]                         # the partner must be in the peer's running group
                for jj, (k2, q2) in enumerate(groups_per_rank[peer][pg]):
                    if k2 == "recv" and q2 == r and jj not in done[peer][pg] and nth(peer, pg, jj) == (key, n):
                        done[r][g].add(j)
                        done[peer][pg].add(jj)
                        progress = True
    return all(c == len(g) for c, g in zip(current, groups_per_rank))


def _batched_groups(kind: str, p: int, m: int) -> list:
    out = []
    for rank, order in enumerate(make_schedule(kind, p, m)):
        groups = [[("send", s[0]) for s in sends] + [("recv", r[0]) for r in recvs]
                  for sends, recvs in message_batches(order, rank, p)]
        out.append([g for g in groups if g])
    return out


def _one_by_one_groups(kind: str, p: int, m: int) -> list:
    """Each receive before its op, each send after it, every message its own group (plain isend / recv)."""
    out = []
    for rank, order in enumerate(make_schedule(kind, p, m)):
        groups = []
        for op in order:
            recv, send = op_links(op, rank, p)
            groups += ([[("recv", recv[0])]] if recv else []) + ([[("send", send[0])]] if send else [])
        out.append(groups)
    return out


def test_message_batches_pair_each_send_with_the_next_receive():
    # stage 1 of 3 under 1F1B, m = 2: F0 F1 B0 B1 (one warm-up forward)
    order = make_schedule("1f1b", 3, 2)[1]
    assert order == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]
    assert message_batches(order, 1, 3) == [
        ([], [(0, 0)]),                # receive F0's activation
        ([(2, 0)], [(0, 2)]),          # send it on, receive F1's
        ([(2, 2)], [(2, 1)]),          # send F1's on, receive B0's gradient from the next stage
        ([(0, 1)], [(2, 3)]),          # send B0's gradient back, receive B1's
        ([(0, 3)], []),                # send B1's back
    ]
    assert message_batches([("F", 0), ("B", 0)], 0, 1) == [([], []), ([], []), ([], [])]  # one stage: none


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_batched_messages_cannot_deadlock_on_nccl(kind):
    for p, m in GRID:
        if p > 1:
            assert _nccl_completes(_batched_groups(kind, p, m)), (kind, p, m)


def test_one_message_per_call_deadlocks_1f1b_on_nccl():
    # what the checker exists to catch: neighbours that both send first, then receive from each other
    assert not _nccl_completes(_one_by_one_groups("1f1b", 2, 2))
    assert _nccl_completes(_one_by_one_groups("gpipe", 2, 2))  # GPipe's messages never cross


# ----- one real run: 3 processes, both schedules, both executors --------------------


@pytest.mark.slow
@pytest.mark.alone
def test_real_pipeline_matches_sequential_and_formula():
    from course_lib.experiments import launch
    from course_lib.experiments.workers.pipeline_run import PipelineResult

    p, m = 3, 6
    result = PipelineResult.from_dict(launch.run(
        "course_lib.experiments.workers.pipeline_run", nproc=p, timeout=300, env={"COURSE_DIST_BACKEND": "gloo"},
        args=["--api", "both", "--schedules", "gpipe,1f1b,zb-h1,interleaved", "--microbatches", str(m),
              "--t-forward-ms", "50", "--t-backward-ms", "100", "--repeats", "2", "--unpadded", "1f1b,zb-h1"]))
    assert result.world == p and result.backend == "gloo" and result.clock == "perf_counter"
    # counted on every rank: ZB-H1's B + W run exactly 1F1B's backward's ops, micro-batch by micro-batch
    counts = {r.kind: {(s, op, i): collections.Counter(n) for s, op, i, _, n in r.op_counts} for r in result.counted}
    zb, one = counts["zb-h1"], counts["1f1b"]
    assert {k for k in zb if k[1] == "W"} == {(s, "W", i) for s in range(p) for i in range(p)}   # m = p
    for s, op, i in one:
        if op == "B":
            assert zb[(s, "B", i)] + zb[(s, "W", i)] == one[(s, "B", i)], (s, i)
            assert zb[(s, "B", i)]["mm"] == zb[(s, "W", i)]["mm"] > 0 and zb[(s, "W", i)]["bmm"] == 0
    assert [r.kind for r in result.unpadded] == ["1f1b", "zb-h1"]
    for run in result.unpadded:
        assert not run.padded and run.grad_max_abs_diff < 1e-5 and run.output_max_abs_diff < 1e-5, run.kind
        # set beside the textbook t_b = 2 t_f, not beside the padded runs' t_b with t_f = 1
        want = zb_h1_bubble_formula(p, run.m, 1.0, 2.0) if run.kind == "zb-h1" else bubble_formula(p, run.m)
        assert run.bubble_formula == pytest.approx(want) and run.bubble_simulated == pytest.approx(want), run.kind
    runs = {r.kind: r for r in result.handmade}
    for run in result.handmade:
        assert run.output_max_abs_diff < 1e-5 and run.grad_max_abs_diff < 1e-5, run
        assert abs(run.bubble_measured - run.bubble_formula) <= 0.05, (run.kind, run.bubble_measured_all)
        assert run.bubble_simulated == pytest.approx(run.bubble_formula, abs=1e-12)
        assert run.peak_inflight == [round(c * run.chunks) for c in run.peak_inflight_simulated]
        assert run.peak_sends_held == run.peak_sends_bound, run.kind   # what the schedule allows, no more
        ops = 3 if run.kind == "zb-h1" else 2
        assert len(run.timings) == ops * m * p * run.chunks
    assert runs["gpipe"].peak_inflight == [m] * p
    assert runs["1f1b"].peak_inflight == [min(p - s, m) for s in range(p)]
    assert runs["zb-h1"].peak_inflight == [min(p, m)] * p                # W holds activations longer
    for kind in ("1f1b", "zb-h1"):                                       # sent tensors: about p, not m
        assert runs[kind].peak_sends_held == [min(p - s, m) + (s > 0) for s in range(p)], kind
    assert runs["interleaved"].sent_messages == 2 * (p * 2 - 1) * m      # 2 (p v - 1) per micro-batch
    assert runs["1f1b"].sent_messages == 2 * (p - 1) * m
    gp, ofob = runs["gpipe"], runs["1f1b"]
    assert gp.peak_activation_bytes[0] == pytest.approx(2 * ofob.peak_activation_bytes[0])  # m / p = 2
    assert {r.kind for r in result.torch_api} == {"gpipe", "1f1b", "zb-h1", "interleaved"}
    for run in result.torch_api:
        assert run.output_max_abs_diff < 1e-5 and run.grad_max_abs_diff < 1e-5, run
        assert run.loss == pytest.approx(run.loss_reference, abs=1e-5), run
    assert {r.schedule for r in result.torch_api} >= {"ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble"}


@pytest.mark.slow
# (3, 2): m < p, so stage 0 never reaches a steady state; chapter 08 runs m > p (tests/test_nb_08.py asserts it)
@pytest.mark.parametrize("p, m", [(3, 2)])
def test_straight_line_gpipe_and_1f1b_on_p_ranks_equal_one_process(p, m):
    from course_lib.experiments import launch
    from course_lib.experiments.workers.pipeline_run import PipelineResult

    result = PipelineResult.from_dict(launch.run(
        "course_lib.experiments.workers.pipeline_run", nproc=p, timeout=120, env={"COURSE_DIST_BACKEND": "gloo"},
        args=["--schedules", "", "--straight", "gpipe,1f1b", "--microbatches", str(m)]))
    assert [(r.kind, r.p, r.m) for r in result.straight] == [("gpipe", p, m), ("1f1b", p, m)]
    assert not result.handmade and not result.torch_api            # only the straight-line steps ran
    for run in result.straight:
        assert run.grad_max_abs_diff < 1e-5 and run.loss_abs_diff < 1e-5, run


@pytest.mark.slow
@pytest.mark.alone
def test_real_pipedream_stashes_p_minus_s_versions_and_removes_the_flush():
    from course_lib.experiments import launch
    from course_lib.experiments.workers.pipedream_run import PipeDreamResult

    p, n, m = 3, 12, 6
    result = PipeDreamResult.from_dict(launch.run(
        "course_lib.experiments.workers.pipedream_run", nproc=p, timeout=300, env={"COURSE_DIST_BACKEND": "gloo"},
        args=["--microbatches", str(n), "--flush-m", str(m), "--seeds", "0", "--t-forward-ms", "50",
              "--t-backward-ms", "100", "--repeats", "3"]))   # the fastest of 3: its bubble error is the largest here
    run = result.seeds[0]
    assert run.peak_copies == [p - s for s in range(p)]
    assert run.peak_stash_bytes == [(p - s) * b for s, b in enumerate(run.stage_param_bytes)]
    assert [max(u - f for _, f, u in used) for used in run.used] == [p - s - 1 for s in range(p)]
    assert [len(used) for used in run.used] == [n] * p                # one update per micro-batch on every stage
    assert len(run.async_losses) == len(run.sync_losses) == n
    assert run.async_losses[0] == pytest.approx(run.sync_losses[0], abs=1e-5)   # nothing stale yet
    timed = {t.kind: t for t in result.timed}
    assert timed["async"].bubble_measured == pytest.approx(bubble_formula(p, n), abs=0.05), timed["async"]
    assert timed["flush"].bubble_measured == pytest.approx(bubble_formula(p, m), abs=0.05), timed["flush"]
    assert timed["async"].peak_inflight == [p - s for s in range(p)]
    assert timed["async"].sent_messages == timed["flush"].sent_messages == 2 * (p - 1) * n


# ----- clocks: the CPU's, and CUDA events on a GPU ----------------------------------


class _FakeGpu:
    """A stand-in for torch.cuda: one timeline, advanced by _sleep; events stamp it when recorded."""

    rate = 2e9                                    # cycles per second of the pretend GPU

    def __init__(self, monkeypatch):
        self.now = 0.0
        gpu = self

        class Event:
            def __init__(self, enable_timing=False):
                assert enable_timing, "timing events need enable_timing=True"
                self.t = None

            def record(self, stream=None):
                self.t = gpu.now

            def synchronize(self):
                pass

            def elapsed_time(self, other):
                return (other.t - self.t) * 1e3  # ms, as CUDA reports it

        class Stream:
            def __init__(self, device=None):
                pass

            def wait_event(self, event):
                pass

            def wait_stream(self, stream):
                pass

        @contextlib.contextmanager
        def same(*args, **kwargs):
            yield

        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
        monkeypatch.setattr(torch.cuda, "stream", same)
        monkeypatch.setattr(torch.cuda, "device", same)
        monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: setattr(gpu, "now", gpu.now + cycles / gpu.rate))


def test_clock_for_picks_cuda_events_on_a_gpu(monkeypatch):
    assert isinstance(clock_for("cpu"), CpuClock)
    gpu = _FakeGpu(monkeypatch)
    clock = clock_for("cuda:0")
    assert isinstance(clock, CudaClock) and clock.name == "cuda events"
    assert clock.cycles_per_s == pytest.approx(_FakeGpu.rate), "calibrated against the events"
    zero = clock.start()
    began = clock.mark()
    gpu.now += 0.003                               # the op's own work: 3 ms on the GPU
    token = clock.pad(began, 0.010)                # padded to 10 ms
    end = clock.mark()
    assert clock.elapsed(began, end) == pytest.approx(0.003 + 0.010)  # the fake runs the spin after the work
    assert clock.seconds(end) == pytest.approx(clock.elapsed(zero, end))
    assert clock.overran(token) is False


def test_cpu_clock_pads_by_sleeping():
    clock = CpuClock()
    began = clock.mark()
    token = clock.pad(began, 0.02)
    assert clock.elapsed(began, clock.mark()) >= 0.02 and not clock.overran(token)
    assert clock.overran(clock.pad(clock.mark() - 1.0, 0.02)), "work longer than the pad is an overrun"


class _TickClock(CpuClock):
    """Marks are 0, 1, 2, ...: shows which times run_stage takes from its clock."""

    name = "ticks"

    def __init__(self):
        self.t = -1

    def mark(self):
        self.t += 1
        return float(self.t)

    def pad(self, began, seconds):
        return False


def test_run_stage_times_ops_with_its_clock():
    stage = nn.Linear(2, 2)
    xs, ys = [torch.randn(3, 2) for _ in range(2)], [torch.randn(3, 2) for _ in range(2)]
    run = metered_stage(stage, make_schedule("1f1b", 1, 2), 0, ((3, 2), torch.float32), inputs=xs, targets=ys,
                        loss_fn=nn.functional.mse_loss, op_seconds={"F": 0.0, "B": 0.0}, clock=_TickClock())
    # start, then (began, end) for each of the four ops, then the end after the last messages
    assert run.clock == "ticks" and run.start == 0.0 and run.end == 9.0
    assert [(op, i, b, e) for op, i, b, e in run.busy] == [("F", 0, 1.0, 2.0), ("B", 0, 3.0, 4.0),
                                                           ("F", 1, 5.0, 6.0), ("B", 1, 7.0, 8.0)]
    assert len(run.losses) == 2 and run.peak_inflight == 1


@pytest.mark.parametrize("pad_ms", [5.0, 20.0])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_clock_pads_on_the_gpu(pad_ms):
    clock = CudaClock("cuda")
    x = torch.randn(64, 64, device="cuda")
    began = clock.mark()
    y = x @ x                                      # microseconds: far below the pad
    token = clock.pad(began, pad_ms / 1e3)
    end = clock.mark()
    assert clock.elapsed(began, end) == pytest.approx(pad_ms / 1e3, rel=0.1)
    assert not clock.overran(token) and y.shape == (64, 64)
    began = clock.mark()
    for _ in range(200):                           # far longer than 1 ms of padding
        y = y @ x
    assert clock.overran(clock.pad(began, 1e-3))


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (one stage per GPU, NCCL)")
def test_real_pipeline_on_nccl_matches_and_times_with_cuda_events():
    from course_lib.experiments import launch
    from course_lib.experiments.workers.pipeline_run import PipelineResult

    p, m = 2, 8
    result = PipelineResult.from_dict(launch.run(
        "course_lib.experiments.workers.pipeline_run", nproc=p, timeout=300, env={"COURSE_DIST_BACKEND": "nccl"},
        args=["--api", "handmade", "--schedules", "gpipe,1f1b", "--microbatches", str(m),
              "--t-forward-ms", "20", "--t-backward-ms", "40"]))
    assert result.clock == "cuda events"
    for run in result.handmade:
        assert run.grad_max_abs_diff < 1e-4 and run.overruns == 0, run.kind
        assert abs(run.bubble_measured - bubble_formula(p, m)) <= 0.05, (run.kind, run.bubble_measured)


# ----- exercise 08, question 5: honest wrong answers fail the visible tests ---------------

_WRONG_VERSIONS = {
    "the update of its own backward counted as stale": ("            stale = max(stale, version - forward[i])\n"
                                                         "            alive.discard(i)\n            version += 1",
                                                         "            version += 1\n"
                                                         "            stale = max(stale, version - forward[i])\n"
                                                         "            alive.discard(i)"),
    "the live weights counted as a stashed copy": ("peak = max(peak, len(alive))", "peak = max(peak, len(alive) + 1)"),
}


@pytest.mark.slow
@pytest.mark.parametrize("mistake", sorted(_WRONG_VERSIONS))
def test_exercise_weight_versions_catches_honest_mistakes(mistake, tmp_path):
    import adversarial
    from course_lib.tools.grading.grade import grade_notebook

    stem, gid = "08_pipeline_parallel", "q5_weight_versions"
    right = adversarial.solution_source(stem, gid)
    old, new = _WRONG_VERSIONS[mistake]
    assert old in right
    path = adversarial.Attack("mistake", stem, honest=0, what=mistake,
                              cells={gid: right.replace(old, new)}).write(tmp_path)
    result = grade_notebook(path, timeout=60, hidden=False)   # what `course check` runs: the visible tests only
    q = next(q for q in result.questions if q.name == "q5_weight_versions_test")
    assert q.status == "failed", (mistake, q)
