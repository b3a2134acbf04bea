import pytest
import torch
import torch.nn.functional as F

from course_lib import chunked_loss, memory
from course_lib.models import TinyTransformer, lm_loss


def _head(N=300, d=16, V=5000, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, d, generator=g).requires_grad_()
    w = (0.05 * torch.randn(V, d, generator=g)).requires_grad_()
    b = torch.zeros(V).requires_grad_()
    return h, w, b, torch.randint(0, V, (N,), generator=g)


def _loss_and_grads(fn, tensors):
    for t in tensors:
        t.grad = None
    loss = fn()
    loss.backward()
    return loss.detach(), [t.grad.clone() for t in tensors]


@pytest.mark.parametrize("chunks", [1, 3, 7])
def test_chunked_losses_equal_the_plain_loss_and_gradients(chunks):
    h, w, b, y = _head()
    ref_loss, ref = _loss_and_grads(lambda: F.cross_entropy(F.linear(h, w, b), y), (h, w, b))
    for fn in (lambda: chunked_loss.chunked_cross_entropy(h, w, b, y, chunks),
               lambda: chunked_loss.ChunkedLinearCrossEntropy.apply(h, w, b, y, chunks)):
        loss, grads = _loss_and_grads(fn, (h, w, b))
        assert torch.allclose(loss, ref_loss, atol=1e-6)
        for g, r in zip(grads, ref):
            assert torch.allclose(g, r, atol=1e-7), (g - r).abs().max()


def test_by_hand_backward_passes_gradcheck():
    h, w, b, y = _head(N=12, d=3, V=7)
    args = [t.detach().double().requires_grad_() for t in (h, w, b)]
    assert torch.autograd.gradcheck(lambda h, w, b: chunked_loss.ChunkedLinearCrossEntropy.apply(h, w, b, y, 5),
                                    args)


def test_transformer_loss_equals_lm_loss():
    torch.manual_seed(0)
    model = TinyTransformer(vocab=200, d_model=32, n_heads=4, n_layers=1, max_len=16)
    idx = torch.randint(0, 200, (3, 16))
    ref = lm_loss(model(idx), idx)
    for by_hand in (False, True):
        assert torch.allclose(chunked_loss.transformer_loss(model, idx, idx, 4, by_hand=by_hand), ref, atol=1e-6)


@pytest.mark.parametrize("shape", [(512, 32, 8192), (256, 96, 6000)])
def test_peak_falls_with_chunks_as_predicted(shape):
    N, d, V = shape
    h, w, b, y = _head(N, d, V)

    def peak(fn):
        def step():
            fn().backward()
        for t in (h, w, b):
            t.grad = None
        return memory.peak_bytes(step, "cpu")

    plain = peak(lambda: F.cross_entropy(F.linear(h, w, b), y))
    assert plain == pytest.approx(chunked_loss.predict_loss_peak(N, V, d, 1), rel=0.01)  # 3 N V fp32 values
    last = plain
    for k in (2, 4, 8, 16):
        measured = peak(lambda: chunked_loss.chunked_cross_entropy(h, w, b, y, k))
        assert measured == pytest.approx(chunked_loss.predict_loss_peak(N, V, d, k), rel=0.05), k
        assert measured <= 1.01 * last  # falls, down to the plateau of the head's gradients
        assert peak(lambda: chunked_loss.ChunkedLinearCrossEntropy.apply(h, w, b, y, k)) <= 1.01 * measured
        last = measured
    assert last < plain / 2


def test_chunked_loss_rejects_bad_input():
    h, w, b, y = _head(N=10)
    with pytest.raises(ValueError, match="chunks must be between 1 and"):
        chunked_loss.chunked_cross_entropy(h, w, b, y, 11)
    with pytest.raises(ValueError, match="flatten batch and time"):
        chunked_loss.chunked_cross_entropy(h.view(2, 5, -1), w, b, y, 2)
    with pytest.raises(ValueError, match="chunks <= tokens"):
        chunked_loss.predict_loss_peak(10, 100, 8, 0)


def _grads_under_bf16_autocast(fn, tensors):
    for t in tensors:
        t.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = fn()
    loss.backward()
    return loss.detach(), [t.grad.clone() for t in tensors]


def test_by_hand_backward_differentiates_the_autocast_forward():
    h, w, b, y = _head(N=64, d=16, V=500)
    w.data.mul_(6)  # logits of a few units: bf16's rounding of them shows in the gradient
    ref_loss, ref = _grads_under_bf16_autocast(lambda: F.cross_entropy(F.linear(h, w, b).float(), y), (h, w, b))
    _, fp32 = _loss_and_grads(lambda: F.cross_entropy(F.linear(h, w, b), y), (h, w, b))
    assert (fp32[0] - ref[0]).abs().max() > 1e-5, "the test wants bf16 logits that differ from fp32 ones"
    for fn in (lambda: chunked_loss.ChunkedLinearCrossEntropy.apply(h, w, b, y, 4),
               lambda: chunked_loss.chunked_cross_entropy(h, w, b, y, 4)):
        loss, grads = _grads_under_bf16_autocast(fn, (h, w, b))
        assert torch.allclose(loss, ref_loss, atol=1e-5)
        # the backward recomputes the bf16 logits of the forward, not fp32 ones: the hidden states' gradient
        # is autograd's to the bit (the weight's sums its slices in another order, in bf16 or fp32)
        assert torch.allclose(grads[0], ref[0], atol=1e-7, rtol=0), (grads[0] - ref[0]).abs().max()
        assert torch.allclose(grads[1], ref[1], atol=2e-3, rtol=0)


def test_bf16_hidden_states_and_an_fp32_head():
    h, w, b, y = _head(N=60, d=16, V=300)
    hb = h.detach().bfloat16().requires_grad_()
    h32 = hb.detach().float().requires_grad_()  # the same values, in fp32
    ref_loss, ref = _loss_and_grads(lambda: F.cross_entropy(F.linear(h32, w, b), y), (h32, w, b))
    for fn in (lambda: chunked_loss.ChunkedLinearCrossEntropy.apply(hb, w, b, y, 3),
               lambda: chunked_loss.chunked_cross_entropy(hb, w, b, y, 3)):
        loss, (gh, gw, gb) = _loss_and_grads(fn, (hb, w, b))
        assert loss.dtype == torch.float32 and torch.allclose(loss, ref_loss, atol=1e-6)
        assert (gh.dtype, gw.dtype, gb.dtype) == (torch.bfloat16, torch.float32, torch.float32)
        assert torch.equal(gh, ref[0].bfloat16())  # computed in fp32, rounded once to the input's precision
        assert torch.allclose(gw, ref[1], atol=1e-7) and torch.allclose(gb, ref[2], atol=1e-7)
