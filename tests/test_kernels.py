"""The kernel probe (course_lib.kernels) and the emulated twins the chapters run where a kernel is slow or broken."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

from course_lib import env, fp8_linear, kernels


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """No forced verdicts, an empty cache of our own, and the probe's memo cleared before and after."""
    monkeypatch.delenv(kernels.FORCE_ENV, raising=False)
    monkeypatch.setenv("COURSE_CACHE_DIR", str(tmp_path))
    kernels.probe.cache_clear()
    yield tmp_path
    kernels.probe.cache_clear()


def test_forced_verdicts_are_read_and_checked(monkeypatch):
    monkeypatch.setenv(kernels.FORCE_ENV, "all=slow, fp8=BROKEN")
    assert kernels.forced() == {"bf16": "slow", "fp16": "slow", "fp8": "broken", "torchao": "slow"}
    for bad in ("fp9=slow", "fp8=sluggish", "fp8"):
        monkeypatch.setenv(kernels.FORCE_ENV, bad)
        with pytest.raises(ValueError, match="is not KERNEL=VERDICT with KERNEL one of bf16, fp16, fp8, torchao"):
            kernels.forced()


def test_a_forced_verdict_is_not_measured_and_says_so(fresh, monkeypatch):
    monkeypatch.setenv(kernels.FORCE_ENV, "fp8=broken")
    v = kernels.probe("fp8")
    assert (v.verdict, v.forced, v.ratio) == ("broken", True, None)
    assert v.summary() == "fp8: broken (forced by COURSE_KERNELS; its emulated twin runs)"
    assert not kernels.native("fp8", "cpu") and kernels.native("fp8", "cuda")  # GPUs are not probed
    assert not list(fresh.iterdir()), "a forced verdict is not cached"
    with pytest.raises(ValueError, match="unknown kernel 'int4'"):
        kernels.probe("int4")


def test_the_probe_measures_caches_and_reads_back(fresh):
    start = time.perf_counter()
    v = kernels.probe("fp8")
    assert time.perf_counter() - start < 5  # "well under a second" on an idle core; a loaded one is slower
    assert v.verdict in kernels.VERDICTS and not v.forced
    assert (v.ratio is None) == (v.verdict == "broken") and (v.error is None) == (v.verdict != "broken")
    (cache,) = fresh.glob("kernels-*.json")
    kernels.probe.cache_clear()
    assert kernels.probe("fp8") == v  # read back, not measured again
    assert torch.backends.cpu.get_cpu_capability() in kernels.machine_key()


def test_a_raising_kernel_is_broken_and_its_error_kept(fresh, monkeypatch):
    def raises(*args, **kwargs):
        raise RuntimeError("could not create a primitive descriptor for the matmul primitive")
    monkeypatch.setattr(torch, "_scaled_mm", raises)
    v = kernels.measure("fp8")
    assert v.verdict == "broken" and v.error == ("RuntimeError: could not create a primitive descriptor for the "
                                                 "matmul primitive")
    assert "raises RuntimeError" in v.summary() and v.short() == "fp8 broken (raises RuntimeError)"


def test_a_kernel_far_past_its_limit_is_slow_after_one_call(fresh, monkeypatch):
    calls = []
    real = torch._scaled_mm

    def sluggish(*args, **kwargs):  # what a 3,000x kernel looks like to the probe
        calls.append(1)
        time.sleep(0.05)
        return real(*args, **kwargs)
    monkeypatch.setattr(torch, "_scaled_mm", sluggish)
    v = kernels.measure("fp8")
    assert v.verdict == "slow" and v.ratio > kernels.SLOW_RATIO["fp8"]
    assert len(calls) == 2  # one timed call of the pair (forward's and backward's formats), no repeats


def test_the_emulated_scaled_mm_is_the_kernel_to_rounding():
    torch.manual_seed(0)
    a, b = torch.randn(64, 128) * 3, torch.randn(128, 96)
    aq, as_ = fp8_linear.cast_dynamic(a, "e4m3")
    bq, bs = fp8_linear.cast_dynamic(b, "e4m3")
    emulated = fp8_linear.scaled_mm_emulated(aq, as_, bq, bs)
    try:
        real = fp8_linear.scaled_mm_kernel(aq, as_, bq, bs)
    except RuntimeError as exc:  # a CPU where the kernel is broken: nothing to compare
        pytest.skip(f"_scaled_mm raises here: {exc}")
    assert ((real - emulated).abs().max() / real.abs().max()).item() < 1e-6


def test_torchaos_layer_under_the_emulation_equals_its_kernel():
    torch.manual_seed(1)
    plain, routed = nn.Linear(128, 128), nn.Linear(128, 128)
    routed.load_state_dict(plain.state_dict())
    plain, routed = fp8_linear.torchao_float8(plain), fp8_linear.torchao_float8(routed)
    x = torch.randn(64, 128)
    with fp8_linear.ScaledMMEmulation():
        y = routed(x)
        y.sum().backward()
    try:
        y0 = plain(x)
        y0.sum().backward()
    except RuntimeError as exc:
        pytest.skip(f"torchao's kernel raises here: {exc}")
    assert torch.allclose(y, y0, rtol=0, atol=1e-5) and torch.allclose(routed.weight.grad, plain.weight.grad, atol=1e-4)


def test_the_bf16_emulation_computes_what_autocast_does():
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8))
    x = torch.randn(32, 64)
    outs, grads = [], []
    for emulate in (False, True):
        model.zero_grad()
        with kernels.EmulatedBF16() if emulate else contextlib.nullcontext():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = model(x)
            y.float().sum().backward()
        outs.append(y)
        grads.append(model[0].weight.grad.clone())
    assert outs[1].dtype == torch.bfloat16
    assert (outs[0].float() - outs[1].float()).abs().max() <= 2 ** -7 * outs[0].float().abs().max()
    assert torch.allclose(grads[0], grads[1], rtol=2e-2, atol=1e-3)


FORCED_RUN = """
import torch
from torch import nn
from course_lib import fp8_linear, kernels
x, lin = torch.randn(4, 32), nn.Linear(32, 32)
for name, fn in [("bf16", lambda: lin(x)), ("fp8", lambda: fp8_linear.scaled_mm_kernel(*fp8_linear.cast_dynamic(x, "e4m3"), *fp8_linear.cast_dynamic(lin.weight.t(), "e4m3")))]:
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            fn()
        print(name, "ran")
    except RuntimeError as exc:
        print(name, "raised", "COURSE_KERNELS forces it" in str(exc))
with kernels.bf16_matmuls("cpu"), torch.autocast("cpu", dtype=torch.bfloat16):
    lin(x).float().sum().backward()
fp8_linear.FP8Linear(32, 32)(x).sum().backward()
with fp8_linear.ScaledMMEmulation():
    fp8_linear.scaled_mm_kernel(*fp8_linear.cast_dynamic(x, "e4m3"), *fp8_linear.cast_dynamic(lin.weight.t(), "e4m3"))
print("twins ran")
"""


def test_a_forced_broken_kernel_raises_and_its_twins_still_run():
    """What the forced notebook runs rest on: a path that still reaches the real kernel fails loudly."""
    out = subprocess.run([sys.executable, "-c", FORCED_RUN], capture_output=True, text=True, timeout=120,
                         env={**os.environ, kernels.FORCE_ENV: "bf16=broken,fp8=broken"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:3] == ["bf16 raised True", "fp8 raised True", "twins ran"], out.stdout


def test_cpu_speed_follows_the_bf16_verdict(fresh, monkeypatch):
    monkeypatch.setenv(kernels.FORCE_ENV, "bf16=broken")
    cpu = env.cpu_speed()
    assert cpu.bf16_is_slow and env.bf16_is_slow("cpu") and "broken or forced slow" in cpu.summary()


def test_the_compile_cache_is_keyed_by_the_machine(fresh, monkeypatch):
    here = kernels.inductor_cache_dir()
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert kernels.inductor_cache_dir() != here and kernels.inductor_cache_dir().parent == here.parent
