"""Adaptive gradient clipping (course_lib.agc) against a direct formula, and the normaliser-free ResNet it trains."""

import math

import pytest
import torch
from torch import nn

from course_lib import agc
from course_lib.models import NFResNet, ResNet, ScaledStdConv2d


def direct_clip(weight: torch.Tensor, grad: torch.Tensor, clipping: float, eps: float) -> torch.Tensor:
    """The paper's rule written unit by unit in float64: G_i <- clipping * max(|W_i|, eps) / |G_i| * G_i
    where |G_i| / max(|W_i|, eps) > clipping. A vector (or scalar) is one unit."""
    w, g = weight.double(), grad.double()
    if w.dim() <= 1:
        w, g = w.reshape(1, -1), g.reshape(1, -1)
    out = g.clone()
    for i in range(w.shape[0]):
        w_norm = max(math.sqrt(float((w[i] ** 2).sum())), eps)
        g_norm = math.sqrt(float((g[i] ** 2).sum()))
        if g_norm / w_norm > clipping:
            out[i] = g[i] * (clipping * w_norm / g_norm)
    return out.reshape(grad.shape)


def with_grad(shape: tuple[int, ...], w_scale: float, g_scale: float, seed: int) -> nn.Parameter:
    gen = torch.Generator().manual_seed(seed)
    p = nn.Parameter(torch.randn(shape, generator=gen) * w_scale)
    # a spread of sizes per unit, so some units are clipped and some are not
    rows = torch.logspace(-2, 1, shape[0] if len(shape) else 1).view(-1, *([1] * (len(shape) - 1))) if shape else 1.0
    p.grad = torch.randn(shape, generator=gen) * g_scale * rows
    return p


@pytest.mark.parametrize("shape", [(7, 5), (6, 3, 3, 3), (4, 2, 1, 1), (9,), ()])
@pytest.mark.parametrize("clipping", [0.01, 0.1])
def test_matches_the_direct_formula_on_linear_conv_and_vector_parameters(shape, clipping):
    p = with_grad(shape, 0.3, 0.05, seed=len(shape))
    expected = direct_clip(p.detach(), p.grad, clipping, 1e-3)
    agc.adaptive_clip_([p], clipping=clipping)
    torch.testing.assert_close(p.grad.double(), expected, rtol=1e-5, atol=1e-7)


def test_units_under_the_threshold_are_left_bit_for_bit_and_clipped_ones_reach_it():
    p = with_grad((8, 4, 3, 3), 0.2, 0.02, seed=1)
    before = p.grad.clone()
    w_norm = p.detach().flatten(1).norm(dim=1)
    ratio = before.flatten(1).norm(dim=1) / w_norm
    share = agc.adaptive_clip_([p], clipping=0.05)
    over = ratio > 0.05
    assert 0 < over.sum() < len(over)  # both kinds present
    assert torch.equal(p.grad[~over], before[~over])  # per output channel, not per tensor
    torch.testing.assert_close(p.grad[over].flatten(1).norm(dim=1), 0.05 * w_norm[over])
    # the direction of every unit is kept
    cos = torch.nn.functional.cosine_similarity(p.grad.flatten(1), before.flatten(1), dim=1)
    torch.testing.assert_close(cos, torch.ones(8))
    assert share.item() == pytest.approx(over.float().mean().item())


def test_the_eps_floor_lets_zero_weights_move_by_clipping_times_eps():
    p = nn.Parameter(torch.zeros(5, 3))
    p.grad = torch.ones(5, 3)
    agc.adaptive_clip_([p], clipping=0.1, eps=1e-3)
    torch.testing.assert_close(p.grad.norm(dim=1), torch.full((5,), 0.1 * 1e-3))
    q = nn.Parameter(torch.full((4,), 1e-5))  # a vector under the floor: one unit, floored
    q.grad = torch.ones(4)
    agc.adaptive_clip_([q], clipping=0.5, eps=1e-2)
    torch.testing.assert_close(q.grad.norm(), torch.tensor(0.5 * 1e-2))


def test_zero_and_missing_gradients_and_the_share_over_several_parameters():
    a = with_grad((3, 4), 1.0, 10.0, seed=2)  # every row far over 0.01
    b = nn.Parameter(torch.randn(6, 2))
    b.grad = torch.zeros(6, 2)  # never over, stays zero (no 0 / 0)
    c = nn.Parameter(torch.randn(5))  # no gradient: skipped
    share = agc.adaptive_clip_([a, b, c], clipping=0.01)
    assert torch.equal(b.grad, torch.zeros(6, 2)) and c.grad is None
    assert share.item() == pytest.approx(3 / 9)  # 3 of a's rows, of 3 + 6 units with gradients
    assert agc.adaptive_clip_([c]).item() == 0.0


def test_bad_arguments_are_refused():
    p = with_grad((2, 2), 1.0, 1.0, seed=3)
    for bad in (0.0, -0.1):
        with pytest.raises(ValueError, match="clipping"):
            agc.adaptive_clip_([p], clipping=bad)
    with pytest.raises(ValueError, match="eps"):
        agc.adaptive_clip_([p], clipping=0.1, eps=-1.0)


def test_the_final_classifier_is_left_out_by_name():
    for model in (NFResNet(8), ResNet(8)):
        kept = agc.clippable_parameters(model)
        fc = {id(p) for p in model.fc.parameters()}
        assert not fc & {id(p) for p in kept}
        assert len(kept) == len(list(model.parameters())) - 2
    with pytest.raises(ValueError, match="no module named"):
        agc.clippable_parameters(NFResNet(8), skip=("head",))


def test_the_hook_clips_before_every_step_and_the_loop_is_unchanged():
    torch.manual_seed(0)
    model, x, y = NFResNet(8), torch.randn(4, 3, 8, 8), torch.tensor([0, 1, 2, 3])
    twin = NFResNet(8)
    twin.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    hook = agc.AdaptiveClip(opt, agc.clippable_parameters(model), clipping=0.01)
    opt_twin = torch.optim.SGD(twin.parameters(), lr=0.5)
    for _ in range(2):
        for net, o in ((model, opt), (twin, opt_twin)):
            o.zero_grad()
            nn.functional.cross_entropy(net(x), y).backward()
        agc.adaptive_clip_(agc.clippable_parameters(twin), clipping=0.01)  # by hand for the twin
        opt.step()
        opt_twin.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b)
    assert len(hook.shares) == 2 and 0 < hook.mean_share() <= 1
    hook.remove()
    opt.step()
    assert len(hook.shares) == 2
    with pytest.raises(ValueError):
        agc.AdaptiveClip(opt, model.parameters(), clipping=0.0)


# ----- the normaliser-free ResNet ---------------------------------------------------------


def test_scaled_weight_standardisation_gives_zero_mean_unit_norm_filters_times_their_gain():
    conv = ScaledStdConv2d(5, 7, 3, padding=1)
    with torch.no_grad():
        conv.weight.normal_(3.0, 2.0)  # far from standardised
        conv.gain.uniform_(0.5, 2.0)
    w = conv.standardized_weight().flatten(1)
    torch.testing.assert_close(w.mean(1), torch.zeros(7), atol=1e-6, rtol=0)
    torch.testing.assert_close(w.norm(dim=1), conv.gain.detach(), rtol=1e-5, atol=1e-6)
    x = torch.randn(64, 5, 12, 12)  # unit-variance inputs give unit-variance outputs (less the border's zeros)
    with torch.no_grad():
        conv.gain.fill_(1.0)
        conv.bias.zero_()
        out = conv(x)[:, :, 1:-1, 1:-1]
    assert 0.85 < out.var().item() < 1.15


def test_nf_resnet_tracks_its_expected_variance_and_ignores_batch_mates():
    torch.manual_seed(0)
    model = NFResNet(16, blocks=(2, 2, 2), alpha=0.2)
    a2 = 0.2**2
    # grows by alpha^2 a block, reset after each block with a projection shortcut (the first of stages 2 and 3)
    expected = [1.0, 1.0 + a2, 1.0 + 2 * a2, 1.0 + a2, 1.0 + 2 * a2, 1.0 + a2, 1.0 + 2 * a2]
    assert model.expected_var == pytest.approx(expected)
    assert [b.beta for b in model.layers] == pytest.approx([math.sqrt(v) for v in expected[:-1]])
    x = torch.randn(256, 3, 16, 16)
    measured = []
    with torch.no_grad():
        h = model.stem(x)
        for block in model.layers:
            measured.append(h.var().item())
            h = block(h)
        measured.append(h.var().item())
    for got, want in zip(measured, expected):
        assert abs(got - want) < 0.15 * want, (measured, expected)
    with torch.no_grad():  # no batch statistics: a sample's output is its own
        alone = model(x[:1])
        together = model(x[:8])[:1]
    torch.testing.assert_close(alone, together, rtol=1e-4, atol=1e-5)
    assert not any(isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)) for m in model.modules())
