"""course_lib.norms: GroupNorm by hand, MABN and its backward, weight centralisation, folding."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from course_lib import norms
from course_lib.models import ResNet

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _mabn(channels: int = 4, **kw) -> norms.MABN2d:
    layer = norms.MABN2d(channels, **kw).double()
    with torch.no_grad():
        layer.weight.uniform_(0.5, 1.5)
        layer.bias.normal_()
    return layer


# ----- GroupNorm -----------------------------------------------------------------------


@pytest.mark.parametrize("groups,shape", [(1, (3, 8, 5, 5)), (4, (3, 8, 5, 5)), (8, (3, 8, 5, 5)), (2, (4, 6, 7))])
def test_group_norm_equals_torch_in_outputs_and_gradients(groups, shape):
    torch.manual_seed(0)
    x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    ours = norms.GroupNorm(groups, shape[1]).double()
    with torch.no_grad():
        ours.weight.normal_(), ours.bias.normal_()
    theirs = nn.GroupNorm(groups, shape[1]).double()
    theirs.load_state_dict(ours.state_dict())
    y1, y2 = ours(x), theirs(x)
    assert torch.allclose(y1, y2, atol=1e-12)
    up = torch.randn_like(y1)
    g1 = torch.autograd.grad(y1, [x, ours.weight, ours.bias], up)
    g2 = torch.autograd.grad(y2, [x, theirs.weight, theirs.bias], up)
    for a, b in zip(g1, g2):
        assert torch.allclose(a, b, atol=1e-10)


def test_group_norm_without_affine_and_bad_arguments():
    x = torch.randn(2, 6, 3, 3)
    assert torch.allclose(norms.GroupNorm(3, 6, affine=False)(x), F.group_norm(x, 3), atol=1e-6)
    with pytest.raises(ValueError, match="multiple of num_groups"):
        norms.GroupNorm(4, 6)
    with pytest.raises(ValueError, match="expected input"):
        norms.GroupNorm(2, 6)(torch.randn(2, 4, 3, 3))


def test_group_norm_output_does_not_depend_on_batch_mates():
    torch.manual_seed(0)
    layer = norms.GroupNorm(2, 8)
    x = torch.randn(5, 8, 4, 4)
    alone = layer(x[:1])
    with_others = layer(torch.cat([x[:1], x[1:]]))[:1]
    assert torch.allclose(alone, with_others, atol=1e-6)


# ----- make_norm -----------------------------------------------------------------------


@pytest.mark.parametrize("kind,cls", [("bn", nn.BatchNorm2d), ("gn", nn.GroupNorm), ("ln", nn.GroupNorm),
                                      ("in", nn.GroupNorm), ("mabn", norms.MABN2d), ("none", nn.Identity)])
def test_make_norm_kinds_build_a_resnet_that_runs(kind, cls):
    layer = norms.make_norm(kind, 16)
    assert isinstance(layer, cls)
    net = ResNet(8, norm_layer=lambda c: norms.make_norm(kind, c))
    out = net(torch.randn(2, 3, 16, 16))
    assert out.shape == (2, 10) and torch.isfinite(out).all()


def test_make_norm_group_counts_and_options():
    assert norms.make_norm("ln", 16).num_groups == 1
    assert norms.make_norm("in", 16).num_groups == 16
    for c in (8, 16, 24, 64, 256, 6):
        g = norms.make_norm("gn", c).num_groups
        assert c % g == 0 and 1 <= g <= 32
    assert norms.make_norm("gn", 256).num_groups == 32  # Wu & He's default where the layer is wide enough
    assert norms.make_norm("gn", 16, groups=2).num_groups == 2
    assert norms.make_norm("mabn", 16, buffer_size=4).buffer_size == 4


def test_make_norm_unknown_kind_lists_the_choices():
    with pytest.raises(ValueError, match="bn, gn, ln, in, mabn, none"):
        norms.make_norm("batchnorm", 8)


# ----- MABN ----------------------------------------------------------------------------


def test_mabn_backward_passes_gradcheck_with_one_batch_buffer():
    torch.manual_seed(0)
    layer = _mabn(4, buffer_size=1, warmup_steps=0, renorm_warmup=10**9)
    x = torch.randn(3, 4, 3, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(layer, (x,), eps=1e-6, atol=1e-8)


def test_mabn_with_one_batch_buffer_equals_plain_autograd():
    torch.manual_seed(0)
    layer = _mabn(4, buffer_size=1, warmup_steps=0, renorm_warmup=10**9)
    x = torch.randn(3, 4, 3, 3, dtype=torch.float64, requires_grad=True)
    ref = x * torch.rsqrt(x.pow(2).mean((0, 2, 3), keepdim=True) + layer.eps) * layer.weight.view(1, -1, 1, 1) \
        + layer.bias.view(1, -1, 1, 1)
    y = layer(x)
    assert torch.allclose(y, ref, atol=1e-12)
    up = torch.randn_like(y)
    for a, b in zip(torch.autograd.grad(y, [x, layer.weight, layer.bias], up),
                    torch.autograd.grad(ref, [x, layer.weight, layer.bias], up)):
        assert torch.allclose(a, b, atol=1e-12)


def test_mabn_uses_moving_averages_forward_and_backward():
    torch.manual_seed(0)
    m = 3
    layer = _mabn(2, buffer_size=m, warmup_steps=0, renorm_warmup=10**9)
    chis, psis = [], []
    for _ in range(5):
        x = torch.randn(2, 2, 3, 3, dtype=torch.float64, requires_grad=True)
        up = torch.randn_like(x)
        y = layer(x)
        y.backward(up)
        chis.append(x.detach().pow(2).mean((0, 2, 3)))
        z = x.detach() / torch.sqrt(sum(chis[-m:]) / len(chis[-m:]) + layer.eps).view(1, -1, 1, 1)
        psis.append((up * layer.weight.detach().view(1, -1, 1, 1) * z).mean((0, 2, 3)))
    # the last step: forward by the SMA of the last m second moments, backward by the SMA of mean(g * z)
    s = torch.sqrt(sum(chis[-m:]) / m + layer.eps).view(1, -1, 1, 1)
    xd = x.detach()
    assert torch.allclose(y.detach(), xd / s * layer.weight.view(1, -1, 1, 1) + layer.bias.view(1, -1, 1, 1))
    g = up * layer.weight.detach().view(1, -1, 1, 1)
    expected = (g - xd / s * (sum(psis[-m:]) / m).view(1, -1, 1, 1)) / s
    assert torch.allclose(x.grad, expected, atol=1e-10)


def test_mabn_running_var_is_an_ema_and_eval_uses_it():
    torch.manual_seed(0)
    layer = norms.MABN2d(3, buffer_size=1, momentum=0.9)
    x = torch.randn(4, 3, 5, 5) * 2
    layer(x).sum().backward()
    chi = x.pow(2).mean((0, 2, 3))
    assert torch.allclose(layer.running_var, 0.9 * torch.ones(3) + 0.1 * chi, atol=1e-6)
    layer.eval()
    expected = x / torch.sqrt(layer.running_var + layer.eps).view(1, -1, 1, 1)
    assert torch.allclose(layer(x), expected, atol=1e-6)


def test_mabn_renormalised_training_output_matches_eval_output():
    torch.manual_seed(0)
    layer = norms.MABN2d(3, buffer_size=2, warmup_steps=0, renorm_warmup=5, clip=100.0)
    for _ in range(6):
        layer(torch.randn(2, 3, 4, 4)).sum().backward()
    x = torch.randn(2, 3, 4, 4)
    before = copy.deepcopy(layer).eval()(x)  # eval uses the EMA as it stands before this step's update
    assert torch.allclose(layer(x), before, atol=1e-5)


def test_mabn_reduces_dependence_on_batch_mates():
    torch.manual_seed(0)
    feats = torch.randn(40, 4, 6, 6) * torch.rand(1, 4, 1, 1) * 3
    layer = norms.MABN2d(4, buffer_size=16, warmup_steps=16, renorm_warmup=10**9)
    bn = nn.BatchNorm2d(4)
    for i in range(20):
        xb = feats[2 * i:2 * i + 2]
        layer(xb).sum().backward()
        bn(xb)

    def spread(mod):
        outs = [copy.deepcopy(mod)(torch.cat([feats[:1], feats[k:k + 1]]))[0] for k in range(1, 9)]
        outs = torch.stack(outs).detach()
        return (outs.max(0).values - outs.min(0).values).abs().max().item()

    assert spread(layer) < 0.2 * spread(bn)


def test_mabn_state_dict_carries_step_and_buffers():
    a = norms.MABN2d(3, buffer_size=2)
    for _ in range(3):
        a(torch.randn(2, 3, 4, 4)).sum().backward()
    b = norms.MABN2d(3, buffer_size=2)
    b.load_state_dict(a.state_dict())
    assert b.step == 3
    for name in ("running_var", "stat_buffer", "grad_buffer"):
        assert torch.equal(getattr(a, name), getattr(b, name))


@pytest.mark.parametrize("device", DEVICES)
def test_mabn_resnet_trains_on_each_device(device):
    torch.manual_seed(0)
    net = norms.centralize_convs(ResNet(8, norm_layer=lambda c: norms.make_norm("mabn", c, buffer_size=2,
                                                                               warmup_steps=2, renorm_warmup=4)))
    net = net.to(device)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    for _ in range(6):
        x = torch.randn(2, 3, 16, 16, device=device)
        loss = F.cross_entropy(net(x), torch.tensor([0, 1], device=device))
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in net.parameters())


def test_mabn_under_bf16_autocast_keeps_float32_statistics():
    layer = norms.MABN2d(3, buffer_size=2)
    conv = nn.Conv2d(3, 3, 3, padding=1)
    x = torch.randn(2, 3, 8, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(conv(x))
    y.float().sum().backward()
    assert layer.running_var.dtype == torch.float32 and torch.isfinite(layer.running_var).all()
    assert torch.isfinite(conv.weight.grad).all() and torch.isfinite(layer.weight.grad).all()


def test_mabn_bad_arguments():
    with pytest.raises(ValueError):
        norms.MABN2d(4, buffer_size=0)
    with pytest.raises(ValueError, match=r"\(N, 4, H, W\)"):
        norms.MABN2d(4)(torch.randn(2, 3, 4, 4))


# ----- per-device groups: ghost batches ---------------------------------------------------


def _split_run(grouped: nn.Module, singles: list[nn.Module], x: torch.Tensor, up: torch.Tensor, g: int):
    """Outputs and input gradients of ``grouped`` on the whole batch and of ``singles[j]`` on group j alone."""
    x = x.clone().requires_grad_()
    y = grouped(x)
    y.backward(up)
    ys, gxs = [], []
    for j, single in enumerate(singles):
        xj = x.detach()[j * g:(j + 1) * g].clone().requires_grad_()
        yj = single(xj)
        yj.backward(up[j * g:(j + 1) * g])
        ys.append(yj.detach())
        gxs.append(xj.grad)
    return y.detach(), x.grad, torch.cat(ys), torch.cat(gxs)


@pytest.mark.parametrize("g", [1, 2, 4, 8])
def test_ghost_batch_norm_is_batch_norm_on_each_group_with_device_0_running_stats(g):
    torch.manual_seed(0)
    ghost = norms.make_norm("bn", 3, group_size=g).double()
    assert isinstance(ghost, norms.GhostBatchNorm2d) and isinstance(ghost, nn.BatchNorm2d)
    with torch.no_grad():
        ghost.weight.uniform_(0.5, 1.5), ghost.bias.normal_()
    singles = [copy.deepcopy(nn.BatchNorm2d(3).double()) for _ in range(8 // g)]
    for single in singles:
        single.load_state_dict(ghost.state_dict())
    for _ in range(3):  # running statistics accumulate over steps
        x, up = torch.randn(8, 3, 4, 5, dtype=torch.float64) * 2 + 1, torch.randn(8, 3, 4, 5, dtype=torch.float64)
        y, gx, y_ref, gx_ref = _split_run(ghost, singles, x, up, g)
        assert torch.allclose(y, y_ref, atol=1e-12) and torch.allclose(gx, gx_ref, atol=1e-12)
    assert torch.allclose(ghost.running_mean, singles[0].running_mean, atol=1e-12)  # device 0's, not the mean
    assert torch.allclose(ghost.running_var, singles[0].running_var, atol=1e-12)
    assert int(ghost.num_batches_tracked) == 3
    ghost.eval()  # evaluation: plain BN with those statistics, so it folds
    x = torch.randn(5, 3, 4, 4, dtype=torch.float64)
    assert torch.allclose(ghost(x), singles[0].eval()(x), atol=1e-12)


def test_ghost_batch_norm_needs_whole_groups():
    ghost = norms.make_norm("bn", 3, group_size=4)
    assert ghost(torch.randn(3, 3, 2, 2)).shape == (3, 3, 2, 2)  # a batch no larger than a group: one group
    with pytest.raises(ValueError, match="groups of 4"):
        ghost(torch.randn(6, 3, 2, 2))
    with pytest.raises(ValueError, match="group_size"):
        norms.GhostBatchNorm2d(3, group_size=0)


def test_grouped_mabn_keeps_each_groups_moving_averages():
    torch.manual_seed(0)
    g, groups = 2, 4
    grouped = _mabn(3, buffer_size=3, warmup_steps=0, renorm_warmup=4, clip=1.5, group_size=g)
    singles = [copy.deepcopy(grouped) for _ in range(groups)]
    for single in singles:
        single.group_size = None  # one layer per device, each on its own g images
    for step in range(6):  # past the buffer's fill and the renormalisation warm-up
        x, up = torch.randn(g * groups, 3, 4, 4, dtype=torch.float64), torch.randn(g * groups, 3, 4, 4, dtype=torch.float64)
        y, gx, y_ref, gx_ref = _split_run(grouped, singles, x, up, g)
        if step < 4:  # before renormalisation every device is exactly a layer of its own
            assert torch.allclose(y, y_ref, atol=1e-12) and torch.allclose(gx, gx_ref, atol=1e-12)
    assert grouped.stat_buffer.shape == (3, groups, 3) and grouped.grad_buffer.shape == (3, groups, 3)
    for j, single in enumerate(singles):
        assert torch.allclose(grouped.stat_buffer[:, j], single.stat_buffer[:, 0], atol=1e-12)
    # evaluation statistic: device 0's EMA; renormalisation pulls every device towards it
    assert torch.allclose(grouped.running_var, singles[0].running_var, atol=1e-12)
    b = norms.MABN2d(3, buffer_size=3, group_size=g)
    b.load_state_dict(grouped.state_dict())  # a checkpoint brings its groups' buffers along
    assert torch.equal(b.stat_buffer, grouped.stat_buffer.float())
    with pytest.raises(ValueError, match="keep the training batch size fixed"):
        grouped(torch.randn(4, 3, 4, 4, dtype=torch.float64))


def _two_layer_net(norm: nn.Module) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), copy.deepcopy(norm), nn.ReLU(),
                         norms.CenConv2d(4, 4, 3, padding=1), copy.deepcopy(norm), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3)).double()


@pytest.mark.parametrize("m", [2, 4, 6])  # a buffer shorter than, as long as and longer than the step's 4 groups
def test_sequential_mabn_equals_micro_batches_run_one_after_another(m):
    """sequential=True on a batch of 4 groups of 2 = the plain layer on 4 micro-batches of 2, accumulated."""
    options = dict(buffer_size=m, warmup_steps=3, renorm_warmup=7, clip=1.5, momentum=0.9)  # both warm-ups crossed
    grouped = _two_layer_net(norms.MABN2d(4, group_size=2, sequential=True, **options))
    micro = _two_layer_net(norms.MABN2d(4, **options))
    opts = [torch.optim.SGD(net.parameters(), lr=0.5, momentum=0.9) for net in (grouped, micro)]
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):  # 16 micro-batches
        x = torch.randn(8, 3, 5, 5, generator=gen, dtype=torch.float64)
        y = torch.randint(0, 3, (8,), generator=gen)
        for opt in opts:
            opt.zero_grad()
        F.cross_entropy(grouped(x), y).backward()
        for xs, ys in zip(x.split(2), y.split(2)):
            (F.cross_entropy(micro(xs), ys) / 4).backward()
        for a, b in zip(grouped.parameters(), micro.parameters()):
            assert torch.allclose(a.grad, b.grad, atol=1e-10)
        for opt in opts:
            opt.step()
    for i in (1, 4):
        a, b = grouped[i], micro[i]
        assert a.step == b.step == 16
        assert a.stat_buffer.shape == (m, 1, 4)
        assert torch.allclose(a.running_var, b.running_var, atol=1e-10)
        for name in ("stat_buffer", "grad_buffer"):  # the plain layer's ring starts at slot step % m
            assert torch.allclose(getattr(a, name), getattr(b, name).roll(-(b.step % m), 0), atol=1e-10)


def test_sequential_mabn_spans_the_previous_step_and_per_device_mabn_does_not():
    """With m = groups, group 0 averages this step's first group with the previous step's last m - 1;
    a device's buffer instead holds its own last m steps."""
    torch.manual_seed(0)
    seq = norms.MABN2d(1, buffer_size=4, warmup_steps=0, renorm_warmup=10**9, group_size=1, sequential=True)
    dev = norms.MABN2d(1, buffer_size=4, warmup_steps=0, renorm_warmup=10**9, group_size=1)
    steps = [torch.randn(4, 1, 3, 3) for _ in range(5)]
    for x in steps:
        for layer in (seq, dev):
            layer(x).sum().backward()
    chi = torch.stack([x.pow(2).mean((1, 2, 3)) for x in steps])  # (steps, images): each image is a group
    assert torch.allclose(seq.stat_buffer[:, 0, 0], chi[-1])  # the last 4 micro-batches: this step's 4 groups
    assert torch.allclose(dev.stat_buffer[:, :, 0].sort(0).values, chi[-4:].sort(0).values)  # each device's 4 steps


# ----- weight centralisation -----------------------------------------------------------


def test_cenconv_centres_each_filter_and_keeps_the_raw_weights():
    conv = nn.Conv2d(3, 5, 3, padding=1, bias=True)
    cen = norms.CenConv2d.from_conv(conv)
    assert torch.equal(cen.weight, conv.weight) and torch.equal(cen.bias, conv.bias)
    w = cen.centered_weight()
    assert torch.allclose(w.mean(dim=(1, 2, 3)), torch.zeros(5), atol=1e-7)
    x = torch.randn(2, 3, 6, 6)
    assert torch.allclose(cen(x), F.conv2d(x, w, conv.bias, padding=1), atol=1e-6)


def test_centralize_convs_replaces_every_conv():
    net = norms.centralize_convs(ResNet(8))
    convs = [m for m in net.modules() if isinstance(m, nn.Conv2d)]
    assert convs and all(isinstance(m, norms.CenConv2d) for m in convs)


def test_centralize_convs_can_skip_named_convs():
    net = norms.centralize_convs(ResNet(8), skip=("stem.0",))
    assert type(net.stem[0]) is nn.Conv2d
    others = [m for name, m in net.named_modules() if isinstance(m, nn.Conv2d) and name != "stem.0"]
    assert others and all(isinstance(m, norms.CenConv2d) for m in others)
    with pytest.raises(ValueError, match="no module named"):
        norms.centralize_convs(ResNet(8), skip=("stem.9",))


# ----- folding -------------------------------------------------------------------------


def _randomise(model: nn.Module) -> nn.Module:
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.BatchNorm2d, norms.MABN2d)):
                m.weight.uniform_(0.5, 1.5), m.bias.normal_(), m.running_var.uniform_(0.5, 2)
                if isinstance(m, nn.BatchNorm2d):
                    m.running_mean.normal_()
    return model.eval()


@pytest.mark.parametrize("kind", ["bn", "mabn"])
@pytest.mark.parametrize("conv_bias", [False, True])
def test_fold_norm_equals_conv_then_norm(kind, conv_bias):
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 6, 3, stride=2, padding=1, bias=conv_bias)
    if kind == "mabn":
        conv = norms.CenConv2d.from_conv(conv)
    norm = _randomise(norms.make_norm(kind, 6))
    folded = norms.fold_norm(conv, norm)
    assert type(folded) is nn.Conv2d
    x = torch.randn(2, 3, 9, 9)
    with torch.no_grad():
        assert torch.allclose(folded(x), norm(conv(x)), atol=1e-5)


@pytest.mark.parametrize("kind", ["bn", "mabn"])
def test_fold_model_removes_every_norm_and_keeps_the_outputs(kind):
    torch.manual_seed(0)
    net = ResNet(8, norm_layer=lambda c: norms.make_norm(kind, c))
    if kind == "mabn":
        norms.centralize_convs(net)
    _randomise(net)
    folded = norms.fold_model(net)
    assert not any(isinstance(m, (nn.BatchNorm2d, norms.MABN2d)) for m in folded.modules())
    x = torch.randn(3, 3, 16, 16)
    with torch.no_grad():
        assert torch.allclose(folded(x), net(x), atol=1e-5)
    assert any(isinstance(m, (nn.BatchNorm2d, norms.MABN2d)) for m in net.modules())  # the original is untouched


def test_fold_refuses_group_norm_and_training_mode():
    conv = nn.Conv2d(3, 8, 3)
    for kind in ("gn", "ln", "in"):
        with pytest.raises(ValueError, match="cannot be folded"):
            norms.fold_norm(conv, norms.make_norm(kind, 8).eval())
    with pytest.raises(ValueError, match="cannot be folded"):
        norms.fold_norm(conv, norms.GroupNorm(2, 8))
    with pytest.raises(ValueError, match="eval"):
        norms.fold_norm(conv, nn.BatchNorm2d(8).train())
    with pytest.raises(ValueError, match="output channels"):
        norms.fold_norm(conv, nn.BatchNorm2d(4).eval())
