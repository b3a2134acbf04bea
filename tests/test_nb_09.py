"""Chapter 09's claims, measured by the notebook at the test profile."""

from __future__ import annotations

import pytest
from conftest import notebook_claims, variants

pytestmark = pytest.mark.notebook


@pytest.fixture(scope="module", params=variants("09"), ids=lambda v: v or "measured")
def c(request) -> dict:
    """The claims as this CPU's kernels ran them, then with bf16 forced broken (its emulated twin runs)."""
    return notebook_claims("09", request.param)


def test_formulas(c: dict) -> None:
    assert abs(c["ch09/mixed_adam_bytes_per_param"] - 16) < 0.01  # 2 + 2 + 12, plus a step counter per tensor
    assert abs(c["ch09/fp32_adam_bytes_per_param"] - 16) < 0.01  # 4 + 4 + 8: what sections 3-6 measure
    assert c["ch09/paper_example_gb"] == [120.0, 31.4, 16.6, 1.9]  # Rajbhandari et al. 2020, Figure 1


def test_zero_by_hand_is_adam(c: dict) -> None:
    assert c["ch09/byhand_max_diff_float64"] < 1e-10
    # float32: the attention biases (the key bias: true gradient 0, pure rounding noise) drift by Adam's step for
    # noise, the order of the largest difference; which parameter holds the largest one is the machine's rounding
    worst = c["ch09/byhand_float32_worst_param"]
    assert worst.startswith("blocks.")  # named, the notebook prints it
    assert c["ch09/byhand_float32_qkv_bias_max_diff"] <= c["ch09/byhand_max_diff_float32"]
    assert c["ch09/byhand_float32_qkv_bias_max_diff"] > 0.1 * c["ch09/byhand_max_diff_float32"]
    if "qkv.bias" in worst:
        assert c["ch09/byhand_float32_qkv_bias_max_diff"] == c["ch09/byhand_max_diff_float32"]
    assert c["ch09/key_bias_grad_max"] < 1e-6 < c["ch09/query_bias_grad_max"]
    # Adam turns that noise into steps of lr |g| / (|g| + eps): over the steps, the order of the float32 difference
    ratio = c["ch09/byhand_max_diff_float32"] / c["ch09/key_bias_noise_drift"]
    assert 0.1 < ratio < 10, f"float32 difference / Adam's drift for the noise = {ratio}"
    fractions = c["ch09/byhand_optimizer_fraction"]
    assert all(abs(f * len(fractions) - 1) < 0.01 for f in fractions)


def test_real_ranks_train_like_adam(c: dict) -> None:
    assert c["ch09/exact_max_param_diff"] < 1e-5
    assert c["ch09/max_loss_diff_float32"] < 1e-4
    assert c["ch09/final_loss_spread"] < 1e-4
    assert 0 < c["ch09/bf16_max_loss_diff"] < 0.05  # bf16 compute: close, not equal
    assert c["ch09/fsdp2_param_placements"] == "(Shard(dim=0),)"
    assert c["ch09/fsdp2_param_local_rows_fraction"] == 0.5


def test_memory_per_rank_follows_the_formulas(c: dict) -> None:
    for key, ratio in c["ch09/held_over_formula"].items():
        for part, r in ratio.items():
            assert abs(r - 1) < 0.02, f"{key} {part}: measured / formula = {r}"
    for key, r in c["ch09/optimizer_total_over_one_copy"].items():
        method, world = key.split("/")
        copies = int(world) if method == "ddp" else 1  # DDP replicates; ZeRO and FSDP2 hold it once
        assert abs(r / copies - 1) < 0.01, f"{key}: optimizer state held {r} times"
    imbalance = c["ch09/optimizer_imbalance"]
    assert imbalance["zero1"] == 1.0 and imbalance["zero_redundancy"] >= 1.0


def test_peak_per_rank(c: dict) -> None:
    for key, r in c["ch09/resident_over_formula"].items():  # resident at a step's start: the states and the batch
        assert abs(r - 1) < 0.02, f"{key}: resident / (formula + batch) = {r}"
    peak, transient = c["ch09/peak_mb"], c["ch09/transient_mb"]
    for n in (2, 4):
        assert peak[f"ddp/{n}"] > peak[f"zero1/{n}"] > peak[f"zero2/{n}"], f"N = {n}: {peak}"
        assert abs(transient[f"zero1/{n}"] / transient[f"ddp/{n}"] - 1) < 0.02  # the same activations
        others = max(transient[f"{m}/{n}"] for m in ("ddp", "zero1", "zero2"))
        assert transient[f"fsdp2/{n}"] > others  # gathered blocks and their gradients in flight
    for n, saving in c["ch09/zero2_peak_saving_over_grad_share"].items():
        # what ZeRO-2 does not hold, (N-1)/N of the gradient, less the bucket in flight. On a CPU the peak errs
        # high by the buffers gloo frees on its own thread (dp_methods.MEASURED_STEPS: the lowest of the measured
        # steps). At smoke, 0.74 at both N with three measured steps; with one (measure_steps=3 then), a CI run
        # measured 0.59 at N = 2. The bound keeps the claim (most of the share is saved) with room for the error
        assert 0.6 <= saving <= 1.05, f"N = {n}: ZeRO-2 saves {saving} x (N-1)/N x G"


def test_bf16_mixed_precision(c: dict) -> None:
    # fp32 shards, gradients and Adam moments as in fsdp2; the transient (gathered weights, activations) is bf16
    assert abs(c["ch09/bf16_held_over_fp32"] - 1) < 0.001
    assert 0.35 < c["ch09/bf16_transient_over_fp32"] < 0.75, c["ch09/bf16_transient_over_fp32"]
    peak = c["ch09/bf16_peak_mb"]
    assert abs(peak["fsdp2_bf16_resident"] / peak["fsdp2_resident"] - 1) < 0.01  # the same resident states ...
    assert peak["fsdp2_bf16"] < 0.9 * peak["fsdp2"]  # ... and a lower peak: the text's "peaks lower"
    if c.get("ch09/bf16_emulated"):  # the printed verdict "emulated" must show in the measured bf16 compute
        assert c["ch09/bf16_compute_over_fp32"] > 1.5, c["ch09/bf16_compute_over_fp32"]


def test_buckets_leave_during_the_backward(c: dict) -> None:
    assert c["ch09/timeline_stage1_during_backward"] == 0  # stage 1 reduces in step()
    assert c["ch09/timeline_stage2_before_last_grad"] >= 1  # stage 2: a bucket left before the last gradient
    after, buckets = c["ch09/timeline_stage2_after_backward"]
    assert after == buckets > 1
    assert c["ch09/timeline_stage2_full_grad_bytes"] == 0
    assert 0.5 <= c["ch09/timeline_slice_over_grad"] < 0.51  # 1/N of the gradient at N = 2, plus padding


def test_profiler_trace_shows_the_reduce_scatters_beside_the_backward(c: dict) -> None:
    # read from the ranks' Chrome traces: ZeRO-1 queues its reduce-scatters in step(), ZeRO-2 every one of them
    # from the gradient hooks, and part of their time falls inside the backward
    buckets = c["ch09/timeline_stage2_after_backward"][1]
    assert c["ch09/trace_reduce_scatters/zero1"] == c["ch09/trace_reduce_scatters/zero2"] == [buckets, buckets]
    assert c["ch09/trace_reduce_scatters_queued_in_backward/zero1"] == [0, 0]
    assert c["ch09/trace_overlap_fraction/zero1"] == 0.0
    assert c["ch09/trace_reduce_scatters_queued_in_backward/zero2"] == [buckets, buckets]
    assert c["ch09/trace_overlap_fraction/zero2"] > 0.0
    assert c["ch09/trace_files_bytes"] < 3e6  # gzipped: small enough to keep under build/


def test_accumulation_traffic(c: dict) -> None:
    r = c["ch09/accum_comm_ratio"]  # A = 2 micro-batches per step, against DDP under no_sync
    assert abs(r["zero1"] - 1) < 0.01
    assert abs(r["zero2"] - 1.5) < 0.01  # (A + 1) / 2: a reduce-scatter after every micro-batch
    assert abs(r["fsdp2"] / 3 - 1) < 0.05  # 3A / 2
    # ZeroRedundancyOptimizer broadcasts each parameter tensor once per step, not once in all
    assert c["ch09/zero_redundancy_broadcasts_per_step"] == c["ch09/parameter_tensors"]


def test_communication_is_1x_1x_1p5x(c: dict) -> None:
    expected = {"ddp": 1.0, "zero1": 1.0, "zero2": 1.0, "fsdp2": 1.5, "fsdp2_keep": 1.0, "zero_redundancy": 1.5,
                "fsdp2_bf16": 1.0}
    ratios = c["ch09/comm_ratio"]
    assert {"zero1/2", "zero2/2", "fsdp2/2", "zero1/4", "zero2/4", "fsdp2/4"} <= set(ratios)
    for key, r in ratios.items():
        want = expected[key.split("/")[0]]
        assert abs(r / want - 1) < 0.05, f"{key}: {r} x DDP, expected {want}"
    assert abs(c["ch09/bf16_allgather_ratio"] - 0.5) < 0.01


def test_checkpoints(c: dict) -> None:
    assert c["ch09/crash_happened"] is True
    assert c["ch09/incomplete_has_metadata"] == [False]
    assert c["ch09/incomplete_shards"] == [2], "every rank of the crashed launch writes its shard before dying"
    assert c["ch09/resume_state_intact"] is True
    assert c["ch09/resume_identical"] is True and c["ch09/resume_max_abs_diff"] == 0.0
    for world, r in c["ch09/reshard"].items():
        assert r["state_intact"] is True, f"loading at world size {world} changed the state"
        assert r["max_loss_diff"] < 1e-5
