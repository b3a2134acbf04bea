"""course_lib.timing: the one way the course times (warm-up, repeats in turns, fastest and median)."""

import time

import pytest
import torch

from course_lib import checkpointing, env, timing


def test_time_s_with_a_given_clock_reads_it_twice():
    ticks = iter([1.0, 3.5])
    assert timing.time_s(lambda: None, "cpu", clock=lambda: next(ticks)) == 2.5


def test_bench_warms_up_then_repeats():
    calls = []
    t = timing.bench(lambda: calls.append(1), repeats=4, warmup=2)
    assert len(calls) == 6 and len(t.seconds) == 4 and t.warmup == 2 and t.clock == "perf_counter"
    assert t.min_s <= t.median_s <= t.max_s and t.spread >= 1.0


def test_in_turns_alternates_and_names_the_clock():
    calls = []
    times = timing.in_turns({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, repeats=3,
                            clock=time.process_time)
    assert calls == ["a", "b"] * 4  # one warm-up round, then three rounds in turns
    assert {t.clock for t in times.values()} == {"process_time"}


def test_the_fastest_call_is_kept():
    ticks = iter([0, 5, 10, 11, 20, 23])  # each call reads the clock twice: 5, 1, 3 units
    t = timing.bench(lambda: None, repeats=3, warmup=0, clock=lambda: next(ticks))
    assert t.seconds == (5, 1, 3) and t.min_s == 1 and t.median_s == 3 and t.spread == 5
    assert "min 1" in t.summary("s") and "3 calls" in t.summary("s")


def test_threads_are_set_and_restored():
    before = torch.get_num_threads()
    seen = []
    timing.bench(lambda: seen.append(torch.get_num_threads()), repeats=2, threads=1)
    assert seen == [1, 1, 1] and torch.get_num_threads() == before


def test_bad_arguments():
    with pytest.raises(ValueError):
        timing.bench(lambda: None, repeats=0)
    with pytest.raises(ValueError):
        timing.bench(lambda: None, warmup=-1)
    with pytest.raises(TypeError):
        timing.bench(lambda: None, clock=3.0)
    with pytest.raises(ValueError):
        timing.Timing((), 0, "perf_counter")


def test_one_implementation():
    # env.time_s and checkpointing.fastest_times are this module's functions, not copies
    assert env.time_s is timing.time_s
    assert checkpointing.fastest_times is timing.fastest_times


def test_a_sleep_is_timed():
    t = timing.bench(lambda: time.sleep(0.01), repeats=2, warmup=0)
    assert 0.009 < t.min_s < 0.5
