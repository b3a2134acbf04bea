import pytest
import torch

from course_lib import env


def test_pick_profile_from_argument_env_and_hardware(monkeypatch):
    monkeypatch.delenv("COURSE_PROFILE", raising=False)
    assert env.pick_profile() == ("gpu" if torch.cuda.is_available() else "cpu")
    monkeypatch.setenv("COURSE_PROFILE", "smoke")
    assert env.pick_profile() == "smoke"
    assert env.pick_profile("cpu") == "cpu"  # an explicit choice wins over the variable


def test_a_profile_typed_in_another_case_or_with_spaces_is_forgiven(monkeypatch):
    assert env.check_profile("CPU") == env.check_profile(" cpu ") == env.check_profile("Cpu\t") == "cpu"
    assert env.check_profile(" SMOKE ") == "smoke" and env.check_profile("gpu") == "gpu"
    assert env.pick_profile(" Cpu ") == "cpu"
    monkeypatch.setenv("COURSE_PROFILE", "SMOKE ")
    assert env.pick_profile() == "smoke"
    # and where a notebook passes the name on as typed: its size table and its budget line
    assert env.sizes(" CPU", {"cpu": 1, "smoke": 2}) == 1
    assert env.budget_line("CPU ", "04") == env.budget_line("cpu", "04")


def test_unknown_profile_is_a_clear_error(monkeypatch):
    with pytest.raises(ValueError, match="unknown profile 'laptop'.*smoke, cpu, gpu"):
        env.pick_profile("laptop")
    with pytest.raises(ValueError) as err:
        env.check_profile("cpuu")
    assert str(err.value) == ("unknown profile 'cpuu': choose one of smoke, cpu, gpu (edit PROFILE in the notebook's "
                              "parameters cell, set COURSE_PROFILE, or pass --profile)")
    with pytest.raises(ValueError, match=r"a profile is a name such as 'cpu', not int 1: .*parameters cell"):
        env.check_profile(1)
    monkeypatch.setenv("COURSE_PROFILE", "huge")
    with pytest.raises(ValueError, match="COURSE_PROFILE"):
        env.pick_profile()


def test_sizes_lookup():
    table = {"smoke": 1, "cpu": 2, "gpu": 3}
    assert env.sizes("cpu", table) == 2
    with pytest.raises(KeyError, match="no entry for profile 'gpu'"):
        env.sizes("gpu", {"smoke": 1, "cpu": 2})


def test_seed_everything_reproduces():
    env.seed_everything(3)
    a = torch.randn(5)
    env.seed_everything(3)
    assert torch.equal(a, torch.randn(5))
    env.seed_everything(4)
    assert not torch.equal(a, torch.randn(5))


def test_small_profiles_stay_on_cpu():
    assert env.pick_device("smoke").type == "cpu"
    assert env.pick_device("cpu").type == "cpu"


def test_gpu_profile_without_cuda_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("COURSE_PROFILE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert env.pick_profile() == "cpu"  # nothing asked: the CPU's profile
    with pytest.raises(ValueError, match=r"profile 'gpu' \(asked for\) needs a CUDA GPU.*Choose 'cpu'"):
        env.pick_profile("gpu")
    monkeypatch.setenv("COURSE_PROFILE", "gpu")
    with pytest.raises(ValueError, match=r"set by COURSE_PROFILE.*hours"):
        env.pick_profile()
    assert env.pick_profile("cpu") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert env.pick_profile() == "gpu"


def test_time_s_on_the_cpu():
    import time

    assert 0.05 <= env.time_s(lambda: time.sleep(0.05), "cpu") < 5


def test_progress_bars_follow_course_progress(monkeypatch):
    monkeypatch.setenv("COURSE_PROGRESS", "0")
    bar = env.progress(range(3), "steps")
    assert bar.disable and list(bar) == [0, 1, 2]
    monkeypatch.setenv("COURSE_PROGRESS", "1")
    assert env.show_progress() and not env.progress(range(3), "steps").disable


def test_cpu_speed_measures_this_cpu():
    cpu = env.cpu_speed()
    assert cpu.capability == torch.backends.cpu.get_cpu_capability()
    assert cpu.bf16_over_fp32 > 0
    assert cpu.capability in cpu.summary() and "bf16" in cpu.summary()
    assert env.bf16_is_slow("cpu") == cpu.bf16_is_slow
    assert env.bf16_is_slow("cuda") is False  # a GPU's bf16 is never the CPU's emulation


def test_cpu_speed_reads_its_ratio():
    assert env.CpuSpeed("AVX2", 37.0).bf16_is_slow and "emulated" in env.CpuSpeed("AVX2", 37.0).summary()
    fast = env.CpuSpeed("AVX512", 0.3)
    assert not fast.bf16_is_slow and "natively" in fast.summary() and "0.30 of fp32's time" in fast.summary()


def test_cpu_speed_finds_emulated_bf16():
    """With oneDNN held to AVX2 (no bf16 instructions) a bf16 product is emulated on any x86 CPU: the measurement
    must say so. On other CPUs the variables mean nothing, and the ratio is whatever they run."""
    import platform
    import subprocess
    import sys

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("ATEN_CPU_CAPABILITY and ONEDNN_MAX_CPU_ISA choose x86 kernels only")
    code = "from course_lib import env; c = env.cpu_speed(); print(c.capability, c.bf16_over_fp32, c.bf16_is_slow)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120,
                         env={**__import__("os").environ, "ATEN_CPU_CAPABILITY": "avx2",
                              "ONEDNN_MAX_CPU_ISA": "AVX2"}).stdout.split()
    assert out[0] == "AVX2" and out[2] == "True", out
    assert float(out[1]) > 2 * env.BF16_SLOW_RATIO  # measured 20-60: far from the threshold


def test_budgets_are_stated_once():
    """Every 'N minutes a notebook' and 'N for the course' in the README, the notebooks and the library is
    env.BUDGET_S's figure for cpu (the budgets were once said three ways, 3, 5 and 30 minutes)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    one, whole = (int(s / 60) for s in env.BUDGET_S["cpu"])
    files = [root / "README.md", *sorted((root / "docs").glob("*.md")), *sorted((root / "notebooks").glob("*.ipynb")),
             *sorted((root / "course_lib").rglob("*.py")), *sorted((root / "benchmarks").glob("*.py"))]
    per_notebook = re.compile(r"(\d+)[ -]minutes? (?:per|a) notebook|(\w+) minutes (?:per|a) notebook")
    per_course = re.compile(r"(\d+) (?:minutes )?for (?:`make course`|the (?:whole )?course)(?! on one)")  # not gpu
    words = {"three": 3, "five": 5}
    wrong = []
    for path in files:
        text = path.read_text()
        for m in per_notebook.finditer(text):
            n = int(m[1]) if m[1] else words.get(m[2].lower())
            if n is not None and n != one:
                wrong.append(f"{path.name}: {m[0]!r}")
        wrong += [f"{path.name}: {m[0]!r}" for m in per_course.finditer(text) if int(m[1]) != whole]
    assert not wrong, f"budgets other than env.BUDGET_S's {one} and {whole} minutes: {wrong}"


def _seconds(text: str) -> int:
    """'2 min 46 s' or '14 s' -> seconds (the inverse of env.duration below an hour)."""
    import re

    m = re.fullmatch(r"(?:(\d+) min )?(\d+) s", text.strip())
    assert m, f"not a duration: {text!r}"
    return int(m[1] or 0) * 60 + int(m[2])


def test_readme_times_are_env_measured_times():
    """docs/running.md's cpu table states env.MEASURED_CPU_S, the figures each notebook's first cell prints."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "docs" / "running.md").read_text()
    rows = {line.split("|")[1].strip()[:2]: [c.strip() for c in line.split("|")[2:6]]
            for line in readme.splitlines() if line.startswith("| ") and line[2:4].isdigit() and " s |" in line}
    assert set(rows) == set(env.MEASURED_CPU_S), sorted(rows)
    for nb, cells in rows.items():
        got = {"AVX512": (_seconds(cells[0]), _seconds(cells[1])), "AVX2": (_seconds(cells[2]), _seconds(cells[3]))}
        assert got == env.MEASURED_CPU_S[nb], (nb, got)
    assert env.MEASURED_MACHINE.removeprefix("a ") in readme


def test_budget_line_names_the_budget_the_measured_times_and_this_cpu():
    import torch

    line = env.budget_line("cpu", "04")
    wall = env.MEASURED_CPU_S["04"]
    assert "budget 3 min 00 s for this notebook (20 min 00 s for the course)" in line
    assert all(env.duration(w) in line for w, _ in wall.values()) and "AVX-512" in line and "AVX2" in line
    assert torch.backends.cpu.get_cpu_capability() in line
    assert "measured" not in env.budget_line("smoke", "04")
    with pytest.raises(ValueError, match="unknown profile"):
        env.budget_line("laptop", "04")
