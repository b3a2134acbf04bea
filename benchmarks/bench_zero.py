"""ZeRO and FSDP2 against DDP on 2 ranks (chapter 08): bytes held per rank, bytes sent, step time.

One launch of ``course_lib.workers.zero_compare``; every ratio compares rank
0 of a method with rank 0 of DDP at the same world size. The memory and
traffic goals follow from the ZeRO paper (1/N of the sharded state; 1x, 1x and
1.5x of DDP's traffic); step times are plain figures (noisy on a shared CPU).
"""

from __future__ import annotations

from course_lib.distributed import launch
from course_lib.workers.zero_common import RunConfig

WORLD = 2
CFG = RunConfig(d_model=64, n_layers=2, seq_len=32, batch=8, steps=5)


def run() -> dict[str, dict]:
    out = launch.run("course_lib.workers.zero_compare", WORLD,
                     ["--tasks", "compare", "--methods", "ddp,zero1,zero2,fsdp2", "--cfg", CFG.to_json()],
                     timeout=300)
    m = out["compare"]["methods"]
    ddp = m["ddp"]

    def held(method: str, part: str) -> float:
        return m[method]["held"][0][part] / ddp["held"][0][part]

    def sent(method: str) -> float:
        return m[method]["sent_per_step"][0] / ddp["sent_per_step"][0]

    half = f"<= {1 / WORLD + 0.01}"  # 1/N, plus Adam's step counters and padding
    return {
        "zero1 optimizer bytes / DDP": {"value": held("zero1", "optimizer"), "goal": half},
        "zero2 gradient bytes / DDP": {"value": held("zero2", "grads"), "goal": half},
        "fsdp2 parameter bytes / DDP": {"value": held("fsdp2", "params"), "goal": half},
        "zero1 bytes sent / DDP": {"value": sent("zero1"), "goal": "<= 1.05"},
        "zero2 bytes sent / DDP": {"value": sent("zero2"), "goal": "<= 1.05"},
        "fsdp2 bytes sent / DDP": {"value": sent("fsdp2"), "goal": "<= 1.575"},
        "zero2 step time / DDP": {"value": m["zero2"]["step_s"] / ddp["step_s"], "goal": None},
        "fsdp2 step time / DDP": {"value": m["fsdp2"]["step_s"] / ddp["step_s"], "goal": None},
    }
