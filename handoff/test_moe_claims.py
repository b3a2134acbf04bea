"""Chapter 11's mixture-of-experts claims: append these tests to tests/test_nb_11.py (they use its fixture ``c``)."""

from __future__ import annotations

import pytest

EXACT = 1e-9  # ratios of counts: exact unless a count is wrong
FLOAT64 = 1e-12


def test_moe_layer_by_hand(c: dict) -> None:
    assert c["ch11/moe_layer_vs_token_by_token"] < FLOAT64
    assert c["ch11/moe_output_of_dropped_tokens"] == 0.0, "a token that lost every choice gets exactly zero"
    drops = c["ch11/moe_drop_rate_untrained"]
    assert drops["k=1, factor 1"] > 0 and drops["k=2, factor 1"] > 0, "an untrained router overflows some expert"
    no_drop = [v for key, v in drops.items() if not key.endswith("factor 1")]
    assert no_drop == [0.0, 0.0], "capacity factor E/k drops nothing"


def test_drop_rate_against_capacity_factor(c: dict) -> None:
    curves = c["ch11/moe_drop_vs_factor_init"]
    for name, curve in curves.items():
        rates = list(curve.values())
        assert rates == sorted(rates, reverse=True), f"{name}: more capacity never drops more"
        # room for a fraction f of the choices drops at least 1 - f of them, and at f = 1 an uneven router drops some
        assert all(r >= 1 - float(f) - EXACT for f, r in curve.items()), f"{name}: {curve}"
        assert curve["1.0"] > 0 and rates[-1] < curve["1.0"] / 3, f"{name}: three times the room drops far less"
    tokens = c["ch11/moe_tokens_per_expert_init"]
    assert sum(tokens["k=2"]) == 2 * sum(tokens["k=1"]), "k choices per token"
    assert max(tokens["k=1"]) > sum(tokens["k=1"]) / len(tokens["k=1"]), "an untrained router is uneven"


def test_auxiliary_loss(c: dict) -> None:
    aux = c["ch11/moe_aux_even_and_collapsed"]
    assert aux["even"] == pytest.approx(1.0) and aux["collapsed"] == pytest.approx(aux["E"])
    seeds = c["ch11/moe_balance_seeds"]
    assert seeds >= 2
    free, balanced = c["ch11/moe_balance"]["aux 0"], c["ch11/moe_balance"]["aux 0.1"]
    for s in range(seeds):  # on every seed, not only on average
        assert balanced["imbalance"][s] < free["imbalance"][s] - 0.3, (s, free, balanced)
        assert balanced["drop_rate"][s] < free["drop_rate"][s]
        assert balanced["starved"][s] == 0 < free["starved"][s]
        assert balanced["loss"][s] < free["loss"][s], "dropped tokens and starved experts cost task loss"
        assert balanced["drop_vs_factor"][s][3] < free["drop_vs_factor"][s][3]  # capacity factor 1.25
    assert max(balanced["imbalance"]) < 1.75 < min(free["imbalance"])


def test_expert_parallel_equals_one_process(c: dict) -> None:
    assert c["ch11/ep_max_diff_float64"] < FLOAT64
    runs = set(c["ch11/ep_runs"])
    assert {f"{lay}/k={k}/by_hand" for lay in ("2x1", "4x1", "2x2") for k in (1, 2)} | {"2x1/k=2/torch"} == runs


def test_expert_parallel_bytes(c: dict) -> None:
    assert all(abs(v - 1) < EXACT for v in c["ch11/ep_sent_over_rows_crossed"].values())
    assert all(abs(v - 1) < EXACT for v in c["ch11/ep_counts_over_formula"].values())
    for key, ratios in c["ch11/ep_sent_over_even_formula"].items():
        # the formula is even routing; a random router sends more to some ranks, less to others
        assert 0.5 < sum(ratios) / len(ratios) < 1.5, key
    assert all(abs(v - 1) < EXACT for v in c["ch11/ep_grad_sync_over_formula"].values())


def test_expert_parallel_memory(c: dict) -> None:
    assert all(v == 1.0 for v in c["ch11/ep_params_over_formula"].values())
    assert c["ch11/ep_expert_share_per_rank"] == {"2x1": 0.5, "4x1": 0.25, "2x2": 0.5}
    factor = c["ch11/ep_dispatch_factor"]
    for k, b in c["ch11/ep_dispatch_buffers"].items():
        assert all(rows <= b["padded_rows"] for rows in b["recv_rows"]), "no rank gets past the padded buffer"
        assert b["padded_rows"] >= factor * b["even_rows"], "E x C rows: the capacity rounds up"
        assert b["padded_kib"] * 1024 == pytest.approx(factor * b["even_rows"] * b["row_bytes"])
        assert sum(b["send_rows"]) == sum(b["recv_rows"]), "every row sent is received"
        assert all(s == round((1 - d) * b["even_rows"]) for s, d in zip(b["send_rows"], b["drop_rate"]))


def test_bad_input_is_explained(c: dict) -> None:
    bad = c["ch11/moe_bad_input"]
    assert "capacity_factor must be > 0" in bad["capacity factor 0"]
    assert "4 experts for 3 tokens" in bad["more experts than tokens"]
    assert "cannot share 8 experts" in bad["3 ranks for 8 experts"]
