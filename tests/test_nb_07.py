"""Chapter 07's claims, measured by the notebook at the test profile."""

from __future__ import annotations

import pytest

from conftest import notebook_claims

pytestmark = pytest.mark.notebook

TOL = 1e-5  # float32 sums in a different order


@pytest.fixture(scope="module")
def claims() -> dict:
    return notebook_claims("07")


def test_split_gradient_identity(claims):
    assert claims["ch07/split_grad_max_abs_diff"] < 1e-6, "mean of shard gradients = whole-batch gradient"
    assert claims["ch07/bn_split_grad_max_abs_diff"] > 1e-3, "BatchNorm breaks the identity"


def test_hook_counts(claims):
    assert claims["ch07/hook_calls_used_twice"] == 1
    assert claims["ch07/hook_calls_reentrant_checkpoint"] == 2
    assert claims["ch07/dynamic_hook_calls_reentrant"] == 2
    # the text reads these off the table's "buckets re-sent" column: 0; 2 (the checkpointed block's weight
    # bucket and the bucket its bias shares, both in the first step); 1 (the head's bucket on step 1 only)
    assert claims["ch07/dynamic_resent_learned_counts"] == 0
    assert claims["ch07/dynamic_resent_first_call"] == 2
    assert claims["ch07/dynamic_first_call_grad_diff"] < TOL, "the re-sends repair the early buckets"
    assert claims["ch07/dynamic_resent_graph_change"] == 1


def test_bucketed_ddp_fails_where_the_text_says(claims):
    # "differ from the single process's by far more than rounding"
    assert claims["ch07/bucketed_grad_diff_reentrant"] > 1000 * TOL


def test_bucketed_ddp_keeps_none_for_a_head_no_rank_uses(claims):
    # "it keeps None on the even steps, as in the single process", so momentum leaves it where one process does
    assert claims["ch07/bucketed_none_match_unused"] is True
    assert claims["ch07/bucketed_param_diff_unused"] < TOL


def test_buckets_grow_in_number_as_the_cap_shrinks(claims):
    b = claims["ch07/resnet_buckets_by_cap_mb"]
    assert b["25.0"] < b["0.5"] < b["0.1"]


def test_sampler(claims):
    assert claims["ch07/sampler_covers_dataset"] and claims["ch07/sampler_equal_shards"]
    assert claims["ch07/sampler_padded_indices"] == 2  # 10 indices on 4 ranks: 3 each, 2 repeated


@pytest.mark.parametrize("kind", ["naive", "bucketed", "dynamic", "torch"])
def test_wrappers_equal_single_process(claims, kind):
    assert claims[f"ch07/grad_max_abs_diff/{kind}"] < TOL
    assert claims[f"ch07/param_max_abs_diff/{kind}"] < TOL


def test_unused_parameters_keep_no_gradient(claims):
    assert claims["ch07/grad_none_pattern_matches"] is True


def test_messages_and_bytes(claims):
    tensors = claims["ch07/tensors_in_timing_model"]
    assert claims["ch07/messages_per_step/naive"] == tensors
    assert claims["ch07/messages_per_step/bucketed"] < tensors
    for kind in ("naive", "bucketed", "torch"):
        assert claims[f"ch07/bytes_sent_over_grad_bytes/{kind}"] == 1.0, "2(N-1)/N = 1 at N = 2"
    extra = claims["ch07/bytes_sent_over_grad_bytes/dynamic"] - 1.0  # + 4-byte flags
    assert 0 < extra < 1e-3


def test_no_sync(claims):
    for kind in ("torch", "bucketed", "dynamic"):
        assert claims[f"ch07/no_sync_allreduce_ratio/{kind}"] == 4.0, "k = 4 micro-batches: 4x fewer all-reduces"
        assert claims[f"ch07/no_sync_grad_max_abs_diff/{kind}"] < 1e-6


def test_batchnorm(claims):
    assert claims["ch07/bn_sync_grad_max_abs_diff"] < TOL
    assert claims["ch07/bn_per_rank_grad_max_abs_diff"] > 100 * max(claims["ch07/bn_sync_grad_max_abs_diff"], 1e-7)
    assert claims["ch07/bn_per_rank_running_mean_spread"] > 0


def test_ring_all_reduce_volume(claims):
    ratio = claims["ch07/ring_bytes_over_grad_bytes"]
    for n, value in ratio.items():
        assert value == pytest.approx(2 * (int(n) - 1) / int(n)), f"N={n}"
    assert claims["ch07/ring_all_reduce_max_abs_diff"] < TOL


def test_weak_scaling_gives_every_rank_the_same_work(claims):
    # DistributedSampler: each rank's shard is its batches for the warm-up and the timed steps, at every N
    per_rank = claims["ch07/scaling_batch_per_rank"] * (claims["ch07/scaling_steps"] + 1)
    assert set(claims["ch07/scaling_shard_sizes"].values()) == {per_rank}
    # "the CPU time of compute alone should stay about the same": the work per rank does not grow with N
    # (CPU time, not wall-clock time, so a busy machine does not move it; the timing ratios are benchmarks)
    cpu = claims["ch07/scaling_compute_cpu_ms"]
    one = cpu[min(cpu, key=int)]
    for n, v in cpu.items():
        assert 0.6 < v / one < 1.6, f"N={n}: {v:.1f} ms of CPU per rank and step against {one:.1f} at one rank"


def test_profiler_trace_shows_where_the_all_reduces_run(claims):
    # read from the ranks' own Chrome traces: NaiveDDP queues nothing during the backward and none of its
    # all-reduce time falls inside it; BucketedDDP queues every bucket from the hooks, and some of its time overlaps
    assert claims["ch07/trace_allreduces/naive"] == [10, 10]  # one per gradient tensor, nothing else
    assert claims["ch07/trace_queued_in_backward/naive"] == [0, 0]
    assert claims["ch07/trace_overlap_fraction/naive"] == 0.0
    assert claims["ch07/trace_queued_in_backward/bucketed"] == claims["ch07/trace_allreduces/bucketed"]
    assert min(claims["ch07/trace_allreduces/bucketed"]) >= 3
    # a cap of a quarter of the gradient on whole tensors: the output layer's bucket and one per hidden layer
    assert claims["ch07/trace_allreduces/bucketed"] == [5, 5]
    assert claims["ch07/trace_overlap_fraction/bucketed"] > 0.0
    assert claims["ch07/trace_files_bytes"] < 2e6  # small enough to keep under build/
