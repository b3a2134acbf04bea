"""course_lib.fp8 and fp8_linear: the formats, the scalings, the FP8 layer, and their errors."""

from __future__ import annotations

import pytest
import torch

from course_lib import fp8, fp8_linear


def test_formats_and_unknown_name():
    assert fp8.get_format("e4m3").max == 448 and fp8.get_format("e5m2").max == 57344
    assert fp8.get_format("e4m3").bytes == 1 and fp8.get_format("bf16").bytes == 2
    with pytest.raises(ValueError, match="unknown format 'e3m4'.*e4m3"):
        fp8.get_format("e3m4")


def test_dynamic_scale_maps_amax_to_the_largest_value():
    x = torch.tensor([0.5, -2.0, 1.0])
    s = fp8.dynamic_scale(x, "e4m3")
    assert float(s) == pytest.approx(448 / 2.0)
    assert float(fp8.quantize(x, "e4m3", s).float().abs().max()) == 448
    assert float(fp8.dynamic_scale(torch.zeros(3), "e4m3")) == 1.0


def test_quantize_clamps_instead_of_nan_and_qdq_rounds():
    q = fp8.quantize(torch.tensor([1000.0, -1000.0]), "e4m3")
    assert q.float().tolist() == [448.0, -448.0]  # a bare .to(float8_e4m3fn) gives NaN here
    x = torch.randn(1000)
    s = fp8.dynamic_scale(x, "e4m3")
    err = (fp8.qdq(x, "e4m3", s) - x).abs() / x.abs()
    normal = (x * s).abs() >= fp8.get_format("e4m3").min_normal  # below it (subnormals) precision falls off
    assert float(err[normal].max()) <= 2 ** -4 * (1 + 1e-6)      # round to nearest with 3 mantissa bits


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_inf_or_nan_is_a_clear_error(bad):
    with pytest.raises(ValueError, match="inf or NaN"):
        fp8.dynamic_scale(torch.tensor([1.0, bad]), "e4m3")


def test_zero_or_negative_scale_is_a_clear_error():
    for s in (0.0, -1.0):
        with pytest.raises(ValueError, match="finite and positive"):
            fp8.quantize(torch.ones(2), "e4m3", s)


def test_delayed_scaler_uses_the_history_and_records_after():
    d = fp8.DelayedScaler("e4m3", history=2)
    assert d.scale() == 1.0
    d.quantize(torch.tensor([2.0]))
    assert d.scale() == pytest.approx(224.0)
    d.quantize(torch.tensor([4.0]))
    d.quantize(torch.tensor([1.0]))          # history now [4, 1]
    assert d.scale() == pytest.approx(112.0)
    d.quantize(torch.tensor([1.0]))          # [1, 1]: the 4 has left the window
    assert d.scale() == pytest.approx(448.0)
    with pytest.raises(ValueError, match="history"):
        fp8.DelayedScaler("e4m3", history=0)


def test_block_scales_round_trip_and_are_per_tile():
    x = torch.randn(4, 8)
    x[0, 0] = 100.0
    q, s = fp8.quantize_blocks(x, "e4m3", (2, 4))
    assert s.shape == (2, 2)
    assert float(s[0, 0]) == pytest.approx(448 / 100.0) and float(s[1, 1]) > float(s[0, 0])
    back = fp8.dequantize_blocks(q, s, (2, 4))
    assert float(((back - x).abs() / x.abs()).max()) < 0.1
    with pytest.raises(ValueError, match="whole"):
        fp8.quantize_blocks(x, "e4m3", (3, 4))


def test_fp8_linear_equals_its_reference_and_backpropagates_in_fp8():
    torch.manual_seed(0)
    lin = fp8_linear.FP8Linear(32, 16)
    x = torch.randn(48, 32, requires_grad=True)
    y = lin(x)
    ref = fp8_linear.fp8_matmul_reference(x, lin.weight) + lin.bias
    assert torch.allclose(y, ref, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(y)
    y.backward(g)
    # the backward's reference: e5m2 gradient against the e4m3 copies, in float32
    gq = fp8.qdq(g, "e5m2", fp8.dynamic_scale(g, "e5m2"))
    wq = fp8.qdq(lin.weight, "e4m3", fp8.dynamic_scale(lin.weight, "e4m3"))
    xq = fp8.qdq(x, "e4m3", fp8.dynamic_scale(x, "e4m3"))
    assert torch.allclose(x.grad, gq @ wq, atol=1e-4, rtol=1e-4)
    assert torch.allclose(lin.weight.grad, gq.t() @ xq, atol=1e-4, rtol=1e-4)
    assert torch.allclose(lin.bias.grad, g.sum(0))


def test_to_fp8_linears_swaps_and_refuses_odd_sizes():
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    x = torch.randn(4, 16)
    before = m(x)
    fp8_linear.to_fp8_linears(m)
    assert all(isinstance(m[i], fp8_linear.FP8Linear) for i in (0, 2))
    assert float((m(x) - before).norm() / before.norm()) < 0.1
    with pytest.raises(ValueError, match="multiples of 16"):
        fp8_linear.to_fp8_linears(torch.nn.Sequential(torch.nn.Linear(10, 16)))
