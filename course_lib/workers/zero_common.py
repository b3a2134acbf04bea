"""What the chapter-09 workers report and the parent side (notebook 09, tests, benchmarks) reads back, typed.

The run they share (its ``RunConfig``, the model, the batches, the
single-process reference) is ``course_lib.distributed.experiment``; the
methods they train, ``course_lib.distributed.dp_methods``.

A worker fills the result dataclasses below and reports a ``WorkerResult``;
``run_workers`` launches it and returns ``WorkerResult.from_dict`` of what rank 0 reported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from course_lib.distributed import results
from course_lib.distributed.dp_methods import MethodResult
from course_lib.distributed.experiment import RunConfig


@dataclass
class CompareResult:
    """Every method trained on the same batches, and the single-process reference (rank 0)."""

    world: int
    device: str                      # where the ranks ran: "cpu" (gloo) or "cuda" (NCCL, one GPU per rank)
    num_params: int
    dtype: str
    accumulation: int
    ref_losses: list[float] | None
    methods: dict[str, MethodResult]


@dataclass
class BucketTimeline:
    """When ZeroOptimizer's buckets leave, seen from each parameter's gradient as the backward computes it."""

    stage: int
    buckets: int
    names: list[str]                 # parameters in the order their gradients were computed
    reduce_scatters_seen: list[int]  # reduce-scatters already issued when that gradient was computed
    after_backward: int              # reduce-scatters issued by the end of the backward
    full_grad_bytes_after_backward: int  # bytes of the parameters' .grad left after the backward
    slice_grad_bytes: int            # bytes of this rank's averaged gradient slices after the backward


@dataclass
class CrashResult:
    losses: list[float]
    crashed: bool


@dataclass
class ResumeResult:
    """A run resumed from the latest complete checkpoint against one that never stopped."""

    checkpoint: str
    incomplete: list[str]
    incomplete_has_metadata: list[bool]
    incomplete_files: list[list[str]]
    saved_world: int
    start: int
    digest_ok: bool                  # the loaded full state equals the saved one, bit for bit
    losses_before_crash: list[float]
    resumed: list[float]
    never_stopped: list[float]
    identical: bool
    max_abs_diff: float


@dataclass
class ReshardResult:
    """A checkpoint loaded at this world size: state intact, and a few more steps."""

    checkpoint: str
    saved_world: int
    loaded_world: int
    digest_ok: bool
    start: int
    losses: list[float]


@dataclass
class WorkerResult(results.WorkerResult):
    """What one launch of ``course_lib.workers.zero_compare`` reports: one entry per task it ran."""

    world: int
    compare: CompareResult | None = None
    exact: CompareResult | None = None
    timeline: list[BucketTimeline] = field(default_factory=list)
    crash: CrashResult | None = None
    resume: ResumeResult | None = None
    reshard: ReshardResult | None = None
    trace: list[str] = field(default_factory=list)  # rank 0's trace files (task ``trace``: one per rank each)


TASKS = ("compare", "exact", "timeline", "trace", "crash", "resume", "reshard")


def run_workers(world: int, tasks: list[str], cfg: RunConfig, methods: list[str] | None = None,
                ckpt_dir: str | Path | None = None, every: int = 2, crash_at: int = 4, timeout: float = 300,
                log_dir: str | Path | None = None, trace_dir: str | Path | None = None) -> WorkerResult:
    """Launch ``course_lib.workers.zero_compare`` on ``world`` ranks for ``tasks`` (run in this order)."""
    from course_lib.distributed import launch  # the parent side only

    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"unknown task(s) {unknown}; choose from {', '.join(TASKS)}")
    args = ["--tasks", ",".join(tasks), "--cfg", cfg.to_json(), "--every", str(every), "--crash-at", str(crash_at)]
    if methods:
        args += ["--methods", ",".join(methods)]
    if ckpt_dir is not None:
        args += ["--ckpt-dir", str(ckpt_dir)]
    if trace_dir is not None:
        args += ["--trace-dir", str(trace_dir)]
    out = launch.run("course_lib.workers.zero_compare", world, args, timeout=timeout, log_dir=log_dir)
    return WorkerResult.from_dict(out)
