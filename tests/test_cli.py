"""The console script: bad input gets clear errors; the runner writes results and a report."""

import argparse
import json
import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import io

import nbformat
import pytest
import torch

from course_lib import env, kernels
from course_lib.tools import cli, runner

ROOT = Path(__file__).resolve().parent.parent


def test_unknown_notebook_is_a_clear_error(capsys):
    assert cli.main(["run", "--profile", "smoke", "99_nothing"]) == 2
    err = capsys.readouterr().err
    assert "no notebook matches '99_nothing'" in err and "00_start_here.ipynb" in err


def test_unknown_profile_is_rejected():
    proc = subprocess.run([sys.executable, "-m", "course_lib.tools.cli", "run", "--profile", "laptop"],
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "invalid choice: 'laptop'" in proc.stderr


def test_doctor_reports_versions_and_datasets(capsys):
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "shapes dataset" in out and "CIFAR-10" in out
    assert f"cpu: {torch.backends.cpu.get_cpu_capability()}, a bf16 matmul takes" in out  # and what it means
    assert ("emulated" if env.cpu_speed().bf16_is_slow else "natively") in out
    for k, what in kernels.KERNELS.items():  # every kernel's verdict, with what was measured
        assert f"kernel {k}: {kernels.probe(k).verdict} (" in out and what in out


def test_find_notebooks_by_prefix():
    assert [p.name for p in runner.find_notebooks(["01"])] == ["01_memory_anatomy.ipynb"]


def _tiny_notebook(path: Path, code: str, *more: str) -> Path:
    """A notebook with a parameters cell and code cells."""
    book = nbformat.v4.new_notebook()
    book.cells = [nbformat.v4.new_code_cell("PROFILE = None", metadata={"tags": ["parameters"]}),
                  *(nbformat.v4.new_code_cell(c) for c in (code, *more))]
    book.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(book, path)
    return path


def test_runner_writes_results_and_report(tmp_path, monkeypatch, capfd):
    nb = _tiny_notebook(tmp_path / "00_tiny.ipynb", "import time\ntime.sleep(1.5)",
                        "from course_lib.tools.report import record\nrecord('ch99/profile', PROFILE)\n"
                        "import os\nrecord('ch99/omp', os.environ.get('OMP_NUM_THREADS'))")
    monkeypatch.setattr(runner, "LOG_EVERY_S", 0.5)  # a progress line at least every half second
    log = io.StringIO()  # not a terminal: whole lines, as in a CI log
    result = runner.execute(nb, "smoke", tmp_path / "out", progress=log)
    assert result["error"] is None
    assert result["results"]["ch99/profile"] == "smoke"  # papermill injected the profile
    if "OMP_NUM_THREADS" not in os.environ:
        assert result["results"]["ch99/omp"] == "1"  # smoke kernels run one intra-op thread
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue() and lines, log.getvalue()
    assert any("[course] 00_tiny: cell 3/4, " in line and "this cell running for" in line for line in lines)
    assert "without encryption" not in capfd.readouterr().err  # the kernel's connection is encrypted
    # the cell ending in record(...) shows its printed line once, and no echoed value after it
    cell = nbformat.read(tmp_path / "out" / "notebooks" / "00_tiny.ipynb", as_version=4).cells[-1]
    assert [o["output_type"] for o in cell.outputs] == ["stream"], cell.outputs
    runner.write_report([result], "smoke", tmp_path / "out")
    assert json.loads((tmp_path / "out" / "results.json").read_text())["notebooks"]["00_tiny.ipynb"]["results"]
    assert "`ch99/profile`" in (tmp_path / "out" / "report.md").read_text()


def test_progress_line_on_a_terminal():
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    screen = Terminal()
    line = runner.CellProgress("04_normalization", screen)
    line.notebook_start(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1"),
                                                        nbformat.v4.new_markdown_cell("text"),
                                                        nbformat.v4.new_code_cell("2")]))
    line.cell_execute()
    line.cell_executed()
    line.cell_execute()
    line.close()
    out = screen.getvalue()
    assert "\n" not in out  # one line, redrawn in place
    assert "\r[course] 04_normalization: cell 1/2, 0 s\x1b[K" in out and "cell 2/2" in out
    assert out.endswith("\r\x1b[K")  # cleared for the summary line


def test_summary_and_durations():
    runs = [{"notebook": "00_start_here.ipynb", "seconds": 9.6, "cpu_seconds": 8.0, "error": None},
            {"notebook": "04_normalization.ipynb", "seconds": 190.0, "cpu_seconds": 320.0, "error": "boom"}]
    text = runner.summary(runs, "cpu")
    lines = text.splitlines()
    cpu = env.cpu_speed()
    assert lines[0] == (f"[course] 2 notebook(s) at profile cpu in 3 min 20 s (5 min 28 s of CPU time) on a "
                        f"{cpu.capability} CPU ({kernels.probe('bf16').short()}, {kernels.probe('fp8').short()}), "
                        "1 FAILED:")
    assert lines[1].split() == ["[course]", "notebook", "time", "CPU", "time", "status"]
    assert lines[2].split()[1:] == ["00_start_here", "10", "s", "8", "s", "ok"]
    # over the 3-minute budget at cpu, and said so; not at smoke, whose budget this is not
    assert lines[3].endswith("3 min 10 s    5 min 20 s  FAILED (over the 3 min 00 s budget)")
    assert "budget" not in runner.summary(runs, "smoke")


def test_run_names_the_cpu_and_its_kernels():
    cpu = env.cpu_speed()
    first, second = runner.cpu_note().splitlines()
    assert first == f"[course] CPU: {cpu.summary()}"
    for k in kernels.KERNELS:  # each kernel's verdict and ratio (or error, or that it was forced)
        assert kernels.probe(k).short() in second
    table = runner.summary([{"notebook": "05_x.ipynb", "seconds": 200.0, "cpu_seconds": 190.0, "error": None,
                             "results": {}}], "cpu")
    assert f"on a {cpu.capability} CPU ({kernels.probe('bf16').short()}" in table
    assert "(over the 3 min 00 s budget)" in table  # env.BUDGET_S["cpu"]


def test_processes_note_says_cores_and_processes(monkeypatch):
    monkeypatch.setenv("COURSE_PROCESSES", "3")
    note = runner.processes_note("cpu")
    assert f"{runner.parallel_runs.cores()} CPU core(s)" in note and "one at a time" in note
    if runner.parallel_runs.can_fork():
        assert "go 3 at a time" in note
    assert [runner.duration(s) for s in (0.4, 59.6, 61, 3600 + 125)] == ["0 s", "1 min 00 s", "1 min 01 s", "1 h 02 min"]


def test_gpu_profile_without_cuda_stops_course_run_and_the_notebook(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["run", "--profile", "gpu", "00"]) == 2  # before any kernel starts
    assert "needs a CUDA GPU" in capsys.readouterr().err
    monkeypatch.undo()
    # PROFILE = "gpu" in a notebook: the kernel sees the real hardware
    nb = _tiny_notebook(tmp_path / "00_gpu.ipynb", "from course_lib import env\nenv.pick_profile(PROFILE)")
    result = runner.execute(nb, "gpu", tmp_path / "out")
    if torch.cuda.is_available():
        assert result["error"] is None
    else:
        assert "needs a CUDA GPU" in result["error"] and "Choose 'cpu'" in result["error"]


def test_download_without_a_network_says_what_failed_and_the_offline_way(tmp_path, monkeypatch, capsys):
    from course_lib import data

    def no_network(url, timeout=None):
        raise urllib.error.URLError(socket.gaierror(-3, "Temporary failure in name resolution"))

    monkeypatch.setattr(urllib.request, "urlopen", no_network)
    monkeypatch.setattr(data, "DATA_ROOT", tmp_path)
    assert cli.main(["download", "cifar10"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, f"one line, not a traceback:\n{err}"
    assert "could not reach the download host www.cs.toronto.edu: [Errno -3] Temporary failure" in err
    assert f"copy torchvision's cifar-10-batches-py folder (from a machine that has it) into {tmp_path}" in err
    assert "course doctor" in err and list(tmp_path.iterdir()) == []  # no partial download left behind


def test_lab_command(monkeypatch):
    for uid, as_root in ((0, True), (1000, False)):
        monkeypatch.setattr(os, "geteuid", lambda uid=uid: uid, raising=False)
        argv = cli.lab_argv(ROOT, ["--port", "8899"])
        assert argv[1:3] == ["-m", "jupyterlab"] and f"--ServerApp.root_dir={ROOT}" in argv
        assert "--KernelManager.transport_encryption=auto" in argv and argv[-2:] == ["--port", "8899"]
        assert ("--allow-root" in argv) == as_root  # Jupyter refuses to start as root without it


@pytest.mark.parametrize("args, jupyter_args", [
    (["--port", "8890", "--no-browser", "--ip", "0.0.0.0"], ["--port", "8890", "--no-browser", "--ip", "0.0.0.0"]),
    (["--", "--no-browser", "--port", "8893"], ["--no-browser", "--port", "8893"]),  # the `--` is not Jupyter's
    (["--port=8894"], ["--port=8894"]),
    ([], []),
])
def test_lab_passes_its_arguments_to_jupyter(monkeypatch, capsys, args, jupyter_args):
    ran = []
    monkeypatch.setattr(os, "execv", lambda path, argv: ran.append(argv))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert cli.main(["lab", *args]) == 0
    # chapter 11's kernels see a compile cache keyed by this CPU and its ISA settings
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(kernels.inductor_cache_dir())
    assert ran[0][:3] == [sys.executable, "-m", "jupyterlab"] and "--" not in ran[0]
    assert ran[0][len(ran[0]) - len(jupyter_args):] == jupyter_args
    assert " ".join(jupyter_args) in capsys.readouterr().out  # the command is shown before Jupyter starts


def test_lab_help_is_the_course_s(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["lab", "--help"])
    assert exit_.value.code == 0 and "Start JupyterLab on the course folder" in capsys.readouterr().out


def test_runner_reports_a_failing_notebook(tmp_path):
    nb = _tiny_notebook(tmp_path / "00_broken.ipynb", "raise RuntimeError('boom')")
    result = runner.execute(nb, "smoke", tmp_path / "out")
    assert result["error"] and "boom" in result["error"]
    with pytest.raises(ValueError):
        runner.execute(nb, "huge", tmp_path / "out")


def test_runner_stops_a_hung_cell(tmp_path):
    nb = _tiny_notebook(tmp_path / "00_hung.ipynb", "import time\ntime.sleep(600)")
    result = runner.execute(nb, "smoke", tmp_path / "out", timeout=3)
    assert result["error"] and "timed out" in result["error"]
    assert result["seconds"] < 120
    # the long cpu experiments get hours, smoke (CI) minutes
    assert runner.CELL_TIMEOUT["smoke"] < runner.CELL_TIMEOUT["gpu"] < runner.CELL_TIMEOUT["cpu"]


def test_runner_resolves_a_relative_output_folder(tmp_path, monkeypatch):
    # `course run` defaults to --out build: the claims and figures must land there, not under the
    # notebook's folder, where the kernel runs
    (tmp_path / "nb").mkdir()
    nb = _tiny_notebook(tmp_path / "nb" / "00_tiny.ipynb", "from course_lib.tools.report import record\nrecord('ch99/x', 1)")
    monkeypatch.chdir(tmp_path)
    result = runner.execute(nb, "smoke", Path("out"))
    assert result["error"] is None and result["results"] == {"ch99/x": 1}
    assert 0 < result["cpu_seconds"] < 10 * result["seconds"]  # the kernel's own CPU time (it starts Python)
    assert (tmp_path / "out" / "results" / "00_tiny.jsonl").exists()
    assert not (tmp_path / "nb" / "out").exists()


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_every_option_of_every_command_says_what_it_takes():
    """`course X --help` explains each option: a help text; for a value, its default; for a number, its unit."""
    commands = _subcommands()
    assert {"run", "check", "grade", "release", "assign", "lab"} <= set(commands)
    for name, parser in commands.items():
        assert parser.description, f"`course {name} --help` has no description"
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            flag = "/".join(action.option_strings) or action.dest
            text = (action.help or "") % {"default": action.default}
            assert len(text) > 10, f"`course {name}` {flag} has no help text"
            takes_value = action.option_strings and action.nargs != 0
            if takes_value and action.default is not None or action.type in (int, float):
                assert "default" in text, f"`course {name}` {flag}: say its default in the help"
            if action.type in (int, float):  # a number: in what?
                assert any(unit in text for unit in ("seconds", "number of")), \
                    f"`course {name}` {flag}: say the unit of the number ({text!r})"


def test_help_of_check_names_the_unit_and_the_default(capsys):
    with pytest.raises(SystemExit):
        cli.main(["check", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--timeout SECONDS" in out and "(default: 60)" in out and "exercises/01_memory_anatomy.ipynb" in out


@pytest.mark.parametrize("command", ["check", "grade"])
@pytest.mark.parametrize("typed, suggestion", [
    ("exercises/99_x.ipynb", None),
    ("exercise/03_gradient_accumulation.ipynb", "03_gradient_accumulation.ipynb"),  # the folder's name mistyped
    ("exercises/10_tensor_paralel.ipynb", "10_tensor_parallel.ipynb"),
    ("exercises/04", "04_normalization.ipynb"),
])
def test_a_missing_notebook_says_what_is_wrong_and_lists_the_exercises(command, typed, suggestion, capsys,
                                                                          monkeypatch):
    monkeypatch.chdir(ROOT)
    assert cli.main([command, typed]) == 2
    err = capsys.readouterr().err
    assert f"course {command}: {typed} does not exist" in err, err
    assert f"The exercises are in exercises{os.sep}:" in err
    for path in sorted((ROOT / "exercises").glob("*.ipynb")):
        assert f"  {path.name}\n" in err, f"{path.name} not listed:\n{err}"
    assert ("Did you mean" in err) == (suggestion is not None), err
    if suggestion:
        assert f"Did you mean {os.path.join('exercises', suggestion)}?" in err
    assert "Traceback" not in err


def test_check_of_a_folder_says_it_takes_a_notebook(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert cli.main(["check", "exercises"]) == 2
    err = capsys.readouterr().err
    assert "exercises is a folder" in err and "takes a notebook file" in err and "01_memory_anatomy.ipynb" in err
