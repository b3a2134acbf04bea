"""course_lib.parallel_runs: independent jobs in a few processes, the same numbers as one by one, and no hang."""

import os
import signal
import time

import pytest
import torch
from torch import nn

from course_lib import env, parallel_runs

needs_fork = pytest.mark.skipif(not parallel_runs.can_fork(), reason="jobs run in forked processes on Linux only")


def train_tiny(seed: int, lr: float) -> dict:
    """A few SGD steps of a small CNN on random data: every number depends on the seed and the threads."""
    env.seed_everything(seed)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(512, 4))
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    x, y = torch.randn(64, 3, 8, 8), torch.randint(0, 4, (64,))
    losses = []
    for _ in range(20):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "weights": [p.detach().clone() for p in net.parameters()], "pid": os.getpid()}


def fails_on_two(seed: int) -> int:
    if seed == 2:
        raise ValueError(f"seed {seed} is bad")
    time.sleep(0.2)
    return seed


def dies_on_one(seed: int) -> int:
    if seed == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return seed


def sleeps(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


@needs_fork
def test_results_equal_one_by_one_bit_for_bit_and_in_order():
    jobs = [(seed, lr) for seed in range(3) for lr in (0.05, 0.5)]
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # the parent's OpenMP pool in use before the fork: the children must not hang on it
    try:
        train_tiny(0, 0.1)
    finally:
        torch.set_num_threads(before)
    one_by_one = parallel_runs.run_jobs(train_tiny, jobs, processes=1)  # in this process, one thread a job
    parallel = parallel_runs.run_jobs(train_tiny, jobs, processes=2)
    assert len(parallel) == len(jobs)
    assert {r["pid"] for r in parallel} - {os.getpid()}, "the jobs did not run in other processes"
    assert len({r["pid"] for r in parallel}) == 2
    for a, b in zip(one_by_one, parallel):
        assert a["losses"] == b["losses"]  # floats compared exactly
        assert all(torch.equal(p, q) for p, q in zip(a["weights"], b["weights"]))
    assert one_by_one[0]["losses"] != one_by_one[2]["losses"]  # the seeds do differ: the check can fail
    assert {r["pid"] for r in one_by_one} == {os.getpid()}


@needs_fork
def test_a_failing_job_raises_its_traceback_and_stops_the_others():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?s)job 2 of 6, fails_on_two\(2,\).*ValueError: seed 2 is bad"):
        parallel_runs.run_jobs(fails_on_two, range(6), processes=2)
    assert time.monotonic() - start < 30


@needs_fork
def test_a_killed_process_is_an_error_not_a_hang():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="died .*exit code -9"):
        parallel_runs.run_jobs(dies_on_one, range(4), processes=2)
    assert time.monotonic() - start < 30


@needs_fork
def test_a_run_past_its_timeout_is_stopped():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="unfinished after 1 s"):
        parallel_runs.run_jobs(sleeps, [(60,), (60,)], processes=2, timeout=1)
    assert time.monotonic() - start < 30


def test_one_process_runs_in_this_process_and_bad_counts_are_refused(monkeypatch):
    assert parallel_runs.run_jobs(fails_on_two, [0, 1], processes=1) == [0, 1]
    with pytest.raises(ValueError, match="processes must be"):
        parallel_runs.run_jobs(fails_on_two, [0, 1], processes=0)
    monkeypatch.setenv(parallel_runs.PROCESSES_ENV, "two")
    if parallel_runs.can_fork():
        with pytest.raises(ValueError, match="COURSE_PROCESSES must be a positive whole number"):
            parallel_runs.default_processes()
    monkeypatch.setenv(parallel_runs.PROCESSES_ENV, "3")
    assert parallel_runs.default_processes() == (3 if parallel_runs.can_fork() else 1)
