"""Counting collectives and the hand-written ring all-reduce (3 gloo ranks in one launch)."""

from __future__ import annotations

import pytest

from course_lib.distributed import comm, launch

WORLD = 3  # not 2: 2(N-1)/N = 4/3 here, so a formula that ignores N would show


@pytest.fixture(scope="module")
def checks() -> dict:
    return launch.run("course_lib.workers.selftest", WORLD, ["--mode", "comm"], timeout=120)


def test_ring_all_reduce_equals_torch(checks):
    for key in ("ring_3000", "ring_3001"):
        assert checks[key]["max_abs_diff"] < 1e-5, f"{key}: the ring sum differs from dist.all_reduce"


def test_ring_all_reduce_sends_2_n_minus_1_over_n(checks):
    even = checks["ring_3000"]
    assert even["bytes"] == 2 * (WORLD - 1) / WORLD * even["tensor_bytes"]
    uneven = checks["ring_3001"]  # chunks of 1001/1000/1000 elements: off by at most a few elements
    assert abs(uneven["bytes"] - 2 * (WORLD - 1) / WORLD * uneven["tensor_bytes"]) <= 2 * (WORLD - 1) * 4


def test_counting_wrappers(checks):
    w = checks["wrappers"]
    for op in ("all_reduce", "reduce_scatter", "all_gather", "broadcast"):
        assert w[f"{op}_ok"], f"comm.{op} gave a wrong result"
        assert w["calls"][op] == 1
    full = w["full_bytes"]
    assert w["by_op"]["all_reduce"] == pytest.approx(2 * (WORLD - 1) / WORLD * full)
    assert w["by_op"]["reduce_scatter"] == pytest.approx((WORLD - 1) / WORLD * full)
    assert w["by_op"]["all_gather"] == pytest.approx((WORLD - 1) / WORLD * full)
    assert w["bytes"] == pytest.approx(sum(w["by_op"].values()))
    assert "multiple of 3" in checks["shape_error"]


def test_ring_factor_and_counter():
    assert comm.ring_factor("all_reduce", 1) == 0.0
    assert comm.ring_factor("all_reduce", 2) == 1.0
    assert comm.ring_factor("all_reduce", 64) == pytest.approx(2 * 63 / 64)
    with pytest.raises(ValueError, match="unknown collective"):
        comm.ring_factor("all_to_all", 2)
    c = comm.ByteCounter()
    c.add("all_reduce", 10)
    c.add("all_reduce", 5)
    assert (c.bytes, c.by_op, c.calls) == (15, {"all_reduce": 15}, {"all_reduce": 2})
    c.reset()
    assert c.bytes == 0 and not c.by_op
