"""ZeroOptimizer when the ranks disagree: a skipped backward, an error on one rank, clipping (chapter 09).

The first three with the opt-in layer ``agreement.GuardedZeroOptimizer`` switched on; the last test counts what
the plain ``ZeroOptimizer`` hands to torch.distributed, against ZeRO's formula. One launch on 2 gloo ranks
(``course_lib.experiments.workers.zero_faults``) with a short process-group timeout: a rank left waiting in a
collective turns into a failed launch within seconds, not a hang.
"""

from __future__ import annotations

import pytest

from course_lib.experiments import launch
from course_lib.experiments.workers.zero_faults import FaultChecks


@pytest.fixture(scope="module")
def checks() -> FaultChecks:
    return FaultChecks.from_dict(launch.run("course_lib.experiments.workers.zero_faults", 2, ["--pg-timeout", "30"], timeout=150))


def test_a_rank_that_skips_its_backward_leaves_no_one_waiting(checks):
    s = checks.skip
    assert s.ranks_equal, "the ranks hold different parameters"
    assert max(s.max_diff) < 1e-12, f"not single-process Adam on the mean over the ranks: {s.max_diff}"
    # rank 0: 2 backwards x 3 steps, each opened and closed by a flag all-reduce, and one per step()
    assert s.control_calls == [15, 15]


def test_a_gradient_arriving_twice_on_one_rank_raises_on_every_rank(checks):
    t = checks.twice
    assert all("rank(s) [1]" in e for e in t.errors), t.errors
    assert "arrived twice" in t.errors[1] and "use_reentrant=False" in t.errors[1]
    assert t.then_ok


def test_sharded_clipping_equals_single_process_clipping(checks):
    c = checks.clip
    assert c.clipped, "the test wants a limit below the gradient's norm"
    for stage in ("stage1", "stage2"):
        assert c.max_diff[stage] < 1e-12, (stage, c.max_diff)
        assert c.norm_diff[stage] < 1e-12, (stage, c.norm_diff)
    assert all("ZeroOptimizer.clip_grad_norm_" in e for e in c.misuse_errors), c.misuse_errors


def test_a_plain_step_sends_zeros_formula_and_nothing_else(checks):
    # ZeRO (Rajbhandari et al. 2020, section 7): a reduce-scatter of the gradient and an all-gather of the parameters,
    # (N-1)/N x Ψ elements each, 2(N-1)/N x Ψ per rank per step: DDP's all-reduce. No flag, no barrier
    c, n = checks.count, 2
    buckets, ring = c.buckets, 2 * (n - 1) / n * c.flat_numel * c.element_size  # Ψ and each bucket's padding
    assert c.flat_numel - c.num_params < n * buckets, "padding: less than N elements per bucket"
    for name in ("stage1", "stage2"):
        assert c.ops[name] == [{"reduce_scatter": buckets, "all_gather": buckets}] * n, (name, c.ops[name])
        assert c.sent[name] == [ring] * n, (name, c.sent[name], ring)
    # accumulation of A = 2 micro-batches: stage 2 reduce-scatters after each backward, (A+1)/2 x
    assert c.ops["stage2_accum2"] == [{"reduce_scatter": 2 * buckets, "all_gather": buckets}] * n
    assert c.sent["stage2_accum2"] == [1.5 * ring] * n
