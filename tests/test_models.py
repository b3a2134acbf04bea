import pytest
import torch
from torch import nn

from course_lib.models import MLP, ResNet, TinyTransformer, count_params, lm_loss


def test_resnet_shapes_and_pluggable_norm():
    x = torch.randn(2, 3, 32, 32)
    assert ResNet(8)(x).shape == (2, 10)
    gn = ResNet(8, norm_layer=lambda c: nn.GroupNorm(2, c))
    assert not any(isinstance(m, nn.BatchNorm2d) for m in gn.modules())
    assert gn(x).shape == (2, 10)
    with pytest.raises(ValueError, match=r"\(batch, 3, H, W\)"):
        ResNet(8)(torch.randn(2, 32, 32))


def test_mlp_checks_its_input():
    assert MLP()(torch.randn(3, 3, 32, 32)).shape == (3, 10)
    with pytest.raises(ValueError, match="3072 features"):
        MLP()(torch.randn(3, 3, 16, 16))


def test_transformer_is_causal_and_cut_into_a_sequence():
    torch.manual_seed(0)
    model = TinyTransformer(vocab=32, d_model=32, n_heads=4, n_layers=2, max_len=16)
    idx = torch.randint(0, 32, (2, 16))
    out = model(idx)
    assert out.shape == (2, 16, 32)
    changed = idx.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 32  # changing the last token must not change earlier outputs
    assert torch.allclose(model(changed)[:, :-1], out[:, :-1], atol=1e-6)
    assert torch.allclose(model.as_sequential()(idx), out)
    assert lm_loss(out, idx).ndim == 0
    with pytest.raises(ValueError, match="exceeds max_len"):
        model(torch.randint(0, 32, (1, 17)))
    with pytest.raises(ValueError, match="divisible"):
        TinyTransformer(d_model=30, n_heads=4)
    assert count_params(model) == sum(p.numel() for p in model.parameters())


def test_fused_attention_computes_the_same_function():
    torch.manual_seed(0)
    naive = TinyTransformer(vocab=32, d_model=32, n_heads=4, n_layers=2, max_len=24)
    fused = TinyTransformer(vocab=32, d_model=32, n_heads=4, n_layers=2, max_len=24, fused=True)
    fused.load_state_dict(naive.state_dict())  # same parameter names: the option changes only the forward
    assert fused.blocks[0].attn.fused and not naive.blocks[0].attn.fused
    idx = torch.randint(0, 32, (3, 20))  # T < max_len
    losses = [lm_loss(m(idx), idx) for m in (naive, fused)]
    assert torch.allclose(losses[0], losses[1], atol=1e-6)
    for loss in losses:
        loss.backward()
    for (name, p), q in zip(naive.named_parameters(), fused.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-5), name
    changed = idx.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 32  # causal: the fused kernel masks the future too
    assert torch.allclose(fused(changed)[:, :-1], fused(idx)[:, :-1], atol=1e-6)


def test_fused_attention_applies_dropout_only_in_training():
    torch.manual_seed(0)
    model = TinyTransformer(vocab=32, d_model=32, n_heads=4, n_layers=1, max_len=16, dropout=0.5, fused=True)
    idx = torch.randint(0, 32, (2, 16))
    model.eval()
    assert torch.equal(model(idx), model(idx))
    model.train()
    assert not torch.allclose(model(idx), model(idx))
