"""The claims of notebooks/07_pipeline_parallel.ipynb, measured at the test profile."""

from __future__ import annotations

import pytest

from conftest import notebook_claims

pytestmark = [pytest.mark.notebook, pytest.mark.slow]


@pytest.fixture(scope="module")
def claims() -> dict:
    return notebook_claims("07")


def test_bubble_formula_figures(claims):
    assert claims["ch07/bubble_naive"] == pytest.approx(0.75)           # p = 4, m = 1: (p-1)/p
    assert claims["ch07/bubble_at_m_4p"] < 0.2                           # GPipe's m = 4p advice


def test_simulator_equals_formula_exactly(claims):
    assert claims["ch07/sim_bubble_max_abs_error"] < 1e-12


def test_inflight_gpipe_m_and_1f1b_p_minus_s(claims):
    gpipe, ofob = claims["ch07/sim_peak_inflight_gpipe"], claims["ch07/sim_peak_inflight_1f1b"]
    p, m = len(gpipe), gpipe[0]
    assert gpipe == [m] * p
    assert ofob == [min(p - s, m) for s in range(p)]
    assert claims["ch07/exec_peak_inflight_gpipe"] == gpipe              # the real run holds what the simulator says
    assert claims["ch07/exec_peak_inflight_1f1b"] == ofob


def test_zero_bubble_third_of_1f1b_idle(claims):
    assert claims["ch07/zb_idle_ratio_to_1f1b"] == pytest.approx(1 / 3, abs=1e-9)


def test_interleaving_divides_the_idle_time_by_v(claims):
    p = len(claims["ch07/sim_peak_inflight_gpipe"])
    assert claims["ch07/interleaved_bubble_max_abs_error"] < 1e-12      # (p-1)/(v m + p - 1)
    for v in (1, 2, 4):
        assert claims[f"ch07/interleaved_idle_ratio_v{v}"] == pytest.approx(1 / v, abs=1e-9)
        # the first device holds p (1 + (p-1)/(p v)) micro-batches' activations (Korthikanti et al. 2022)
        held = p * (1 + (p - 1) / (p * v)) if v > 1 else p               # v = 1 is plain 1F1B
        assert claims[f"ch07/interleaved_stage0_inflight_v{v}"] == pytest.approx(held)


def test_pipelines_equal_the_sequential_model(claims):
    for key in ("byhand_grad_max_abs_diff", "exec_output_max_abs_diff", "exec_grad_max_abs_diff",
                "torch_output_max_abs_diff", "torch_grad_max_abs_diff"):
        assert claims[f"ch07/{key}"] < 1e-5, key


def test_measured_bubble_within_005_of_formula(claims):
    assert claims["ch07/exec_bubble_error_gpipe"] <= 0.05
    assert claims["ch07/exec_bubble_error_1f1b"] <= 0.05
    assert claims["ch07/exp_bubble_max_abs_error"] <= 0.05


def test_activation_memory(claims):
    # measured bytes = in-flight count x bytes of one micro-batch, exactly
    assert claims["ch07/exec_peak_bytes_vs_predicted_gpipe"] < 1e-9
    assert claims["ch07/exec_peak_bytes_vs_predicted_1f1b"] < 1e-9
    # the largest m of every profile's sweep is at least 2p: GPipe's stage 0 holds at least twice 1F1B's
    assert claims["ch07/exp_stage0_bytes_ratio_gpipe_1f1b"] >= 2.0 - 1e-9
    assert claims["ch07/exp_1f1b_stage0_bytes_spread"] == pytest.approx(1.0)   # 1F1B flat once m >= p
