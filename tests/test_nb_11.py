"""Chapter 11's claims, measured by the notebook at the test profile."""

from __future__ import annotations

import pytest
from conftest import notebook_claims

pytestmark = pytest.mark.notebook

EXACT = 1e-9  # ratios of byte or pair counts: exact unless a count is wrong


@pytest.fixture(scope="module")
def c() -> dict:
    return notebook_claims("11")


def test_merge_of_partial_results(c: dict) -> None:
    assert set(c["ch11/merge_max_diff"]) == {"plain/2", "zigzag/2", "plain/4", "zigzag/4"}
    assert max(c["ch11/merge_max_diff"].values()) < 1e-13
    assert c["ch11/merge_shifted_diff"] < 1e-10, "the running maximum keeps the exponentials finite"
    assert c["ch11/naive_shifted_overflows"] is True


def test_ring_schedule(c: dict) -> None:
    sched = c["ch11/ring_schedule_c4"]
    assert sched[0] == [0, 1, 2, 3], "each rank starts with its own block"
    assert sched[1] == [3, 0, 1, 2], "and then holds its left neighbour's"
    for r in range(4):
        assert sorted(step[r] for step in sched) == [0, 1, 2, 3], "every rank sees every block once"


def test_ring_equals_one_process(c: dict) -> None:
    assert c["ch11/ring_max_diff_float64"] < 1e-13


def test_causal_load_balance(c: dict) -> None:
    pairs = c["ch11/pairs_per_rank"]
    for ranks, ratio in c["ch11/plain_last_over_first"].items():
        k = int(ranks)
        plain = pairs[ranks]["plain"]
        n = round((2 * plain[0]) ** 0.5)  # rank 0: n(n+1)/2 pairs
        assert plain[0] == n * (n + 1) // 2
        assert abs(ratio - ((2 * k - 1) * n + 1) / (n + 1)) < EXACT
        assert 2 * k - 2 < ratio < 2 * k - 1, "about 2c - 1, below it"
        assert plain == sorted(plain) and len(set(plain)) == k, "work grows with the rank"
        assert sum(pairs[ranks]["zigzag"]) == sum(plain), "the same work in all"
    assert all(abs(v - 1) < EXACT for v in c["ch11/zigzag_max_over_min"].values())


def test_bytes_per_layer(c: dict) -> None:
    ratios = c["ch11/bytes_over_formula"]
    assert set(ratios) == {"plain/2", "zigzag/2", "plain/4", "zigzag/4"}
    assert all(abs(v - 1) < EXACT for r in ratios.values() for v in r.values()), ratios
    assert c["ch11/messages_per_layer"] == {"2": {"ring_kv": 1, "ring_kv_grad": 2},
                                            "4": {"ring_kv": 3, "ring_kv_grad": 4}}


def test_saved_activations_per_rank(c: dict) -> None:
    f = c["ch11/saved_per_rank_over_one_process"]
    assert abs(f["2"] - 1 / 2) < EXACT and abs(f["4"] - 1 / 4) < EXACT
    kib = c["ch11/saved_one_process_kib"]
    assert kib["naive"] > kib["one_process"], "the course's naive block also keeps the T x T softmax"


def test_cp_against_sp(c: dict) -> None:
    b = c["ch11/cp_over_sp_bytes"]
    assert abs(b["2"] - 1) < EXACT and abs(b["4"] - 20 / 24) < EXACT
    sp = c["ch11/sp_saved_fraction"]
    f = c["ch11/saved_per_rank_over_one_process"]
    assert sp["2"] > f["2"] and sp["4"] > f["4"], "torch's SP keeps the gathered linear inputs whole"
    assert abs(c["ch11/hop_flops_over_formula"] - 1) < EXACT
    assert abs(c["ch11/hop_visible_fraction"] - 0.5) < EXACT
    hide = c["ch11/hop_hides_from_tokens_per_rank"]
    assert 4000 < hide["nvlink"] < 5000 and abs(hide["infiniband"] / hide["nvlink"] - 9) < EXACT


def test_torch_api_on_this_backend(c: dict) -> None:
    ran = c["ch11/api_ran"]
    assert set(ran) == {"2", "4"}
    if c["ch11/api_backend"] == "gloo":  # torch 2.14 rings only the CUDA attention kernels
        assert not any(ran.values())
    else:
        assert all(ran.values())


def test_long_sequence_training(c: dict) -> None:
    assert all(d < 1e-4 for d in c["ch11/train_loss_diff"].values())
    assert all(abs(r - 1) < EXACT for r in c["ch11/step_bytes_over_formula"].values())
    peak = c["ch11/peak_kib"]
    assert peak["1"] > peak["2"] > peak["4"], "the peak per rank falls with c"
    assert peak["4"] > peak["1"] / 4, "but not to 1/c: the model states are whole on every rank"
    assert set(c["ch11/step_seconds"]) == {"2", "4"}
