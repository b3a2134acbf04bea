"""``course gpu-check`` without a GPU: the message and exit status, the list, the table; its checks on the CPU.

The in-process checks take a device, so here they run on the CPU (bf16 autocast
on the CPU, no pinned memory, no CUDA statistics): what a GPU adds is the device
and the statistics, not another code path of the check. The checks that launch
ranks are left to the GPU machine (chapters 07, 09 and 11's tests launch them).
"""

from __future__ import annotations

import pytest
import torch

from course_lib.tools import cli, gpu_check
from course_lib.tools.gpu_check import Check, Measured, Row


def test_without_cuda_it_says_it_needs_a_gpu_and_fails(monkeypatch, capsys) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["gpu-check"]) == gpu_check.NO_GPU_EXIT != 0
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" in err and "course gpu-check --list" in err and "--profile cpu" in err


def test_the_list_names_every_gpu_path_and_needs_no_gpu(monkeypatch, capsys) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["gpu-check", "--list"]) == 0
    listed = capsys.readouterr().out
    names = [c.name for c in gpu_check.CHECKS]
    assert names == ["resnets", "transformer", "checkpointing", "chunked-loss", "offload", "tp-block",
                     "ring-attention", "moe", "planner", "ddp", "zero-fsdp", "fsdp-offload"]
    assert all(name in listed for name in names)
    assert {c.name for c in gpu_check.CHECKS if c.ranks} == {"ddp", "zero-fsdp", "fsdp-offload"}
    assert listed.count("[one rank per GPU]") == 3
    assert cli.main(["gpu-check", "--only", "moe", "nonsense"]) == 2
    assert "unknown check(s) nonsense" in capsys.readouterr().err


def test_the_table() -> None:
    MiB = gpu_check.MiB
    rows = [Row("moe", "11", True, 1.25, allocated=3 * MiB, reserved=4 * MiB, predicted=2 * MiB, free=1000 * MiB,
                note="k=1 dropped 1.0%"),
            Row("planner", "12", False, 0.0, note="RuntimeError: out of memory")]
    header = ("check   | chapters | result |   s | allocated MiB | reserved MiB | predicted MiB | alloc/pred | "
              "free MiB | note")
    assert gpu_check.format_table(rows).splitlines() == [
        header,
        "-" * len(header),
        "moe     | 11       |     ok | 1.2 |           3.0 |          4.0 |           2.0 |       1.50 |   1000.0 | "
        "k=1 dropped 1.0%",
        "planner | 12       | FAILED | 0.0 |             - |            - |             - |          - |        - | "
        "RuntimeError: out of memory"]


def test_a_failing_check_is_a_row_and_a_late_one_is_skipped() -> None:
    def broken(device: torch.device) -> Measured:
        raise RuntimeError("CUDA error: an illegal memory access\nmore lines")
    checks = (Check("broken", "00", "fails", broken), Check("fine", "00", "passes", lambda d: Measured(note="done")))
    rows = gpu_check.run_checks(torch.device("cpu"), checks)
    assert [(r.check, r.ok, r.note) for r in rows] == [
        ("broken", False, "RuntimeError: CUDA error: an illegal memory access"), ("fine", True, "done")]
    late = gpu_check.run_checks(torch.device("cpu"), checks, budget_s=-1.0)
    assert [(r.ok, r.note) for r in late] == [(False, "skipped: past -1 s")] * 2


@pytest.mark.parametrize("check", [c for c in gpu_check.CHECKS if not c.ranks], ids=lambda c: c.name)
def test_each_in_process_check_runs_on_the_cpu(check: Check) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # small matrices, a shared machine
    try:
        row = gpu_check.run_check(check, torch.device("cpu"))
    finally:
        torch.set_num_threads(before)
    assert row.ok, row.note
    assert row.allocated is None and row.reserved is None and row.free is None  # CUDA's statistics only
