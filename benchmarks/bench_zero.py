"""ZeRO and FSDP2 against DDP on 4 ranks (chapter 09): bytes held, the peak of a step, bytes sent, step time.

One launch of ``course_lib.experiments.workers.zero_compare``; every ratio compares rank
0 of a method with rank 0 of DDP at the same world size. The memory and
traffic goals follow from the ZeRO paper (1/N of the sharded state; 1x, 1x and
1.5x of DDP's traffic). The peak goal is the point of stage 2: a model with
small activations (short sequences, a small batch), so the model states
dominate, and a stage-2 peak below stage 1's by at least 70% of what stage 2
does not hold, (N-1)/N of the gradient (the rest is its buckets in flight).
Peaks per rank and step times are plain figures (times are noisy on a shared CPU).
"""

from __future__ import annotations

from course_lib.experiments.run_config import RunConfig
from course_lib.experiments.workers.zero_common import run_workers

WORLD = 4
CFG = RunConfig(d_model=128, n_layers=4, seq_len=16, batch=8, steps=5, bucket_mb=0.25)
METHODS = ["ddp", "zero1", "zero2", "fsdp2"]


def run() -> dict[str, dict]:
    out = run_workers(WORLD, ["compare"], CFG, METHODS, timeout=300).compare
    m = out.methods
    ddp = m["ddp"]
    grad_bytes = 4 * out.num_params  # fp32

    def held(method: str, part: str) -> float:
        return m[method].held[0][part] / ddp.held[0][part]

    def sent(method: str) -> float:
        return m[method].sent_per_step[0] / ddp.sent_per_step[0]

    half = f"<= {1 / WORLD + 0.01}"  # 1/N, plus Adam's step counters and padding
    saving = min(a - b for a, b in zip(m["zero1"].peak, m["zero2"].peak)) / ((WORLD - 1) / WORLD * grad_bytes)
    table = {
        "zero1 optimizer bytes / DDP": {"value": held("zero1", "optimizer"), "goal": half},
        "zero2 gradient bytes / DDP": {"value": held("zero2", "grads"), "goal": half},
        "fsdp2 parameter bytes / DDP": {"value": held("fsdp2", "params"), "goal": half},
        "zero1 - zero2 peak / ((N-1)/N x gradient bytes)": {"value": saving, "goal": ">= 0.7"},
        "zero1 bytes sent / DDP": {"value": sent("zero1"), "goal": "<= 1.05"},
        "zero2 bytes sent / DDP": {"value": sent("zero2"), "goal": "<= 1.05"},
        "fsdp2 bytes sent / DDP": {"value": sent("fsdp2"), "goal": "<= 1.575"},
        "zero2 step time / DDP": {"value": m["zero2"].step_s / ddp.step_s, "goal": None},
        "fsdp2 step time / DDP": {"value": m["fsdp2"].step_s / ddp.step_s, "goal": None},
    }
    for method in METHODS:  # the largest over the ranks, in MB (1e6 bytes)
        table[f"{method} peak per rank (MB, 4 ranks)"] = {"value": max(m[method].peak) / 1e6, "goal": None}
    return table
