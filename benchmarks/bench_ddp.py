"""Step time of the hand-written DDP wrappers against torch DDP, on 2 gloo ranks (chapter 07).

All four train the same MLP (4.0 MiB of float32 gradients: 1,055,754 parameters) on the
same data, interleaved round by round in one run, so the ratios compare like with like
on whatever machine runs them. The goal for ``BucketedDDP`` and ``DynamicBucketedDDP``
is to stay within 1.2x of torch DDP's C++ reducer; ``NaiveDDP`` has no goal: it shows
what bucketing and overlap buy.
"""

from __future__ import annotations

from course_lib.experiments import launch
from course_lib.experiments.workers.ddp_compare import CompareResult

ROUNDS, STEPS = 7, 5  # 7 interleaved rounds of 5 steps per wrapper: the median tames a busy machine


def run() -> dict:
    result = CompareResult.from_dict(launch.run(
        "course_lib.experiments.workers.ddp_compare", 2,
        ["--timing-only", "--timing-rounds", str(ROUNDS), "--timing-steps", str(STEPS)], timeout=600,
        env={"COURSE_DIST_BACKEND": "gloo"}))
    ms = result.timing.ms
    return {
        "ddp_bucketed_over_torch": {"value": ms["bucketed"] / ms["torch"], "goal": "<= 1.2"},
        "ddp_dynamic_over_torch": {"value": ms["dynamic"] / ms["torch"], "goal": "<= 1.2"},
        "ddp_naive_over_torch": {"value": ms["naive"] / ms["torch"], "goal": None},
    }


if __name__ == "__main__":
    for name, entry in run().items():
        print(f"{name}: {entry['value']:.3f} (goal {entry['goal']})")
