"""NaiveDDP, BucketedDDP and torch DDP equal one process on the whole batch (2 gloo ranks, one launch)."""

from __future__ import annotations

import pytest

from course_lib.distributed import launch
from course_lib.distributed.ddp import BucketedDDP, NaiveDDP, assign_buckets
from course_lib.models import MLP

TOL = 1e-5
WORLD = 2


@pytest.fixture(scope="module")
def result() -> dict:
    # one launch for every check: starting ranks is the slow part on a small machine
    return launch.run("course_lib.workers.ddp_compare", WORLD,
                      ["--steps", "4", "--timing-rounds", "1", "--timing-steps", "2", "--timing-in", "128",
                       "--timing-hidden", "128", "128", "--bn"], timeout=240)


@pytest.mark.parametrize("scenario", ["frozen_shared", "reentrant", "unused"])
@pytest.mark.parametrize("kind", ["naive", "bucketed", "torch"])
def test_equal_to_single_process(result, scenario, kind):
    r = result["equal"][scenario][kind]
    assert r["grad_diff"] < TOL, f"{kind} gradients differ from one process ({scenario}): {r['grad_diff']}"
    assert r["param_diff"] < TOL, f"{kind} parameters differ after the steps ({scenario}): {r['param_diff']}"
    assert r["none_match"], f"{kind}: a parameter without gradient in one process got one (or the reverse)"


def test_hooks_fire_twice_under_reentrant_checkpoint(result):
    r = result["equal"]["reentrant"]
    assert r["bucketed"]["max_hook_calls"] == 2, "the checkpointed shared block accumulates twice per backward"
    assert r["bucketed"]["resent"] == 0, "with learned counts no bucket should leave early"
    assert r["bucketed_first_call"]["resent"] > 0, "sending at the first hook call sends stale gradients"


def test_graph_change_resends_and_stays_equal(result):
    r = result["equal"]["unused"]["bucketed"]
    assert r["resent"] >= 1, "the aux head, unused on step 0, arrives late on odd steps: its bucket is re-sent"


def test_no_sync_saves_k_minus_1_all_reduces(result):
    n = result["no_sync"]
    k = n["k"]
    for kind in ("torch", "bucketed"):
        assert n[f"{kind}_every_micro_batch"] == k * n[f"{kind}_no_sync"], n
        assert n[f"{kind}_grad_diff"] < 1e-6, "no_sync must give the same accumulated gradient"
    assert n["bucketed_buckets"] >= 2


def test_communication_volume(result):
    t = result["timing"]
    factor = 2 * (WORLD - 1) / WORLD
    assert t["sent"]["naive"]["bytes"] == factor * t["grad_bytes"]
    assert t["sent"]["torch"]["bytes"] == factor * t["grad_bytes"]
    # BucketedDDP adds a 4-byte "has a gradient" flag per tensor and a "sent too early" flag per bucket
    buckets = t["sent"]["bucketed"]["messages"]
    assert t["sent"]["bucketed"]["bytes"] == factor * (t["grad_bytes"] + 4 * (t["tensors"] + buckets))
    assert t["sent"]["naive"]["messages"] == t["tensors"], "NaiveDDP sends one message per tensor"
    assert t["sent"]["bucketed"]["messages"] < t["tensors"]


def test_sync_batchnorm(result):
    bn = result["batchnorm"]
    assert bn["sync_bn_by_hand_grad_diff"] < TOL
    assert bn["per_rank_bn_grad_diff"] > 1e-4, "per-rank statistics should change the gradient"
    assert bn["per_rank_bn_grad_diff"] > 100 * bn["sync_bn_by_hand_grad_diff"]
    assert bn["per_rank_bn_running_mean_spread"] > 0 and bn["sync_bn_by_hand_running_mean_spread"] == 0


def test_assign_buckets():
    assert assign_buckets([4, 4, 4, 4], cap_bytes=8) == [[3, 2], [1, 0]], "reverse order, two per bucket"
    assert assign_buckets([4, 20, 4], cap_bytes=8) == [[2], [1], [0]], "a tensor over the cap sits alone"
    assert assign_buckets([4, 4, 4], cap_bytes=100, keys=["a", "b", "b"]) == [[2, 1], [0]]
    assert assign_buckets([4, 4, 4, 4], cap_bytes=100, first_cap_bytes=4) == [[3], [2, 1, 0]]
    assert assign_buckets([], cap_bytes=8) == []
    with pytest.raises(ValueError, match="positive"):
        assign_buckets([4], cap_bytes=0)


def test_wrappers_need_a_process_group():
    with pytest.raises(RuntimeError, match="process group"):
        NaiveDDP(MLP(8, (4,)))
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        BucketedDDP(MLP(8, (4,)), bucket_cap_mb=0)
