"""Measured pipeline bubble against the formula (p - 1) / (m + p - 1) (chapter 07).

Four processes run one training step of a small transformer with the hand-written
executor, GPipe and 1F1B, eight micro-batches; every op is padded to a fixed time
(50 ms forward, 100 ms backward) so the stages cost the same however loaded the
CPU is. The ranks run on the CPU with gloo on any machine, so the figure is comparable
everywhere. The value is the larger of the two |measured - formula| gaps: what
messaging and process wake-ups add to the schedule's own idle time.
"""

from __future__ import annotations

from course_lib.distributed import launch
from course_lib.distributed.pipeline import bubble_formula
from course_lib.workers.pipeline_run import PipelineResult

P, M = 4, 8


def run() -> dict:
    result = PipelineResult.from_dict(launch.run(
        "course_lib.workers.pipeline_run", nproc=P, timeout=300, env={"COURSE_DIST_BACKEND": "gloo"},
        args=["--api", "handmade", "--schedules", "gpipe,1f1b", "--microbatches", str(M),
              "--t-forward-ms", "50", "--t-backward-ms", "100", "--repeats", "2"]))
    error = max(abs(r.bubble_measured - bubble_formula(P, M)) for r in result.handmade)
    return {"pipeline_bubble_error": {"value": error, "goal": "<= 0.05"}}
