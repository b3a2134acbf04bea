"""Chapter 11's claims, measured by the notebook at the test profile.

Memory is measured (saved-tensor hooks, the allocator's records) and costs are
counted (FLOPs, kernel calls, bytes copied); no step time is asserted. The
CPU profiles check what a CPU can show: there offloading copies into NumPy
memory the allocator does not count, and FSDP2's CPUOffloadPolicy is not run.
"""

import math

from conftest import notebook_claims


def test_fused_attention_claims(profile):
    c = notebook_claims("11")
    # by hand: the online softmax gives the same output with T x block temporaries instead of T x T
    assert c["ch11/online_softmax_max_abs_diff"] < 1e-5
    assert c["ch11/online_forward_peak_ratio"] < 0.5
    # the naive path's saved bytes have a T^2 term, the fused path's none: doubling T doubles them
    assert c["ch11/naive_quadratic_share"] > 0.3
    assert abs(c["ch11/fused_quadratic_share"]) < 0.01
    assert abs(c["ch11/fused_saved_doubling_ratio"] - 2) < 0.01
    assert c["ch11/fused_saved_ratio_longest"] < 0.6
    # log-log slopes: the fused path's 1 throughout, the naive path's rising with T, between 1 and 2
    assert all(abs(s - 1) < 0.01 for s in c["ch11/fused_loglog_slopes"])
    naive_slopes = c["ch11/naive_loglog_slopes"]
    assert all(1 < a < b < 2 for a, b in zip(naive_slopes, naive_slopes[1:]))
    assert c["ch11/estimator_max_rel_error"] <= 0.05
    assert c["ch11/fused_loss_abs_diff"] < 1e-5
    assert c["ch11/fused_grad_max_abs_diff"] < 1e-6
    if profile == "cpu":  # longer sequences: the quadratic term takes over
        assert c["ch11/naive_quadratic_share"] > 0.6
        assert c["ch11/fused_saved_ratio_longest"] < 0.45


def test_selective_checkpointing_should_keep_the_fused_op():
    c = notebook_claims("11")
    assert c["ch11/sac_fused_calls_linear_only"] == 2  # forward, and again in the recomputation
    assert c["ch11/sac_fused_calls_keep_attention"] == 1
    assert 0 < c["ch11/sac_keep_attention_extra_kept_fraction"] < 0.15


def test_offload_claims(profile):
    c = notebook_claims("11")
    assert c["ch11/offload_hand_peak_ratio"] < 0.5
    assert c["ch11/offload_hand_copied_over_saved"] >= 1  # a tensor saved by two ops is copied twice
    assert c["ch11/offload_hand_grad_max_abs_diff"] < 1e-6
    assert c["ch11/save_on_cpu_grad_max_abs_diff"] < 1e-6
    if profile == "gpu":
        assert c["ch11/save_on_cpu_peak_ratio"] < 0.7 and c["ch11/save_on_cpu_copied_bytes"] > 0
    else:  # on a CPU machine save_on_cpu copies nothing and changes no peak
        assert c["ch11/save_on_cpu_copied_bytes"] == 0
        assert 0.98 <= c["ch11/save_on_cpu_peak_ratio"] <= 1.02
    # min_bytes: keeping the small tensors saves copies, not bytes
    assert c["ch11/offload_sweep_monotone"] is True
    assert c["ch11/offload_sweep_largest_share"] > 0.9
    assert c["ch11/offload_sweep_largest_copies_share"] < 0.9
    # per block: the prediction is at most 5% low; the peak never falls below the floor
    assert 0.5 <= c["ch11/offload_blocks_peak_over_prediction"] <= 1.05
    assert c["ch11/offload_blocks_peak_over_floor"] >= 1
    assert c["ch11/offload_traffic_matches"] is True


def test_chunked_loss_claims(profile):
    c = notebook_claims("11")
    assert 2.95 <= c["ch11/loss_plain_peak_in_NV"] <= 3.05  # logits, log-softmax, its gradient
    assert c["ch11/loss_chunked_peak_ratio"] < 0.3
    assert c["ch11/loss_chunked_by_hand_peak_ratio"] <= 1.01 * c["ch11/loss_chunked_peak_ratio"]
    assert c["ch11/loss_prediction_max_rel_error"] < 0.05
    assert c["ch11/loss_chunked_max_abs_diff"] < 1e-5
    assert c["ch11/loss_chunked_grad_max_abs_diff"] < 1e-6
    assert math.isclose(c["ch11/loss_chunked_extra_flops"], 1 / 3, abs_tol=0.01)
    if profile == "cpu":  # more chunks: the by-hand version, which adds its weight gradient in place, goes lower
        assert c["ch11/loss_chunked_by_hand_peak_ratio"] < 0.15


def test_compile_budget_claims(profile):
    c = notebook_claims("11")
    assert c["ch11/compile_saved_monotone_in_budget"] is True
    assert c["ch11/compile_extra_flops_monotone_in_budget"] is True
    assert c["ch11/compile_saved_fraction_budget_0"] < 0.05
    assert 0.2 < c["ch11/compile_saved_fraction_budget_half"] < 0.7
    assert abs(c["ch11/compile_saved_fraction_budget_1"] - 1) < 0.02
    assert c["ch11/compile_extra_flops_budget_0"] > 0.1
    assert abs(c["ch11/compile_extra_flops_budget_1"]) < 1e-9
    # budget 0 is not full checkpointing: it reruns the forward pass but for the block's last matmul, whose output
    # no gradient reads, so less than the third of a step a whole forward would cost
    assert abs(c["ch11/compile_budget_0_recomputed_over_forward_but_last_matmul"] - 1) < 1e-6
    assert c["ch11/compile_extra_flops_budget_0"] < 1 / 3 - 0.01
    if profile == "cpu":  # inductor's partition is the one measured
        assert c["ch11/compile_inductor_saved_over_partitioner"] == 1


def test_timeline_claims():
    c = notebook_claims("11")
    assert c["ch11/timeline_peak_at_end_of_forward_naive"] is True
    assert c["ch11/timeline_peak_ratio_fused"] < 0.9
    assert c["ch11/timeline_peak_ratio_offloaded"] < 0.5


def test_fsdp_offload_only_where_it_runs(profile):
    c = notebook_claims("11")
    if profile != "gpu":
        assert "ch11/fsdp_offload_peak_ratio" not in c  # no number where it cannot be measured
        return
    assert c["ch11/fsdp_offload_device_state_bytes"] == 0
    assert c["ch11/fsdp_offload_peak_ratio"] < 1
    assert c["ch11/fsdp_offload_loss_max_abs_diff"] < 1e-3
    assert c["ch11/fsdp_offload_step_time_ratio"] > 0


def test_experiment_claims():
    c = notebook_claims("11")
    names = ("naive", "fused", "fused_chunked_loss", "fused_chunked_offload")
    longest = [c[f"ch11/exp_longest_seq_{n}"] for n in names]
    assert longest == sorted(longest) and longest[-1] > longest[0]
    ratios = [c[f"ch11/exp_peak_ratio_{n}"] for n in names[1:]]
    assert 1 > ratios[0] > ratios[1] > ratios[2]


def test_profiler_memory_timeline_agrees_with_the_exact_count(profile):
    c = notebook_claims("11")
    exact = 1.0 if profile != "gpu" else 0.01  # CUDA's allocator rounds each block up (512 B), the CPU's does not
    for part in ("params", "grads", "optimizer"):
        assert abs(c[f"ch11/prof_{part}_over_exact"] - 1.0) <= (0.0 if exact == 1.0 else exact), part
    # activations: within a percent; the difference is the saved ids and masks, which the profiler calls inputs
    assert 0.98 <= c["ch11/prof_activation_over_saved"] < 1.0
    assert c["ch11/prof_nonfloat_saved_bytes"] > 0
    assert abs(c["ch11/prof_activation_plus_nonfloat_over_saved"] - 1.0) < 1e-4
    # the four parts never coexist: the step's peak is the activations at the turn and what has appeared beside them
    assert 0.7 < c["ch11/prof_peak_over_exact_total"] < 1.1
    assert c["ch11/prof_trace_bytes"] < 3e6
    if profile == "gpu":
        assert abs(c["ch11/cuda_snapshot_peak_over_cuda_peak"] - 1.0) < 0.01
