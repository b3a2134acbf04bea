"""Measured pipeline bubble against each schedule's formula (chapter 08).

Four processes run one training step of a small transformer with the hand-written
executor, GPipe, 1F1B, interleaved 1F1B (two chunks per rank) and ZB-H1, eight
micro-batches; every op is padded to a fixed time (50 ms forward, 100 ms backward) so
the stages cost the same however loaded the CPU is. The ranks run on the CPU with gloo
on any machine, so the figure is comparable everywhere. Each value is the larger
|measured - formula| gap of its schedules: what messaging and process wake-ups add to
the schedule's own idle time ((p-1)/(m+p-1), (p-1)/(v m+p-1), and Qi et al.'s ZB-H1 formula).
"""

from __future__ import annotations

from course_lib.experiments import launch
from course_lib.parallel.pipeline.schedules import bubble_formula
from course_lib.experiments.workers.pipeline_run import PipelineResult

P, M = 4, 8


def run() -> dict:
    result = PipelineResult.from_dict(launch.run(
        "course_lib.experiments.workers.pipeline_run", nproc=P, timeout=300, env={"COURSE_DIST_BACKEND": "gloo"},
        args=["--api", "handmade", "--schedules", "gpipe,1f1b,interleaved,zb-h1", "--microbatches", str(M),
              "--t-forward-ms", "50", "--t-backward-ms", "100", "--repeats", "2"]))
    error = {r.kind: abs(r.bubble_measured - r.bubble_formula) for r in result.handmade}
    assert all(r.bubble_formula == bubble_formula(P, M) for r in result.handmade if r.kind in ("gpipe", "1f1b"))
    return {"pipeline_bubble_error": {"value": max(error["gpipe"], error["1f1b"]), "goal": "<= 0.05"},
            "pipeline_bubble_error_interleaved_zb": {"value": max(error["interleaved"], error["zb-h1"]),
                                                     "goal": "<= 0.05"}}
