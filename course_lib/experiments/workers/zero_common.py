"""What ``course_lib.experiments.workers.zero_compare`` reports and the parent side (notebook 09, tests, benchmarks) reads back.

``run_workers`` launches it and returns ``WorkerResult.from_dict`` of what rank 0 reported: one field per task,
each a result of the library function that ran it (``dp_methods``, ``zero_meters``, ``checkpoint_runs``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from course_lib.experiments import results
from course_lib.experiments.dp_methods import CompareResult
from course_lib.experiments.run_config import RunConfig
from course_lib.experiments.checkpoint_runs import CrashResult, ReshardResult, ResumeResult
from course_lib.experiments.zero_meters import BucketTimeline


@dataclass
class WorkerResult(results.WorkerResult):
    """What one launch of ``course_lib.experiments.workers.zero_compare`` reports: one entry per task it ran."""

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
                log_dir: str | Path | None = None, trace_dir: str | Path | None = None,
                exact_steps: int | None = None) -> WorkerResult:
    """Launch ``course_lib.experiments.workers.zero_compare`` on ``world`` ranks for ``tasks`` (run in this order).

    ``exact_steps``: the float64 comparison's steps (default: ``cfg.steps``).
    """
    from course_lib.experiments import launch  # the parent side only

    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"unknown task(s) {unknown}; choose from {', '.join(TASKS)}")
    args = ["--tasks", ",".join(tasks), "--cfg", cfg.to_json(), "--every", str(every), "--crash-at", str(crash_at)]
    if methods:
        args += ["--methods", ",".join(methods)]
    if exact_steps is not None:
        if exact_steps < 1:
            raise ValueError(f"exact_steps must be at least 1, got {exact_steps}")
        args += ["--exact-steps", str(exact_steps)]
    if ckpt_dir is not None:
        args += ["--ckpt-dir", str(ckpt_dir)]
    if trace_dir is not None:
        args += ["--trace-dir", str(trace_dir)]
    out = launch.run("course_lib.experiments.workers.zero_compare", world, args, timeout=timeout, log_dir=log_dir)
    return WorkerResult.from_dict(out)
