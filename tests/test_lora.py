import pytest
import torch
import torch.nn.functional as F
from torch import nn

from course_lib import estimator, lora, memory
from course_lib.models import MLP, ResNet, TinyTransformer, lm_loss


def _images(n: int = 4, size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 3, size, size, generator=g), torch.randint(0, 10, (n,), generator=g)


def _stack(widths: list[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in zip(widths, widths[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers)


def _randomise_b(model: nn.Module) -> None:
    """Give every B a non-zero value, as training would: otherwise every update is zero and tests see nothing."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, lora.LoRALayer):
                m.lora_B.normal_(0, 0.1)


def test_lora_starts_at_the_pretrained_function_exactly():
    torch.manual_seed(0)
    x, _ = _images()
    net = ResNet(8)
    before = net(x)
    lora.add_lora(net, r=2, alpha=4, skip=("fc",))
    assert torch.equal(net(x), before)  # B = 0: the update adds exact zeros
    tf = TinyTransformer(d_model=32, n_layers=1, max_len=16)
    idx = torch.randint(0, 64, (2, 16))
    before = tf(idx)
    lora.add_lora(tf, r=4, alpha=8)
    assert torch.equal(tf(idx), before)
    assert all(torch.count_nonzero(m.lora_B) == 0 and torch.count_nonzero(m.lora_A) > 0
               for m in tf.modules() if isinstance(m, lora.LoRALayer))


def test_merged_weights_compute_the_same_function():
    torch.manual_seed(0)
    x, _ = _images()
    net = lora.add_lora(ResNet(8), r=2, alpha=3)
    _randomise_b(net)
    net.eval()  # BatchNorm with its running statistics: the same in both
    adapted = net(x)
    n_base = sum(p.numel() for m in net.modules() if isinstance(m, lora.LoRALayer) for p in m.base.parameters())
    lora.merge_lora(net)
    assert not any(isinstance(m, lora.LoRALayer) for m in net.modules())
    assert sum(p.numel() for p in net.parameters()) == sum(p.numel() for p in ResNet(8).parameters())
    assert n_base > 0
    merged = net(x)
    assert not torch.equal(adapted, ResNet(8).eval()(x))
    torch.testing.assert_close(merged, adapted, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("make", [lambda: nn.Linear(6, 5), lambda: nn.Conv2d(3, 4, 3, padding=1),
                                  lambda: nn.Conv2d(4, 2, 1, stride=2, bias=False)])
def test_one_layer_equals_its_merged_weight_and_scales_by_alpha_over_r(make):
    torch.manual_seed(0)
    base = make()
    x = torch.randn(2, 6) if isinstance(base, nn.Linear) else torch.randn(2, base.in_channels, 8, 8)
    wrapper = lora.LoRALinear if isinstance(base, nn.Linear) else lora.LoRAConv2d
    layer = wrapper(base, r=3, alpha=6)
    with torch.no_grad():
        layer.lora_B.normal_()
    ba = layer.lora_B @ layer.lora_A
    torch.testing.assert_close(layer.delta_weight(), (6 / 3) * ba.view(base.weight.shape))
    plain = make()
    with torch.no_grad():
        plain.weight.copy_(base.weight + layer.delta_weight())
        if base.bias is not None:
            plain.bias.copy_(base.bias)
    torch.testing.assert_close(layer(x), plain(x), rtol=1e-5, atol=1e-5)
    # alpha / r scales the update: twice alpha, twice the change of the output
    change = layer(x) - base(x)
    layer.scaling = 12 / 3
    torch.testing.assert_close(layer(x) - base(x), 2 * change, rtol=1e-4, atol=1e-5)
    assert sum(p.numel() for p in (layer.lora_A, layer.lora_B)) == lora.lora_params(base, 3)


def test_only_the_adapters_and_the_skipped_head_train():
    torch.manual_seed(0)
    x, y = _images()
    net = lora.add_lora(ResNet(8), r=2, alpha=2, skip=("fc",))
    names = {n for n, p in net.named_parameters() if p.requires_grad}
    assert names == {n for n, _ in net.named_parameters() if n.endswith(("lora_A", "lora_B"))} | {"fc.weight", "fc.bias"}
    opt = torch.optim.Adam(lora.trainable_params(net), lr=1e-2)
    F.cross_entropy(net(x), y).backward()
    opt.step()
    assert all(p.grad is None for p in net.parameters() if not p.requires_grad)
    assert all(torch.count_nonzero(m.lora_B) > 0 for m in net.modules() if isinstance(m, lora.LoRALayer))


def test_trainable_state_of_lora_is_the_formula():
    torch.manual_seed(0)
    x, y = _images()
    net = ResNet(8)
    adapted = [m for m in net.modules() if isinstance(m, (nn.Conv2d, nn.Linear)) and m is not net.fc]
    n_lora = sum(lora.lora_params(m, 4) for m in adapted)
    n_head = net.fc.weight.numel() + net.fc.bias.numel()
    lora.add_lora(net, r=4, alpha=4, skip=("fc",))
    opt = torch.optim.Adam(lora.trainable_params(net))
    meas = memory.measure(net, F.cross_entropy, x, y, opt)
    tensors = 2 * len(adapted) + 2
    assert meas["grads"] == 4 * (n_lora + n_head)
    assert meas["optimizer"] == 8 * (n_lora + n_head) + 4 * tensors  # two moments, and one step per tensor


def test_a_frozen_prefix_saves_nothing_and_its_successor_saves_its_input():
    torch.manual_seed(0)
    x, y = _images(n=3)
    full_model = ResNet(8)
    full = lora.saved_bytes_per_block(full_model, lambda: F.cross_entropy(full_model(x), y))
    for k in (1, 2, 4):  # after the stem, after a residual block, all but the head
        net = ResNet(8)
        parts = lora.freeze_prefix(net, k)
        with torch.no_grad():
            h = x
            for p in parts:
                h = p(h)
        per = lora.saved_bytes_per_block(net, lambda: F.cross_entropy(net(x), y))
        assert per[:k] == [0] * k
        # the first trainable block saves what it saved before, plus its input (before, its predecessor's)
        # (the head keeps only its pooled input, which it saved already; pooling needs no input saved)
        assert per[k] == full[k] + memory.tensor_bytes(h) * (k < 4)
        assert per[k + 1:] == full[k + 1:]
        # the estimator, run on the blocks after the prefix from the prefix's output, predicts the same bytes
        measured = memory.saved_activation_bytes(lambda: F.cross_entropy(net(x), y), exclude=net.parameters())
        suffix = nn.Sequential(*lora.blocks(net)[k:])
        assert abs(estimator.estimate_activation_bytes(suffix, tuple(h.shape)) - measured) <= 8
        grads = sum(p.numel() for p in net.parameters() if p.requires_grad) * 4
        F.cross_entropy(net(x), y).backward()
        assert memory.grad_bytes(net) == grads


def test_lora_saves_each_adapted_input_and_a_little_more():
    torch.manual_seed(0)
    x, y = _images(n=5)
    base = ResNet(8)
    full = memory.saved_activation_bytes(lambda: F.cross_entropy(base(x), y), exclude=base.parameters())
    net = lora.add_lora(ResNet(8), r=2, alpha=2, skip=("fc",))
    convs = [m for m in net.modules() if isinstance(m, lora.LoRAConv2d)]
    acts = memory.saved_activation_bytes(lambda: F.cross_entropy(net(x), y), exclude=net.parameters())
    assert acts == full + sum(memory.tensor_bytes(c.base.weight) for c in convs)  # + one summed kernel per conv
    # LoRALinear: each layer's input as before (A's gradient needs it), plus x A^T: r numbers per row
    widths, batch, r = [12, 20, 9, 4], 6, 3
    inp = torch.randn(batch, widths[0])
    stack = _stack(widths)
    before = memory.saved_activation_bytes(lambda: stack(inp), exclude=stack.parameters())
    lora.add_lora(stack, r=r, alpha=1)
    after = memory.saved_activation_bytes(lambda: stack(inp), exclude=stack.parameters())
    assert before == 4 * batch * sum(widths)
    assert after == before + 4 * batch * r * (len(widths) - 1)


def test_lora_on_a_transformer_saves_nothing_before_its_first_adapter():
    torch.manual_seed(0)
    tf = TinyTransformer(d_model=32, n_heads=4, n_layers=2, max_len=16)
    idx, tgt = torch.randint(0, 64, (4, 16)), torch.randint(0, 64, (4, 16))
    full_per = lora.saved_bytes_per_block(tf, lambda: lm_loss(tf(idx), tgt))
    lora.add_lora(tf, r=4, alpha=8, skip=("head",))
    per = lora.saved_bytes_per_block(tf, lambda: lm_loss(tf(idx), tgt))
    assert full_per[0] > 0 and per[0] == 0  # the frozen embedding: its ids are no longer kept
    rows, d = 4 * 16, 32
    # block 0: its first LayerNorm now has no trainable input or weight (saves neither its input nor its
    # statistics), and each of the four adapted Linear layers adds x A^T
    assert per[1] == full_per[1] - (rows * d * 4 + 2 * rows * 4) + 4 * rows * 4 * 4
    assert per[2] == full_per[2] + 4 * rows * 4 * 4
    assert per[3] == full_per[3]


def test_errors_name_what_is_wrong():
    with pytest.raises(ValueError, match="rank"):
        lora.add_lora(ResNet(8), r=0, alpha=1)
    with pytest.raises(ValueError, match="skip"):
        lora.add_lora(ResNet(8), r=1, alpha=1, skip=("head",))
    with pytest.raises(ValueError, match="one must train"):
        lora.freeze_prefix(ResNet(8), 5)
    with pytest.raises(ValueError, match="one must train"):
        lora.freeze_prefix(ResNet(8), -1)
    with pytest.raises(ValueError, match="square"):
        lora.LoRAConv2d(nn.Conv2d(3, 4, (3, 1)), r=1, alpha=1)
    with pytest.raises(TypeError, match="blocks"):
        lora.blocks(MLP())
    with pytest.raises(TypeError, match="LoRA adapts"):
        lora.lora_params(nn.ReLU(), 2)
