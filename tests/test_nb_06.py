"""Chapter 06's claims, measured by the notebook at the test profile."""

from __future__ import annotations

import pytest

from conftest import notebook_claims

pytestmark = pytest.mark.notebook

TOL = 1e-5  # float32 sums in a different order


@pytest.fixture(scope="module")
def claims() -> dict:
    return notebook_claims("06")


def test_split_gradient_identity(claims):
    assert claims["ch06/split_grad_max_abs_diff"] < 1e-6, "mean of shard gradients = whole-batch gradient"
    assert claims["ch06/bn_split_grad_max_abs_diff"] > 1e-3, "BatchNorm breaks the identity"


def test_hook_counts(claims):
    assert claims["ch06/hook_calls_used_twice"] == 1
    assert claims["ch06/hook_calls_reentrant_checkpoint"] == 2
    assert claims["ch06/bucketed_hook_calls_reentrant"] == 2
    assert claims["ch06/bucketed_resent_learned_counts"] == 0
    assert claims["ch06/bucketed_resent_first_call"] > 0
    assert claims["ch06/bucketed_resent_graph_change"] >= 1


def test_buckets_grow_in_number_as_the_cap_shrinks(claims):
    b = claims["ch06/resnet_buckets_by_cap_mb"]
    assert b["25.0"] < b["0.5"] < b["0.1"]


def test_sampler(claims):
    assert claims["ch06/sampler_covers_dataset"] and claims["ch06/sampler_equal_shards"]
    assert claims["ch06/sampler_padded_indices"] == 2  # 10 indices on 4 ranks: 3 each, 2 repeated


@pytest.mark.parametrize("kind", ["naive", "bucketed", "torch"])
def test_wrappers_equal_single_process(claims, kind):
    assert claims[f"ch06/grad_max_abs_diff/{kind}"] < TOL
    assert claims[f"ch06/param_max_abs_diff/{kind}"] < TOL


def test_unused_parameters_keep_no_gradient(claims):
    assert claims["ch06/grad_none_pattern_matches"] is True


def test_messages_and_bytes(claims):
    tensors = claims["ch06/tensors_in_timing_model"]
    assert claims["ch06/messages_per_step/naive"] == tensors
    assert claims["ch06/messages_per_step/bucketed"] < tensors
    for kind in ("naive", "torch"):
        assert claims[f"ch06/bytes_sent_over_grad_bytes/{kind}"] == 1.0, "2(N-1)/N = 1 at N = 2"
    assert claims["ch06/bytes_sent_over_grad_bytes/bucketed"] == pytest.approx(1.0, abs=1e-3)  # + flags


def test_step_times(claims):
    for kind in ("naive", "bucketed", "torch"):
        assert claims[f"ch06/step_ms/{kind}"] > 0
    # Loose on purpose: a busy 2-core machine moves these by tens of percent (the benchmark has the 1.2 goal).
    assert claims["ch06/bucketed_over_torch_step_time"] < 3.0


def test_no_sync(claims):
    for kind in ("torch", "bucketed"):
        assert claims[f"ch06/no_sync_allreduce_ratio/{kind}"] == 4.0, "k = 4 micro-batches: 4x fewer all-reduces"
        assert claims[f"ch06/no_sync_grad_max_abs_diff/{kind}"] < 1e-6


def test_batchnorm(claims):
    assert claims["ch06/bn_sync_grad_max_abs_diff"] < TOL
    assert claims["ch06/bn_per_rank_grad_max_abs_diff"] > 100 * max(claims["ch06/bn_sync_grad_max_abs_diff"], 1e-7)
    assert claims["ch06/bn_per_rank_running_mean_spread"] > 0


def test_ring_all_reduce_volume(claims):
    ratio = claims["ch06/ring_bytes_over_grad_bytes"]
    for n, value in ratio.items():
        assert value == pytest.approx(2 * (int(n) - 1) / int(n)), f"N={n}"
    assert claims["ch06/ring_all_reduce_max_abs_diff"] < TOL


def test_weak_scaling(claims):
    eff = claims["ch06/scaling_efficiency"]
    assert all(v > 0 for v in claims["ch06/scaling_samples_per_s"].values())
    if claims["ch06/cpu_count"] <= 2 and "4" in eff:
        # four ranks on two cores cannot do four ranks' work in one rank's time
        assert eff["4"] < 1.0
