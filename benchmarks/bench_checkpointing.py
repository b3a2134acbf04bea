"""Activation checkpointing on the chapter-05 chain of 16 Linear+ReLU blocks: memory saved, time paid.

- ``checkpoint_peak_ratio``: peak bytes of forward + backward with ``best_segments(16) = 4`` segments over
  the peak without checkpointing. Chen et al.'s ``n/k + k`` predicts 8/17 = 0.47.
- ``checkpoint_time_ratio``: step time with those segments over the plain step (fastest of several runs,
  taken in turns). Recomputing 12 of 16 block forwards, with a backward of about two forwards, predicts
  about (3 + 0.75) / 3 = 1.25.
- ``checkpoint_cpu_time_ratio`` (on a CPU): the same ratio in one thread's CPU time, which other
  processes on a shared machine do not inflate (measured 1.30).
"""

from __future__ import annotations

import time

import torch

from course_lib import memory
from course_lib.checkpointing import best_segments, chain, checkpointed_sequential
from course_lib.timing import fastest_times

N_BLOCKS = 16
BATCH, WIDTH = 2048, 256  # large enough that the matmuls, not Python overhead, set the step time on a CPU


def run() -> dict[str, dict]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    blocks = chain(N_BLOCKS, WIDTH).to(device)
    x = torch.randn(BATCH, WIDTH, device=device)
    ckpt = checkpointed_sequential(blocks, best_segments(N_BLOCKS))

    def step(model: torch.nn.Module):
        def run_step() -> None:
            model(x).sum().backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        return run_step

    def peak(model: torch.nn.Module) -> int:
        blocks.zero_grad(set_to_none=True)  # gradients are allocated inside the step, as in training
        return memory.peak_bytes(step(model), device)

    step(blocks)()  # warm-up
    peak_ratio = peak(ckpt) / peak(blocks)
    times = fastest_times({"plain": step(blocks), "checkpointed": step(ckpt)}, repeats=7)
    out = {
        "checkpoint_peak_ratio": {"value": peak_ratio, "goal": "<= 0.6"},
        "checkpoint_time_ratio": {"value": times["checkpointed"] / times["plain"], "goal": "<= 1.5"},
    }
    if device.type == "cpu":
        cpu = fastest_times({"plain": step(blocks), "checkpointed": step(ckpt)}, repeats=7, clock=time.process_time,
                            threads=1)
        out["checkpoint_cpu_time_ratio"] = {"value": cpu["checkpointed"] / cpu["plain"], "goal": "<= 1.4"}
    return out


if __name__ == "__main__":
    for name, entry in run().items():
        print(f"{name}: {entry['value']:.3f} (goal {entry['goal']})")
