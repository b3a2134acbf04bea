import json

import pytest
import torch

from course_lib import report


def test_record_appends_and_load_keeps_last(tmp_path, monkeypatch, capsys):
    path = tmp_path / "r.jsonl"
    monkeypatch.setenv("COURSE_RESULTS", str(path))
    assert report.record("ch01/x", torch.tensor(1.5)) == torch.tensor(1.5)
    report.record("ch01/y", [1, 2])
    report.record("ch01/x", 2.0)
    assert report.load(path) == {"ch01/x": 2.0, "ch01/y": [1, 2]}
    assert "recorded ch01/y = [1, 2]" in capsys.readouterr().out
    assert all(json.loads(line)["key"] for line in path.read_text().splitlines())


def test_record_key_needs_a_chapter(tmp_path, monkeypatch):
    monkeypatch.setenv("COURSE_RESULTS", str(tmp_path / "r.jsonl"))
    with pytest.raises(ValueError, match="ch03/name"):
        report.record("loss", 1.0)
