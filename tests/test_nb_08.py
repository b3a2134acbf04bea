"""The claims of notebooks/08_pipeline_parallel.ipynb, measured at the test profile."""

from __future__ import annotations

import pytest

from conftest import notebook_claims

pytestmark = [pytest.mark.notebook, pytest.mark.slow]


@pytest.fixture(scope="module")
def claims() -> dict:
    return notebook_claims("08")


def test_bubble_formula_figures(claims):
    assert claims["ch08/bubble_naive"] == pytest.approx(0.75)           # p = 4, m = 1: (p-1)/p
    assert claims["ch08/bubble_at_m_4p"] < 0.2                           # GPipe's m = 4p advice


def test_simulator_equals_formula_exactly(claims):
    assert claims["ch08/sim_bubble_max_abs_error"] < 1e-12


def test_inflight_gpipe_m_and_1f1b_p_minus_s(claims):
    gpipe, ofob = claims["ch08/sim_peak_inflight_gpipe"], claims["ch08/sim_peak_inflight_1f1b"]
    p, m = len(gpipe), gpipe[0]
    assert gpipe == [m] * p
    assert ofob == [min(p - s, m) for s in range(p)]
    assert claims["ch08/exec_peak_inflight_gpipe"] == gpipe              # the real run holds what the simulator says
    assert claims["ch08/exec_peak_inflight_1f1b"] == ofob


def test_zero_bubble_third_of_1f1b_idle(claims):
    assert claims["ch08/zb_idle_ratio_to_1f1b"] == pytest.approx(1 / 3, abs=1e-9)


def test_interleaving_divides_the_idle_time_by_v(claims):
    p = len(claims["ch08/sim_peak_inflight_gpipe"])
    assert claims["ch08/interleaved_bubble_max_abs_error"] < 1e-12      # (p-1)/(v m + p - 1)
    for v in (1, 2, 4):
        assert claims[f"ch08/interleaved_idle_ratio_v{v}"] == pytest.approx(1 / v, abs=1e-9)
        # the first device holds p (1 + (p-1)/(p v)) micro-batches' activations (Korthikanti et al. 2022)
        held = p * (1 + (p - 1) / (p * v)) if v > 1 else p               # v = 1 is plain 1F1B
        assert claims[f"ch08/interleaved_stage0_inflight_v{v}"] == pytest.approx(held)


def test_pipelines_equal_the_sequential_model(claims):
    for key in ("byhand_grad_max_abs_diff", "exec_output_max_abs_diff", "exec_grad_max_abs_diff",
                "torch_output_max_abs_diff", "torch_grad_max_abs_diff"):
        assert claims[f"ch08/{key}"] < 1e-5, key


def test_straight_line_steps_equal_the_sequential_model(claims):
    for kind in ("gpipe", "1f1b"):                                        # gpipe_1f1b on p processes
        assert claims[f"ch08/straight_{kind}_max_grad_diff"] < 1e-5, kind
        assert claims[f"ch08/straight_{kind}_loss_abs_diff"] < 1e-5, kind


def test_measured_bubble_within_005_of_formula(claims):
    assert claims["ch08/exec_bubble_error_gpipe"] <= 0.05
    assert claims["ch08/exec_bubble_error_1f1b"] <= 0.05
    assert claims["ch08/exp_bubble_max_abs_error"] <= 0.05


def test_activation_memory(claims):
    # measured bytes = in-flight count x bytes of one micro-batch, exactly
    assert claims["ch08/exec_peak_bytes_vs_predicted_gpipe"] < 1e-9
    assert claims["ch08/exec_peak_bytes_vs_predicted_1f1b"] < 1e-9
    # the largest m of every profile's sweep is at least 2p: GPipe's stage 0 holds at least twice 1F1B's
    assert claims["ch08/exp_stage0_bytes_ratio_gpipe_1f1b"] >= 2.0 - 1e-9
    assert claims["ch08/exp_1f1b_stage0_bytes_spread"] == pytest.approx(1.0)   # 1F1B flat once m >= p


def test_sent_tensors_are_freed_once_the_peer_has_them(claims):
    ofob, gpipe = claims["ch08/exec_sends_held_1f1b"], claims["ch08/exec_sends_held_gpipe"]
    p, m = len(ofob), claims["ch08/sim_peak_inflight_gpipe"][0]
    assert ofob == claims["ch08/exec_sends_bound_1f1b"]                  # what the schedule allows, no more
    # the text's formula: min(p, m) on stage 0 (its warm-up's activations), min(p - s + 1, m) on stage s >= 1
    # (the gradients of its cool-down, which the stage before never acknowledges): about p, not m
    assert ofob == [min(p, m)] + [min(p - s + 1, m) for s in range(1, p)]
    assert claims["ch08/sends_bound_formula_mismatches"] == []           # and for p = 2..8, m = 1..24
    assert gpipe == claims["ch08/exec_sends_bound_gpipe"] == [m] * p


def test_interleaved_and_zero_bubble_for_real(claims):
    p = len(claims["ch08/sim_peak_inflight_gpipe"])
    m = claims["ch08/sim_peak_inflight_gpipe"][0]
    for kind in ("interleaved", "zb-h1"):
        assert claims[f"ch08/exec_bubble_error_{kind}"] <= 0.05, kind
        assert claims[f"ch08/exec_grad_max_abs_diff_{kind}"] < 1e-5, kind
        assert claims[f"ch08/exec_peak_inflight_{kind}"] == claims[f"ch08/exec_peak_inflight_sim_{kind}"], kind
    # the executor counts one graph per micro-batch and chunk; in whole-stage units the first device holds
    # p (1 + (p-1)/(p v)), the 5.5 the text cites for p = 4, v = 2 (Korthikanti et al. 2022)
    assert claims["ch08/exec_stage0_inflight_stages_interleaved"] == pytest.approx(p * (1 + (p - 1) / (p * 2)))
    assert claims["ch08/zb_sim_bubble_max_abs_error"] < 1e-12            # the paper's formula
    assert claims["ch08/exec_peak_inflight_zb-h1"] == [min(p, m)] * p     # W keeps the graph alive longer
    assert claims["ch08/exec_zb_bytes_over_1f1b"] == pytest.approx([min(p, m) / min(p - s, m) for s in range(p)])
    v = 2
    assert claims["ch08/exec_messages_interleaved"] == 2 * (p * v - 1) * m
    assert claims["ch08/exec_messages_1f1b"] == 2 * (p - 1) * m
    assert claims["ch08/exec_bytes_ratio_interleaved_1f1b"] == pytest.approx((p * v - 1) / (p - 1))
    # idle over compute near (p - 1) / (v m), as Narayanan et al. 2021 count it
    assert claims["ch08/exec_interleaved_idle_over_busy"] == pytest.approx((p - 1) / (v * m), abs=0.1)


def test_split_backward_runs_one_backward_s_ops_once(claims):
    # counted on every rank of the real run: ZB-H1's B + W equal 1F1B's backward, operator for operator
    assert claims["ch08/split_count_mismatches"] == []
    linears = claims["ch08/split_linears"]
    # each linear layer: its input product in B (stage 0's first layer too: its input is the embedding's
    # output), its weight product in W; one backward runs both
    assert claims["ch08/split_mm_B"] == claims["ch08/split_mm_W"] == linears
    assert claims["ch08/split_mm_1f1b"] == [2 * n for n in linears]
    assert claims["ch08/split_bmm_W"] == [0] * len(linears)              # attention's products: all in B
    assert all(b > 0 for b in claims["ch08/split_bmm_B"])
    assert claims["ch08/split_embedding_backward_in_b"] == 0             # the lookup's backward is W's


def test_unpadded_runs_compute_the_same_gradients(claims):
    for kind in ("1f1b", "zb-h1"):
        assert claims[f"ch08/unpadded_grad_max_abs_diff_{kind}"] < 1e-5, kind
        assert claims[f"ch08/unpadded_step_ms_{kind}"] > 0


def test_torch_runs_every_schedule_with_the_same_loss(claims):
    assert claims["ch08/torch_schedules"] == sorted(["ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B",
                                                     "ScheduleInterleavedZeroBubble"])
    assert claims["ch08/torch_loss_max_abs_diff"] < 1e-5


def test_pipedream_versions_and_stash(claims):
    p = len(claims["ch08/sim_peak_inflight_gpipe"])
    assert claims["ch08/pd_sim_staleness"] == claims["ch08/pd_staleness"] == [p - s - 1 for s in range(p)]
    assert claims["ch08/pd_sim_peak_stashed"] == claims["ch08/pd_peak_copies"] == [p - s for s in range(p)]
    assert claims["ch08/pd_stash_bytes_over_formula"] == pytest.approx(1.0)   # (p - s) copies of the weights


def test_pipedream_without_stashing_is_inconsistent(claims):
    assert claims["ch08/pd_autograd_refuses_mixed_versions"] is True
    assert claims["ch08/pd_stashed_grad_rel_error_old"] < 1e-5               # stashing: the true gradient
    assert claims["ch08/pd_mixed_grad_rel_error_old"] > 0.05                 # mixing: neither version's
    assert claims["ch08/pd_mixed_grad_rel_error_new"] > 0.05


def test_pipedream_training_and_time(claims):
    assert claims["ch08/pd_first_loss_diff"] < 1e-5                          # the first step is not stale
    # both learn: the loss starts near ln 64 = 4.16
    assert claims["ch08/pd_eval_sync_mean"] < 4.0 and claims["ch08/pd_eval_async_mean"] < 4.0
    lo, hi = claims["ch08/pd_eval_gap_range"]
    assert 0 < lo <= claims["ch08/pd_eval_gap_mean"] <= hi                   # stale gradients cost loss, every seed
    assert claims["ch08/pd_bubble_error_async"] <= 0.05
    assert claims["ch08/pd_bubble_error_flush"] <= 0.05
    assert claims["ch08/pd_time_ratio_flush_over_async"] > 1.05              # no flush: less time


def test_comparison_table_is_measured(claims):
    table = claims["ch08/table"]
    assert set(table) == {"gpipe", "1f1b", "interleaved", "zb-h1", "pipedream"}
    for kind, row in table.items():
        assert abs(row["bubble"] - row["formula"]) <= 0.05, kind
    p = len(claims["ch08/sim_peak_inflight_gpipe"])
    assert table["1f1b"]["peak_inflight"] == p and table["gpipe"]["peak_inflight"] > p
    assert table["interleaved"]["messages"] > table["1f1b"]["messages"] == table["pipedream"]["messages"]
    assert table["zb-h1"]["bubble"] < table["1f1b"]["bubble"]
    assert table["pipedream"]["weight_copies"] == p


def test_frozen_prefix_in_the_simulator(claims):
    p, m = len(claims["ch08/sim_peak_inflight_gpipe"]), claims["ch08/sim_peak_inflight_gpipe"][0]
    assert claims["ch08/freeze_sim_makespan_max_abs_error"] < 1e-12     # k t_f + (m + p - k - 1)(t_f + t_b)
    assert claims["ch08/freeze_sim_makespans"] == pytest.approx([k + (m + p - k - 1) * 3.0 for k in range(p)])
    bubbles = claims["ch08/freeze_sim_bubbles"]
    assert all(a < b for a, b in zip(bubbles, bubbles[1:]))             # frozen in place: the idle share grows
    plan = claims["ch08/freeze_plan"]
    assert [row["frozen"] for row in plan] == [0, p, p + p // 2]          # alpha = 1/2 on 2p layers
    for row in plan:
        assert row["stages"] * row["replicas"] == p
        assert row["repacked"] <= row["cached"] <= row["in_place"]
    assert [(row["stages"], row["replicas"]) for row in plan][:2] == [(p, 1), (p // 2, 2)]
    assert plan[1]["in_place"] / plan[1]["repacked"] > 1.5               # repacking, not freezing, saves the time


def test_frozen_stages_run_no_backward_for_real(claims):
    p, m = len(claims["ch08/sim_peak_inflight_gpipe"]), claims["ch08/sim_peak_inflight_gpipe"][0]
    k = len(claims["ch08/freeze_backward_ops_frozen"])
    assert 1 <= k < p
    assert claims["ch08/freeze_backward_ops_frozen"] == [0] * k           # no backward operator at all
    ours, unfrozen = claims["ch08/freeze_backward_ops_first_trainable"]
    assert 0 < ours < unfrozen                                           # no gradient for its input
    assert claims["ch08/freeze_later_backwards_unchanged"] is True
    sent, formula, before = claims["ch08/freeze_messages"]
    assert sent == formula == (p - 1) * m + (p - 1 - k) * m and before == 2 * (p - 1) * m
    assert claims["ch08/freeze_peak_bytes_frozen"] == [0] * k             # no activations saved
    assert claims["ch08/freeze_grad_max_abs_diff"] < 1e-5                 # the sequential step, prefix frozen
    assert claims["ch08/freeze_frozen_grads_none"] is True
    assert claims["ch08/freeze_loss_abs_diff"] < 1e-5
    assert claims["ch08/freeze_bubble_error"] <= 0.05                     # measured against the simulator
    frozen, unfrozen_bubble = claims["ch08/freeze_bubble_vs_unfrozen"]
    assert frozen > unfrozen_bubble


def test_repacked_pipeline_with_replicas_for_real(claims):
    p = len(claims["ch08/sim_peak_inflight_gpipe"])
    stages, replicas = claims["ch08/freeze_plan_real"]
    assert stages * replicas == p and replicas >= 2
    assert claims["ch08/freeze_repacked_grad_max_abs_diff"] < 1e-5
    assert claims["ch08/freeze_repacked_loss_abs_diff"] < 1e-5
    assert claims["ch08/freeze_repacked_bubble_error"] <= 0.05
    measured, simulated = claims["ch08/freeze_speedup"]
    assert measured > 1.5 and abs(measured - simulated) / simulated < 0.15
    cache = claims["ch08/freeze_cache"]
    assert cache["bytes"] == cache["formula"] > 0                          # samples x sequence x d_model x 4
    assert cache["computed"] == cache["samples"]                           # once per sample ...
    assert cache["hits"] == (cache["steps"] - 1) * cache["samples"]        # ... then read from the cache


def test_activation_cache_skips_the_prefix_in_later_epochs(claims):
    per_epoch = claims["ch08/freeze_cache_prefix_samples"]
    n = per_epoch["recompute"][0]
    assert n > 0 and per_epoch["recompute"] == [n] * 3 and per_epoch["cache"] == [n, 0, 0]
    assert claims["ch08/freeze_cache_loss_max_abs_diff"] < 1e-6
    held, formula = claims["ch08/freeze_cache_bytes"]
    assert held == formula
