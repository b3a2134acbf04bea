import json
import sys

import pytest
import torch

from course_lib.tools import report


def test_record_appends_and_load_keeps_last(tmp_path, monkeypatch, capsys):
    path = tmp_path / "r.jsonl"
    monkeypatch.setenv("COURSE_RESULTS", str(path))
    assert report.record("ch01/x", torch.tensor(1.5)) is None  # nothing for Jupyter to echo again
    report.record("ch01/y", [1, 2])
    report.record("ch01/x", 2.0)
    assert report.load(path) == {"ch01/x": 2.0, "ch01/y": [1, 2]}
    assert "recorded ch01/y = [1, 2]" in capsys.readouterr().out
    assert all(json.loads(line)["key"] for line in path.read_text().splitlines())


def test_record_key_needs_a_chapter(tmp_path, monkeypatch):
    monkeypatch.setenv("COURSE_RESULTS", str(tmp_path / "r.jsonl"))
    with pytest.raises(ValueError, match="ch03/name"):
        report.record("loss", 1.0)


def test_record_as_a_cells_last_line_is_printed_once(tmp_path, monkeypatch, capsys):
    # Jupyter runs a cell's last expression in "single" mode and echoes its value through sys.displayhook,
    # which skips None: record's line is the only trace of the claim.
    monkeypatch.setenv("COURSE_RESULTS", str(tmp_path / "r.jsonl"))
    shown: list = []
    monkeypatch.setattr(sys, "displayhook", lambda v: v is not None and shown.append(v))
    exec(compile("record('ch01/a', 1.5)", "<cell>", "single"), {"record": report.record})
    assert shown == []
    assert capsys.readouterr().out.splitlines() == ["recorded ch01/a = 1.5"]
    assert report.load(tmp_path / "r.jsonl") == {"ch01/a": 1.5}
