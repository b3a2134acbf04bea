import contextlib

import pytest
import torch

from course_lib import memory, offload
from course_lib.models import TinyTransformer, lm_loss


def _model(fused=False, n_layers=3):
    torch.manual_seed(0)
    return TinyTransformer(vocab=64, d_model=32, n_heads=4, n_layers=n_layers, max_len=64, fused=fused)


def _grads_and_peak(model, idx, hooks=None):
    def step():
        with hooks if hooks is not None else contextlib.nullcontext():
            loss = lm_loss(model(idx), idx)
        loss.backward()

    model.zero_grad(set_to_none=True)
    step()  # warm-up, and the gradients to compare
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    if hooks is not None and hasattr(hooks, "reset"):
        hooks.reset()
    return grads, memory.peak_bytes(step, "cpu")


def test_offload_by_hand_keeps_gradients_and_takes_the_saves_off_the_allocator():
    model, idx = _model(), torch.randint(0, 64, (2, 64))
    g_plain, p_plain = _grads_and_peak(model, idx)
    hooks = offload.OffloadToHost(keep=model.parameters())
    g_off, p_off = _grads_and_peak(model, idx, hooks)
    # the same values come back, contiguous: a matmul may then sum in another order (last-bit differences)
    assert max(((a - b).abs().max() / a.abs().max()).item() for a, b in zip(g_plain, g_off)) < 1e-5
    saved = memory.saved_activation_bytes(lambda: lm_loss(model(idx), idx), exclude=model.parameters())
    # every saved activation was copied out (some twice: saved by two ops) and back; parameters were kept
    assert hooks.copied_bytes >= saved and hooks.reloaded_bytes == hooks.copied_bytes
    assert hooks.kept_bytes == 0 and hooks.copies > 0  # min_bytes=0: every activation goes; weights are not counted
    assert p_off < p_plain - 0.5 * saved


def test_offload_min_bytes_keeps_small_tensors_on_the_device():
    model, idx = _model(), torch.randint(0, 64, (2, 64))
    everything = offload.OffloadToHost(keep=model.parameters())
    big_only = offload.OffloadToHost(keep=model.parameters(), min_bytes=10_000)
    for hooks in (everything, big_only):
        with hooks:
            lm_loss(model(idx), idx)
    assert big_only.copied_bytes < everything.copied_bytes
    assert big_only.copied_bytes + big_only.kept_bytes == everything.copied_bytes + everything.kept_bytes
    with pytest.raises(ValueError, match="min_bytes"):
        offload.OffloadToHost(min_bytes=-1)


def test_offload_handles_bf16_and_bool_saved_tensors():
    x = torch.randn(8, 16, requires_grad=True)
    for dtype in (torch.float32, torch.bfloat16):
        grads = []
        for hooks in (contextlib.nullcontext(), offload.OffloadToHost()):
            x.grad = None
            with hooks:
                y = x.to(dtype)
                out = (y.relu() * y.masked_fill(y > 1, 0)).sum()  # saves a bool mask and a bf16 tensor
            out.backward()
            grads.append(x.grad.clone())
        assert torch.equal(*grads)


def test_save_on_cpu_copies_nothing_on_a_cpu_machine():
    model, idx = _model(), torch.randint(0, 64, (2, 64))
    g_plain, p_plain = _grads_and_peak(model, idx)
    real = offload.CountedSaveOnCpu(device_type="cpu")
    g_real, p_real = _grads_and_peak(model, idx, real)
    assert real.copies == 0 and real.copied_bytes == 0
    assert all(torch.equal(a, b) for a, b in zip(g_plain, g_real))
    assert p_real == pytest.approx(p_plain, rel=0.02)


@pytest.mark.parametrize("fused", [False, True])
def test_offloading_the_blocks_meets_the_prediction(fused):
    n = 4
    model, idx = _model(fused, n_layers=n), torch.randint(0, 64, (4, 64))
    _, p_plain = _grads_and_peak(model, idx)
    block = memory.saved_activation_bytes(lambda: model.blocks[0](torch.randn(4, 64, 32)),
                                          exclude=model.parameters())
    hooks = offload.OffloadToHost(keep=model.parameters())
    plain_blocks, model.blocks = model.blocks, offload.offload_blocks(model.blocks, hooks)
    _, p_off = _grads_and_peak(model, idx, hooks=None)
    predicted = offload.predict_offload_peak(p_plain, n, block)
    assert p_plain - n * block <= p_off <= 1.05 * predicted  # it fell by at most n blocks' saves, about n - 1
    with pytest.raises(ValueError, match="nn.Sequential"):
        offload.offload_blocks(list(plain_blocks), hooks)
    with pytest.raises(ValueError, match="cannot hold"):
        offload.predict_offload_peak(10, n, block)


def test_offload_traffic_is_twice_the_packed_bytes():
    assert offload.offload_traffic_bytes(4, 1000) == 8000
    with pytest.raises(ValueError):
        offload.offload_traffic_bytes(-1, 10)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="offload to host memory needs a GPU (CUDA)")
def test_offload_on_a_gpu_lowers_the_cuda_peak():
    device = torch.device("cuda")
    model, idx = _model().to(device), torch.randint(0, 64, (8, 64), device=device)

    def step(hooks):
        def run():
            with hooks:
                loss = lm_loss(model(idx), idx)
            loss.backward()
        return run

    for pin in (False, True):
        model.zero_grad(set_to_none=True)
        plain = memory.peak_bytes(step(contextlib.nullcontext()), "cuda")
        model.zero_grad(set_to_none=True)
        hooks = offload.OffloadToHost(keep=model.parameters(), pin_memory=pin)
        off = memory.peak_bytes(step(hooks), "cuda")
        real = offload.CountedSaveOnCpu(pin_memory=pin)
        model.zero_grad(set_to_none=True)
        torch_off = memory.peak_bytes(step(real), "cuda")
        assert off < 0.7 * plain and torch_off < 0.7 * plain
        assert real.copied_bytes > hooks.copied_bytes  # save_on_cpu copies the weights too
