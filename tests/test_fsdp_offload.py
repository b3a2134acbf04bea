"""FSDP2's CPUOffloadPolicy (chapter 11): the same losses on CPU ranks; on GPUs, the states leave the device."""

import pytest
import torch

from course_lib.experiments import launch
from course_lib.experiments.run_config import RunConfig

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="CPUOffloadPolicy pins host memory: it needs CUDA")


def test_offload_policy_changes_no_loss_on_cpu_ranks():
    out = launch.run("course_lib.experiments.workers.fsdp_offload", nproc=2, timeout=240, env={"COURSE_PROFILE": "smoke"},
                     args=["--cfg", RunConfig(steps=3).to_json(), "--pin-memory", "0"])
    assert out["device"] == "cpu" and out["world"] == 2
    assert out["modes"]["cpu"]["losses"] == out["modes"]["none"]["losses"]
    assert out["modes"]["none"]["cuda_peak_bytes"] is None  # no device memory to speak of on CPU ranks


def test_pinned_offload_on_cpu_ranks_is_a_clear_error():
    with pytest.raises(RuntimeError, match="needs CUDA ranks"):
        launch.run("course_lib.experiments.workers.fsdp_offload", nproc=1, timeout=120, env={"COURSE_PROFILE": "smoke"},
                   args=["--cfg", RunConfig(steps=1).to_json(), "--modes", "cpu"])


@gpu
def test_offload_policy_moves_the_states_off_the_gpu():
    nproc = min(2, torch.cuda.device_count())
    cfg = RunConfig(d_model=512, n_heads=8, n_layers=4, seq_len=128, batch=8, steps=4)
    out = launch.run("course_lib.experiments.workers.fsdp_offload", nproc=nproc, timeout=300, env={"COURSE_PROFILE": "gpu"},
                     args=["--cfg", cfg.to_json()])
    assert out["device"] == "cuda"
    none, cpu = out["modes"]["none"], out["modes"]["cpu"]
    assert all(b == 0 for b in cpu["device_state_bytes"]) and all(b > 0 for b in none["device_state_bytes"])
    assert all(h >= d for h, d in zip(cpu["host_state_bytes"], none["device_state_bytes"]))
    assert all(c < n for c, n in zip(cpu["cuda_peak_bytes"], none["cuda_peak_bytes"]))
    assert max(abs(a - b) for a, b in zip(cpu["losses"], none["losses"])) < 1e-3
