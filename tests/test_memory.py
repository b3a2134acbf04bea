from contextlib import contextmanager
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from course_lib import estimator, memory, models, norms
from course_lib.models import MLP, ResNet, TinyTransformer, lm_loss


def _measure_acts(model, x, y, loss_fn):
    return memory.saved_activation_bytes(lambda: loss_fn(model(x), y), exclude=model.parameters())


def test_saved_activation_bytes_counts_a_shared_tensor_once():
    model = nn.Sequential(nn.Linear(100, 200), nn.ReLU(), nn.Linear(200, 10))
    x = torch.randn(8, 100)
    # Linear1 saves x (8x100); ReLU saves its output (8x200), which Linear2 saves too: stored once.
    assert memory.saved_activation_bytes(lambda: model(x), exclude=model.parameters()) == (800 + 1600) * 4


def test_saved_activation_bytes_counts_parameters_unless_excluded():
    model = nn.Linear(10, 10)
    x = torch.randn(4, 10, requires_grad=True)  # so the backward needs the weight, to form dL/dx
    with_params = memory.saved_activation_bytes(lambda: model(x))
    without = memory.saved_activation_bytes(lambda: model(x), exclude=model.parameters())
    assert with_params == without + 10 * 10 * 4


# Every model of models.py; ResNet with the three normalisations chapter 04 compares (LN and IN are GroupNorms
# too), the transformer with and without dropout.
def _resnet(kind: str) -> nn.Module:
    net = ResNet(8, norm_layer=lambda c: norms.make_norm(kind, c))
    return norms.centralize_convs(net) if kind == "mabn" else net  # MABN is paired with centred convs (ch. 04)


COURSE_MODELS = {
    "mlp": (MLP, "image"),
    **{f"resnet_{kind}": (lambda kind=kind: _resnet(kind), "image") for kind in ("bn", "gn", "mabn")},
    "transformer": (lambda: TinyTransformer(max_len=64), "tokens"),
    "transformer_dropout": (lambda: TinyTransformer(max_len=64, dropout=0.1), "tokens"),
    # chapter 11: fused attention (F.scaled_dot_product_attention); with dropout the CPU falls back to its math path
    "transformer_fused": (lambda: TinyTransformer(max_len=64, fused=True), "tokens"),
    "transformer_fused_dropout": (lambda: TinyTransformer(max_len=64, dropout=0.1, fused=True), "tokens"),
}
SHAPES = {"image": [(2, 3, 32, 32), (8, 3, 32, 32)], "tokens": [(2, 32), (4, 64)]}  # T < max_len too


def test_every_course_model_is_checked():
    blocks = {models.BasicBlock, models.CausalSelfAttention, models.TransformerBlock, models.Embedding, models.Head,
              models.NFBlock, models.ScaledStdConv2d}
    classes = {c for c in vars(models).values()
               if isinstance(c, type) and issubclass(c, nn.Module) and c.__module__ == models.__name__}
    # Not covered yet, and known: the estimator does not model chapter 04's normaliser-free ResNet (scaled weight
    # standardisation saves the standardised kernels: measured 1.79 MB against 0.58 MB estimated at batch 2), and
    # its ScaledStdConv2d does not run under bf16 autocast. Listed here so that the gap stays in sight.
    not_estimated = {models.NFResNet}
    assert classes - blocks - not_estimated == {type(make()) for make, _ in COURSE_MODELS.values()}, \
        "a new model in models.py: add it to COURSE_MODELS (or, if it is a building block, to blocks)"


def _gpu_sdpa(q, k, v, is_causal=False, dropout_p=0.0):
    """The kernel F.scaled_dot_product_attention runs on a GPU that has both (sm80 and later, PyTorch's default
    order): flash attention for 16-bit inputs, memory-efficient attention for fp32. Without a GPU, fake tensors
    cannot ask the device which kernels it supports and fall back to the math path, so the call is made directly."""
    if q.dtype in (torch.float16, torch.bfloat16):
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal)[0]
    return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, dropout_p, is_causal)[0]


@contextmanager
def _on(device: str, autocast_dtype: torch.dtype | None):
    """Run on ``device`` under autocast. CUDA without a GPU: torch's FakeTensorMode dispatches as CUDA would
    (autocast's CUDA op lists, CUDA's kernel choices such as dropout's bool mask) on tensors that have a
    shape, a dtype and no data, except the choice of attention kernel (see ``_gpu_sdpa``).
    torch.autocast("cuda") turns itself off without a GPU, so it is set directly."""
    if device == "cpu" or torch.cuda.is_available():
        with torch.device(device), torch.autocast(device, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            yield
        return
    with FakeTensorMode(), torch.device("cuda"), mock.patch.object(F, "scaled_dot_product_attention", _gpu_sdpa):
        if autocast_dtype is None:
            yield
            return
        torch.set_autocast_enabled("cuda", True)
        torch.set_autocast_dtype("cuda", autocast_dtype)
        torch.autocast_increment_nesting()
        try:
            yield
        finally:
            torch.autocast_decrement_nesting()
            torch.set_autocast_enabled("cuda", False)
            torch.clear_autocast_cache()


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("name", list(COURSE_MODELS))
def test_estimator_within_five_percent_of_measurement(name, precision, device):
    make, kind = COURSE_MODELS[name]
    for shape in SHAPES[kind]:
        estimated = estimator.estimate(make(), shape, precision=precision, device=device)["activations"]
        with _on(device, memory.PRECISIONS[precision]):
            torch.manual_seed(0)
            model = make()
            if kind == "image":
                x, y, loss_fn = torch.randn(shape), torch.randint(0, 10, shape[:1]), F.cross_entropy
            else:
                x, y, loss_fn = torch.randint(0, 64, shape), torch.randint(0, 64, shape), lm_loss
            measured = _measure_acts(model, x, y, loss_fn)
        error = abs(estimated - measured) / measured
        assert error <= 0.05, f"{name} {precision} on {device}, batch {shape}: estimated {estimated:,} bytes, " \
                              f"measured {measured:,} ({error:.1%} off)"


def test_bf16_measure_keeps_fp32_states_and_halves_conv_activations():
    torch.manual_seed(0)
    model, x, y = ResNet(8), torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    fp32 = memory.measure(model, F.cross_entropy, x, y, torch.optim.Adam(model.parameters()))
    bf16 = memory.measure(model, F.cross_entropy, x, y, torch.optim.Adam(model.parameters()), precision="bf16")
    assert all(fp32[k] == bf16[k] for k in ("params", "grads", "optimizer"))  # autocast leaves them in fp32
    assert 0.45 < bf16["activations"] / fp32["activations"] < 0.55  # conv, BN and ReLU all save bf16 here
    assert bf16["activations"] == pytest.approx(estimator.estimate(model, (8, 3, 32, 32), precision="bf16")["activations"],
                                                rel=0.05)


def test_estimate_parts_and_optimizer_state_match_torch():
    model = MLP(hidden=(32,))
    n = sum(p.numel() for p in model.parameters())
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    for name, opt in [("sgd", torch.optim.SGD(model.parameters(), lr=0.1)),
                      ("momentum", torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)),
                      ("adam", torch.optim.Adam(model.parameters()))]:
        measured = memory.measure(model, F.cross_entropy, x, y, opt)
        est = estimator.estimate(model, (4, 3, 32, 32), optimizer=name)
        assert measured["params"] == est["params"] == 4 * n
        assert measured["grads"] == est["grads"] == 4 * n
        assert measured["optimizer"] == est["optimizer"]
    assert est["total"] == sum(est[k] for k in ("params", "grads", "optimizer", "activations"))


def test_estimate_rejects_bad_input():
    with pytest.raises(ValueError, match="unknown optimizer"):
        estimator.estimate(MLP(), (2, 3, 32, 32), optimizer="lion")
    with pytest.raises(ValueError, match="unknown precision 'fp16'"):
        estimator.estimate(MLP(), (2, 3, 32, 32), precision="fp16")
    with pytest.raises(ValueError, match="not on 'mps'"):
        estimator.estimate(MLP(), (2, 3, 32, 32), device="mps")
    with pytest.raises(ValueError, match="does not fit"):
        estimator.estimate(ResNet(8), (2, 1, 32, 32))  # one channel, the model wants three
    with pytest.raises(ValueError, match="does not fit"):
        estimator.estimate(MLP(), (2, 3, 16, 16))


def test_zero_memory_reproduces_the_paper():
    # Rajbhandari et al. 2020, Figure 1: 7.5B parameters, 64 devices, K = 12
    assert memory.zero_memory(1, 1, 0) == 16
    got = [memory.zero_memory(7.5e9, 64, s) / 1e9 for s in range(4)]
    assert got == pytest.approx([120, 31.4, 16.6, 1.9], abs=0.06)
    with pytest.raises(ValueError):
        memory.zero_memory(1e9, 8, 4)


def test_largest_fitting_finds_the_boundary():
    calls = []

    def fits(n):
        calls.append(n)
        return n <= 37

    assert memory.largest_fitting(fits) == 37
    assert len(calls) <= 2 * 6 + 2
    assert memory.largest_fitting(lambda n: False) == 0
    assert memory.largest_fitting(lambda n: True, limit=100) == 100


def test_cpu_peak_sees_a_temporary():
    def work():
        big = torch.ones(1_000_000)  # 4 MB, freed at the end of the function
        return big.sum()

    peak = memory.peak_bytes(work, "cpu")
    assert 4_000_000 <= peak < 8_000_000


def test_replay_allocations_matches_frees_by_address():
    # a: 100 bytes at address 1, freed on a thread the profiler does not see; the allocator hands address 1
    # out again (30 bytes): the 100 are gone by then. b: 50 bytes at 2, freed where seen. c: a free of a block
    # made before the records began, which takes the curve below the start.
    curve = memory.replay_allocations([(1, 100), (2, 50), (1, 30), (2, -50), (3, -20)])
    assert curve == [100, 150, 80, 30, 10]
    assert max(memory.replay_allocations([(1, 100), (2, 50), (1, 30)])) == 150  # not 180: a reuse is a free


def test_memory_timeline_shows_the_phases_and_the_peak():
    from torch.profiler import record_function

    def step():
        with record_function("forward"):
            a = torch.ones(1_000_000)       # 4 MB, alive into the backward phase
        with record_function("backward"):
            b = torch.ones(2_000_000)       # 8 MB more: the peak is 12 MB, reached here
            del a, b

    tl = memory.memory_timeline(step)
    assert set(tl.phases) == {"forward", "backward"}
    assert tl.phases["forward"][1] <= tl.phases["backward"][0]
    assert tl.peak_in("forward") == 4_000_000 and tl.peak_in("backward") == tl.peak == 12_000_000
    assert tl.live_bytes[-1] == 0 and tl.seconds == sorted(tl.seconds)
    assert memory.peak_bytes(step, "cpu") == tl.peak
    with pytest.raises(KeyError, match="record_function"):
        tl.peak_in("optimizer")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_attention_saved_bytes_naive_quadratic_fused_linear(device):
    def core(T, **kw):
        return estimator.attention_saved_bytes(2, T, 64, 4, fused=kw.pop("fused", False), device=device, **kw)
    # doubling T: the naive core tends to 4x (its T^2 terms), the fused one is exactly 2x
    assert core(1024) / core(512) > 3.5
    assert core(512, fused=True) == 2 * core(256, fused=True)
    assert core(512, fused=True) < core(512) / 5
    with pytest.raises(ValueError, match="not on 'mps'"):
        estimator.attention_saved_bytes(2, 8, 64, 4, device="mps")


@pytest.mark.parametrize("fused", [False, True])
def test_attention_saved_bytes_is_what_the_layer_saves(fused):
    for T in (16, 48, 96):
        layer = models.CausalSelfAttention(32, 4, max_len=96, fused=fused)
        x = torch.randn(3, T, 32, requires_grad=True)
        # the core alone: everything the layer saves minus what its two Linear layers save (their inputs)
        total = memory.saved_activation_bytes(lambda: layer(x), exclude=layer.parameters())
        # qkv's input x and proj's input (B, T, C); on the CPU the latter is a copy of the fused kernel's output
        linears = 2 * 4 * x.numel()
        assert total - linears == estimator.attention_saved_bytes(3, T, 32, 4, fused=fused)


def test_cpu_peak_is_the_calling_threads():
    """What the CPU meter sees: 8 MiB made on this thread count; the same made on another thread do not."""
    import threading

    n = 8 << 20

    def here():
        t = torch.ones(n // 4)
        del t

    def elsewhere():
        box = []
        worker = threading.Thread(target=lambda: box.append(torch.ones(n // 4)))
        worker.start()
        worker.join()
        assert box[0].numel() * 4 == n  # it existed, during fn, in this process
        box.clear()

    assert memory.peak_bytes(here, "cpu") == n
    assert memory.peak_bytes(elsewhere, "cpu") < n // 8, "the profiler saw another thread's allocation"


def test_cpu_peak_sees_the_copy_gloo_makes_of_a_reduce_scatter_input(tmp_path):
    """Gloo copies a reduce-scatter's input on the calling thread: counted (frees on its threads come late)."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        inp, out = torch.ones(1 << 20), torch.empty(1 << 20)
        dist.reduce_scatter_single(out, inp)  # the first call sets gloo up
        assert memory.peak_bytes(lambda: dist.reduce_scatter_single(out, inp), "cpu") == 4 << 20
    finally:
        dist.destroy_process_group()
