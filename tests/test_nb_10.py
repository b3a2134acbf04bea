"""Chapter 10's claims, measured by the notebook at the test profile."""

from __future__ import annotations

import pytest
from conftest import notebook_claims

pytestmark = pytest.mark.notebook

EXACT = 1e-9  # ratios of byte counts: exact unless a count is wrong


@pytest.fixture(scope="module")
def c() -> dict:
    return notebook_claims("10")


def test_splits_by_hand_in_one_process(c: dict) -> None:
    assert max(c["ch10/split_max_diff"].values()) < 1e-12
    assert c["ch10/gelu_of_partial_sums_diff"] > 1e-2, "GeLU of partial sums is not the GeLU of the sum"
    attn = c["ch10/attention_diff"]
    assert attn["head_major"] < 1e-12 and attn["heads_split"] < 1e-12
    assert attn["naive_rows"] > 1e-2, "contiguous rows of [q | k | v] are not whole heads"


def test_vocab_parallel(c: dict) -> None:
    assert c["ch10/vocab_parallel_max_diff"] < 1e-12, "loss and every gradient equal one process in float64"
    ratios = c["ch10/vocab_parallel_bytes_ratio"]
    assert set(ratios) == {"t=2", "t=4"}
    for t, parts in ratios.items():
        assert set(parts) == {"embedding", "head", "loss"}
        assert all(abs(r - 1) < EXACT for r in parts.values()), f"{t}: {parts}"
    over = dict(c["ch10/vocab_parallel_loss_over_gathered"])
    vocab = over.pop("vocab")
    assert all(abs(r * vocab / 6 - 1) < EXACT for r in over.values()), "3 numbers per token where the logits are v"


def test_f_and_g(c: dict) -> None:
    total = c["ch10/sum_of_values"]
    assert total == 10  # ranks hold 1, 2, 3, 4
    assert c["ch10/f"] == {"forward": 1.0, "backward": total}
    assert c["ch10/g"] == {"forward": total, "backward": 1.0}


def test_shard_shapes(c: dict) -> None:
    s = c["ch10/local_shapes_t2"]
    h = s["ln1.weight"][0]
    assert s["attn.qkv.weight"] == [3 * h // 2, h] and s["attn.proj.weight"] == [h, h // 2]
    assert s["mlp.0.weight"] == [2 * h, h] and s["mlp.2.weight"] == [h, 2 * h]
    assert s["attn.proj.bias"] == s["mlp.2.bias"] == [h], "row-parallel biases stay whole"


def test_split_blocks_equal_one_process(c: dict) -> None:
    assert c["ch10/max_diff_float64"] < 1e-12
    assert c["ch10/max_diff_float32"] < 1e-4


def test_bytes_and_calls_per_block(c: dict) -> None:
    ratios = c["ch10/comm_over_formula"]
    assert {"tp/2", "tp/4", "sp/2", "sp/4", "sp_regather/4", "api_tp/4", "api_sp/4"} <= set(ratios)
    assert all(abs(r - 1) < EXACT for r in ratios.values()), ratios
    calls = c["ch10/calls_per_block"]
    assert calls["tp/4"] == {"forward": {"all_reduce": 2}, "backward": {"all_reduce": 2}}
    assert calls["sp/4"] == {"forward": {"all_gather": 2, "reduce_scatter": 2},
                             "backward": {"all_gather": 2, "reduce_scatter": 2}}
    assert calls["sp_regather/4"]["backward"] == {"all_gather": 4, "reduce_scatter": 2}
    assert all(abs(v - 1) < EXACT for v in c["ch10/sp_over_tp_bytes"].values()), "SP moves what TP moves"
    assert all(abs(v - 1.25) < EXACT for v in c["ch10/regather_over_tp_bytes"].values())
    assert all(abs(v - 1) < EXACT for v in c["ch10/sp_sync_bytes_over_formula"].values())


def test_activation_formula(c: dict) -> None:
    s, h, a = 2048, 12288, 96  # the paper's GPT-3 example, Table 2
    gb = c["ch10/gpt3_layer_activation_gb"]
    assert gb["t=1"] == pytest.approx(s * h * (34 + 5 * a * s / h) / 1e9)
    assert gb["tp t=8"] == pytest.approx(s * h * (10 + 24 / 8 + 5 * a * s / (8 * h)) / 1e9)
    assert gb["tp+sp t=8"] == pytest.approx(s * h * (34 + 5 * a * s / h) / 8 / 1e9)


def test_activations_measured_per_rank(c: dict) -> None:
    assert all(r == 1.0 for r in c["ch10/saved_over_formula"].values()), c["ch10/saved_over_formula"]
    f = c["ch10/saved_fraction_of_one_process"]
    for t in (2, 4):
        assert f[f"tp/{t}"] > f[f"sp/{t}"] > f[f"sp_regather/{t}"]
        # with the regather all but the s x s mask falls as 1/t
        assert abs(f[f"sp_regather/{t}"] * t - 1) < 0.01
    assert f["tp/4"] < f["tp/2"] and f["sp/4"] < f["sp/2"]


def test_tp_stays_in_a_node(c: dict) -> None:
    r = c["ch10/comm_over_compute"]
    assert r["nvlink"] < 0.5 < 1 < r["infiniband"]
    assert r["infiniband"] / r["nvlink"] == pytest.approx(9)  # 450 GB/s against 50 GB/s


def test_real_api(c: dict) -> None:
    for method, r in c["ch10/api_vs_by_hand"].items():
        assert r["same_traffic"] is True, f"{method}: torch's plan should send what the layers by hand send"
        assert r["saved_over_hand"] == 1.0
    assert c["ch10/local_output_backward_calls"] == {"all_gather": 2, "all_reduce": 2}
    assert abs(c["ch10/local_output_backward_bytes_ratio"] - 1.5) < EXACT


def test_2d_mesh(c: dict) -> None:
    p = c["ch10/mesh_placements"]
    assert p["blocks.0.attn.proj.weight"] == "(Shard(dim=0), Shard(dim=1))"
    assert p["blocks.0.attn.qkv.weight"].startswith("(_StridedShard(dim=0")
    assert all(d < 1e-10 for d in c["ch10/mesh_param_diff_float64"].values())
    assert all(d < 1e-5 for d in c["ch10/mesh_loss_diff_float32"].values())
    for layout, parts in c["ch10/mesh_held_over_formula"].items():
        assert all(r == 1.0 for r in parts.values()), f"{layout}: {parts}"
    assert all(r == 1.0 for r in c["ch10/mesh_saved_over_formula"].values())
    partial = c["ch10/partial_grads"]
    assert partial["4x1"] == partial["2x2"] == 0 and partial["1x4"] > 0 and partial["1x4"] % 4 == 0
    assert c["ch10/lazy_allreduces_per_partial_grad"] == 3.0


def test_layouts(c: dict) -> None:
    t = c["ch10/layout_table"]
    assert t["4x1"]["states_mb"] < t["2x2"]["states_mb"] < t["1x4"]["states_mb"]
    assert t["4x1"]["activations_mb"] < t["2x2"]["activations_mb"] < t["1x4"]["activations_mb"]
    assert t["4x1"]["tp_kb"] == 0 and t["1x4"]["fsdp_kb"] == 0 and t["2x2"]["tp_kb"] > 0 < t["2x2"]["fsdp_kb"]
    for layout, (tp, fsdp) in c["ch10/layout_traffic_over_formula"].items():
        assert abs(tp - 1) < EXACT and abs(fsdp - 1) < EXACT, f"{layout}: TP {tp}, FSDP {fsdp}"
