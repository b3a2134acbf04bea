"""The console script: bad input gets clear errors; the runner writes results and a report."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from course_lib import cli, runner

ROOT = Path(__file__).resolve().parent.parent


def test_unknown_notebook_is_a_clear_error(capsys):
    assert cli.main(["run", "--profile", "smoke", "99_nothing"]) == 2
    err = capsys.readouterr().err
    assert "no notebook matches '99_nothing'" in err and "00_start_here.ipynb" in err


def test_unknown_profile_is_rejected():
    proc = subprocess.run([sys.executable, "-m", "course_lib.cli", "run", "--profile", "laptop"],
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "invalid choice: 'laptop'" in proc.stderr


def test_doctor_reports_versions_and_datasets(capsys):
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "shapes dataset" in out and "CIFAR-10" in out


def test_find_notebooks_by_prefix():
    assert [p.name for p in runner.find_notebooks(["01"])] == ["01_memory_anatomy.ipynb"]


def _tiny_notebook(path: Path, code: str) -> Path:
    """A notebook with a parameters cell and one code cell."""
    import nbformat

    book = nbformat.v4.new_notebook()
    book.cells = [nbformat.v4.new_code_cell("PROFILE = None", metadata={"tags": ["parameters"]}),
                  nbformat.v4.new_code_cell(code)]
    book.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(book, path)
    return path


def test_runner_writes_results_and_report(tmp_path):
    nb = _tiny_notebook(tmp_path / "00_tiny.ipynb", "from course_lib.report import record\nrecord('ch99/profile', PROFILE)\n"
                        "import os\nrecord('ch99/omp', os.environ.get('OMP_NUM_THREADS'))")
    runs = []
    result = runner.execute(nb, "smoke", tmp_path / "out")
    runs.append(result)
    assert result["error"] is None
    assert result["results"]["ch99/profile"] == "smoke"  # papermill injected the profile
    if "OMP_NUM_THREADS" not in os.environ:
        assert result["results"]["ch99/omp"] == "1"  # smoke kernels run one intra-op thread
    runner.write_report(runs, "smoke", tmp_path / "out")
    assert json.loads((tmp_path / "out" / "results.json").read_text())["notebooks"]["00_tiny.ipynb"]["results"]
    assert "`ch99/profile`" in (tmp_path / "out" / "report.md").read_text()


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
    nb = _tiny_notebook(tmp_path / "nb" / "00_tiny.ipynb", "from course_lib.report import record\nrecord('ch99/x', 1)")
    monkeypatch.chdir(tmp_path)
    result = runner.execute(nb, "smoke", Path("out"))
    assert result["error"] is None and result["results"] == {"ch99/x": 1}
    assert (tmp_path / "out" / "results" / "00_tiny.jsonl").exists()
    assert not (tmp_path / "nb" / "out").exists()
