"""launch.run: results from rank 0, failures with their log, timeouts that leave nothing behind (2 gloo ranks)."""

from __future__ import annotations

import time
from pathlib import Path

import psutil
import pytest

from course_lib.distributed import launch

WORKER = "course_lib.workers.selftest"
TIMEOUT = 120  # generous: the machine running the tests may be busy, but never unbounded


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_ok_returns_rank0_result():
    result = launch.run(WORKER, 2, ["--mode", "ok"], timeout=TIMEOUT)
    assert result["rank"] == 0 and result["world"] == 2
    assert result["sum"] == 3.0, "all-reduce of rank+1 over 2 ranks should be 1 + 2"
    assert result["backend"] == "gloo"
    assert result["omp_threads"] == 1, "workers should default to one thread each"


def test_failing_worker_raises_with_its_log(tmp_path: Path):
    with pytest.raises(RuntimeError) as info:  # log_dir: the kept logs land where pytest cleans up
        launch.run(WORKER, 2, ["--mode", "fail"], timeout=TIMEOUT, log_dir=tmp_path)
    msg = str(info.value)
    assert "rank 1" in msg
    assert "fails on purpose" in msg, "the error should carry the tail of the failing rank's log"


def test_hanging_worker_times_out_and_leaves_nothing(tmp_path: Path):
    timeout = 20.0
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
    children = [p for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE]
    assert not children, f"the test process still has children: {children}"


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
        launch.run("course_lib.workers.does_not_exist", 2)
    with pytest.raises(ValueError, match="no module named"):
        launch.run("no_such_package.worker", 2)
    with pytest.raises(RuntimeError, match="torchrun"):
        launch.init_distributed()  # not inside a worker
