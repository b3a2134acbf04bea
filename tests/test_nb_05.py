"""Chapter 05's claims, measured by the notebook at the test profile.

Step times are recorded but not asserted (CI machines are shared and noisy);
the cost of recomputation is asserted through exact counts instead: forward
calls per block and matmul FLOPs.
"""

import math

import pytest
from conftest import notebook_claims, variants

N_BLOCKS = 16


@pytest.fixture(scope="module", params=variants("05"), ids=lambda v: v or "measured")
def c(request) -> dict:
    """The claims as this CPU's kernels ran them, then with bf16 forced broken (its emulated twin runs)."""
    return notebook_claims("05", request.param)


def test_checkpointing_claims(c):
    # what autograd saves: one block output per Linear+ReLU block, plus the chain's input
    assert abs(c["ch05/chain_saved_units"] - (N_BLOCKS + 1)) < 0.01
    # identical gradients: by hand, library, torch.utils.checkpoint.checkpoint_sequential
    assert c["ch05/grad_max_abs_diff"] <= 1e-6
    assert c["ch05/grad_max_abs_diff_checkpoint_sequential"] <= 1e-6
    # Chen et al.: peak ~ n/k + k, lowest near sqrt(n)
    assert c["ch05/best_k_formula"] == round(math.sqrt(N_BLOCKS))
    assert abs(c["ch05/best_k_measured"] - math.sqrt(N_BLOCKS)) <= 2  # the valley is flat: 3..6
    assert c["ch05/peak_at_formula_k_over_min"] <= 1.05
    assert c["ch05/peak_ratio_best_k"] <= 0.6
    assert c["ch05/formula_max_rel_error"] <= 0.1
    # the price: exactly one extra forward per block outside the last segment, never more
    assert c["ch05/forward_calls_match_plan"] is True
    assert 0 < c["ch05/max_extra_forward_fraction"] <= 1.0
    # in matmul FLOPs (counted): a step is 3n - 1 forwards' worth (the first block's input needs no gradient), the
    # 12 recomputed block forwards of k = 4 add 12 / 47, under the third that the 2:1 backward:forward rule allows
    assert abs(c["ch05/chain_forward_flops_share"] - N_BLOCKS / (3 * N_BLOCKS - 1)) < 1e-9
    assert abs(c["ch05/chain_flops_ratio_best_k"] - (1 + 12 / (3 * N_BLOCKS - 1))) < 1e-9
    assert c["ch05/chain_flops_ratio_best_k"] <= 1 + 1 / 3
    # dropout: same gradients because the RNG state is replayed; different without it
    assert c["ch05/dropout_grad_rel_diff"] <= 1e-6
    assert c["ch05/dropout_grad_rel_diff_without_rng_state"] > 0.01


def test_selective_checkpointing_claims(c):
    assert c["ch05/tf_peak_ratio_full"] < c["ch05/tf_peak_ratio_selective"] < 0.9
    assert c["ch05/tf_peak_ratio_full"] <= 0.6
    # full recomputes every block forward (at most a third of a step's FLOPs), selective only the attention matmuls
    assert 0 < c["ch05/tf_extra_flops_selective"] < c["ch05/tf_extra_flops_full"] <= 1 / 3 + 1e-9
    assert c["ch05/tf_grad_max_abs_diff_full"] <= 1e-6
    assert c["ch05/tf_grad_max_abs_diff_selective"] <= 1e-6


def test_mixed_precision_claims(c):
    # bf16 matmuls native where this CPU runs them so, else emulated; the bytes are the same either way
    assert c["ch05/bf16_matmuls"] in ("native", "emulated")
    assert 0.45 <= c["ch05/bf16_saved_ratio_chain"] <= 0.55  # every saved tensor in bf16: half
    assert c["ch05/bf16_saved_fp32_fraction_chain"] == 0
    assert 0.45 <= c["ch05/bf16_saved_ratio_tf"] <= 0.65  # residual stream, layer norm, loss stay fp32
    assert 0.05 <= c["ch05/bf16_saved_fp32_fraction_tf"] <= 0.4
    assert 1e-4 < c["ch05/bf16_grad_rel_error"] < 0.05  # bf16 keeps about 3 decimal digits (eps 2^-8)
    assert c["ch05/bf16_loss_rel_diff"] < 0.01


def test_accumulation_and_experiment_claims(c):
    both = c["ch05/accum_ckpt_peak_ratio"]
    assert both < c["ch05/accum_only_peak_ratio"] < 1 and both < c["ch05/ckpt_only_peak_ratio"] < 1
    assert c["ch05/accum_ckpt_grad_max_abs_diff"] < 1e-6
    # the longest lengths are measured: a real step at each fits the budget and one step longer does not
    assert c["ch05/exp_boundary_measured"] is True
    longest = {(m, p): c[f"ch05/exp_longest_seq_{m}_{p}"] for m in ("none", "full", "selective")
               for p in ("fp32", "bf16")}
    assert longest[("full", "fp32")] > longest[("none", "fp32")] > 0
    for p in ("fp32", "bf16"):
        assert longest[("none", p)] <= longest[("selective", p)] <= longest[("full", p)]
    for m in ("none", "full", "selective"):
        assert longest[(m, "bf16")] >= longest[(m, "fp32")]
    assert c["ch05/exp_peak_ratio_full_fp32"] < c["ch05/exp_peak_ratio_selective_fp32"] < 1
    assert c["ch05/exp_peak_ratio_bf16_none"] < 0.7
    # the parabola through three short steps starts the search near the answer: a handful of real steps at most
    # (2 when it was right; measured 2-6 at smoke, 2 at cpu)
    assert all(2 <= k <= 8 for k in c["ch05/exp_check_steps"].values())
    for key in ("ch05/chain_time_ratio_best_k", "ch05/chain_time_ratio_predicted", "ch05/tf_time_ratio_full",
                "ch05/exp_time_ratio_full_fp32"):
        assert c[key] > 0  # recorded for the report; see the module docstring
