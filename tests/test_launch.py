"""launch.run: results from rank 0, failures with their log, timeouts that leave nothing behind (2 gloo ranks)."""

from __future__ import annotations

import argparse
import json
import time
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist

from course_lib.experiments import launch
from course_lib.experiments.results import WorkerResult
from course_lib.experiments.workers.selftest import OkResult

WORKER = "course_lib.experiments.workers.selftest"
TIMEOUT = 120  # generous: the machine running the tests may be busy, but never unbounded


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_ok_returns_rank0_result():
    result = OkResult.from_dict(launch.run(WORKER, 2, ["--mode", "ok"], timeout=TIMEOUT))
    assert result.rank == 0 and result.world == 2
    assert result.sum == 3.0, "all-reduce of rank+1 over 2 ranks should be 1 + 2"
    assert result.backend == "gloo" and result.device == "cpu"
    assert result.omp_threads == 1, "workers should default to one thread each"


def test_failing_worker_raises_with_its_log(tmp_path: Path):
    with pytest.raises(RuntimeError) as info:  # log_dir: the kept logs land where pytest cleans up
        launch.run(WORKER, 2, ["--mode", "fail"], timeout=TIMEOUT, log_dir=tmp_path)
    msg = str(info.value)
    assert "rank 1" in msg
    assert "fails on purpose" in msg, "the error should carry the tail of the failing rank's log"


def _direct_children() -> set[int]:
    return {c.pid for c in psutil.Process().children()}


def _live_descendants_of_new_children(before: set[int]) -> set[psutil.Process]:
    """Live processes under this process's children that were not there ``before``. Older children keep their
    trees out of it: in a whole-suite run the background process (conftest) is one, and the notebooks it runs
    start torchrun launches of their own beside this test."""
    found = set()
    for child in psutil.Process().children():
        if child.pid in before:
            continue
        try:
            found |= {p for p in (child, *child.children(recursive=True)) if _alive(p.pid)}
        except psutil.NoSuchProcess:
            continue  # it exited while we looked
    return found


def test_hanging_worker_times_out_and_leaves_nothing(tmp_path: Path):
    # torchrun and two gloo ranks were up and hanging (their pid files written) after 7 s on two cores
    # under a load of 3; notebooks with ranks may run in the background beside this test (conftest.PREFETCH):
    # 20 s leaves them about three times that, and the test asserts that they did start
    timeout = 20.0
    before = _direct_children()  # earlier tests may leave helpers of their own (multiprocessing's resource tracker)
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        launch.run(WORKER, 2, ["--mode", "hang", "--pid-dir", str(tmp_path)], timeout=timeout,
                   log_dir=tmp_path / "logs")
    elapsed = time.monotonic() - start
    # the timeout, then at most a few grace periods to stop torchrun and its workers
    assert elapsed < timeout + 4 * launch.STOP_GRACE_S, f"took {elapsed:.1f} s"
    pids = {f.stem: int(f.read_text()) for f in tmp_path.glob("*.pid")}
    assert {"rank0", "rank1"} <= set(pids), f"the workers never started in {timeout} s: {pids}"
    left = {name: pid for name, pid in pids.items() if _alive(pid)}
    assert not left, f"processes left behind after the timeout: {left}"
    children = _live_descendants_of_new_children(before)
    assert not children, f"the launch left children of the test process: {children}"


def test_mismatched_collective_is_an_error_not_a_hang(tmp_path: Path):
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:  # not TimeoutError: the process group timed out first
        launch.run(WORKER, 2, ["--mode", "mismatch", "--pg-timeout", "5"], timeout=TIMEOUT, log_dir=tmp_path)
    assert "timed out" in str(info.value).lower() or "timeout" in str(info.value).lower()
    assert time.monotonic() - start < TIMEOUT


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="nproc"):
        launch.run(WORKER, 0)
    with pytest.raises(ValueError, match="no module named"):
        launch.run("course_lib.experiments.workers.does_not_exist", 2)
    with pytest.raises(ValueError, match="no module named"):
        launch.run("no_such_package.worker", 2)
    with pytest.raises(RuntimeError, match="torchrun"):
        launch.init_distributed()  # not inside a worker


# ----- the worker side, in this process --------------------------------------------------


@pytest.fixture
def gpus(monkeypatch):
    """Pretend this machine has ``n`` GPUs: ``gpus(4)``."""
    def set_gpus(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    monkeypatch.delenv("COURSE_DIST_BACKEND", raising=False)
    monkeypatch.delenv("COURSE_PROFILE", raising=False)
    return set_gpus


def test_backend_follows_the_gpus(gpus):
    gpus(4)
    assert launch.pick_backend(4) == "nccl"
    gpus(2)
    assert launch.pick_backend(4) == "gloo", "fewer GPUs than local ranks: all ranks on the CPU"
    gpus(0)
    assert launch.pick_backend(1) == "gloo"


def test_a_cpu_profile_on_a_gpu_node_says_so(gpus, monkeypatch):
    gpus(4)
    monkeypatch.setenv("COURSE_PROFILE", "cpu")
    with pytest.warns(UserWarning, match="COURSE_PROFILE=cpu keeps the 4 local ranks on the CPU.*"
                                         "COURSE_DIST_BACKEND=nccl"):
        assert launch.pick_backend(4) == "gloo"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning for the other local ranks, nor when there are no GPUs
        assert launch.pick_backend(4, warn=False) == "gloo"
        gpus(0)
        assert launch.pick_backend(4) == "gloo"
    gpus(4)
    monkeypatch.setenv("COURSE_DIST_BACKEND", "nccl")  # the explicit choice wins, silently
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert launch.pick_backend(4) == "nccl"
    monkeypatch.setenv("COURSE_DIST_BACKEND", "mpi")
    with pytest.raises(ValueError, match="'gloo' or 'nccl'"):
        launch.pick_backend(4)


def _fake_torchrun(monkeypatch, local_rank: int, world: int) -> list:
    """torchrun's environment, and a spy for init_process_group instead of a real group."""
    monkeypatch.setenv("RANK", str(local_rank))
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(world))
    calls: list = []
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append((backend, kw)))
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", device)))
    return calls


def test_gpu_ranks_get_nccl_with_gloo_for_cpu_tensors(gpus, monkeypatch):
    gpus(2)
    calls = _fake_torchrun(monkeypatch, local_rank=1, world=2)
    rank, world, device = launch.init_distributed()
    assert (rank, world, device) == (1, 2, torch.device("cuda", 1))
    assert calls[0] == ("set_device", torch.device("cuda", 1))
    backend, kw = calls[1]
    assert backend == "cpu:gloo,cuda:nccl", "CPU bookkeeping tensors must not reach NCCL"
    assert kw["device_id"] == torch.device("cuda", 1)
    assert kw["timeout"] == timedelta(seconds=launch.PG_TIMEOUT_S)


def test_process_group_timeout_is_a_parameter(gpus, monkeypatch):
    gpus(0)
    calls = _fake_torchrun(monkeypatch, local_rank=0, world=2)
    assert launch.init_distributed(timeout_s=7.5)[2] == torch.device("cpu")
    assert calls == [("gloo", {"timeout": timedelta(seconds=7.5)})]
    # the default covers rank 0 computing a reference while the others wait (seconds at the gpu profile)
    assert launch.PG_TIMEOUT_S >= 300
    with pytest.raises(ValueError, match="positive"):
        launch.init_distributed(timeout_s=0)
    parser = argparse.ArgumentParser()
    launch.add_timeout_arg(parser)
    assert parser.parse_args([]).pg_timeout == launch.PG_TIMEOUT_S
    assert parser.parse_args(["--pg-timeout", "5"]).pg_timeout == 5.0


@dataclass
class _Inner(WorkerResult):
    name: str
    times: list[float]


@dataclass
class _Outer(WorkerResult):
    world: int
    inner: _Inner
    by_key: dict[str, _Inner]
    spans: list[tuple[int, str, float]]
    maybe: _Inner | None = None
    extra: list[int] = field(default_factory=list)


def test_results_round_trip_as_dataclasses(tmp_path, monkeypatch):
    result = _Outer(2, _Inner("a", [1.0]), {"x": _Inner("b", [])}, [(0, "F", 0.5)], None)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv(launch.RESULT_ENV, str(tmp_path / "r.json"))
    launch.report(result)                       # what a worker does
    back = _Outer.from_dict(json.loads((tmp_path / "r.json").read_text()))  # what the parent does
    assert back == result
    assert isinstance(back.by_key["x"], _Inner) and back.spans == [(0, "F", 0.5)]
    with pytest.raises(ValueError, match="no field.*'typo'"):
        _Inner.from_dict({"name": "a", "times": [], "typo": 1})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_gpu_rank_runs_on_nccl_with_its_tensors_on_the_gpu():
    r = OkResult.from_dict(launch.run(WORKER, 1, ["--mode", "ok"], timeout=TIMEOUT,
                                      env={"COURSE_DIST_BACKEND": "nccl"}))
    assert r.backend == launch.NCCL_WITH_CPU and r.device == "cuda:0" and r.sum == 1.0
