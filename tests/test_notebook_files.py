"""Stored notebooks: valid, without outputs, with a parameters cell, in learning order."""

import json
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
ALL = NOTEBOOKS + sorted((ROOT / "solutions").glob("*.ipynb")) + sorted((ROOT / "exercises").glob("*.ipynb"))


def test_there_are_notebooks():
    assert [nb.name[:2] for nb in NOTEBOOKS][:3] == ["00", "01", "02"]


@pytest.mark.parametrize("path", ALL, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_stored_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type != "code" or "NBVAL_CHECK_OUTPUT" in cell.source:
            continue
        assert not cell.outputs, f"{path.name}: a code cell is stored with outputs: {cell.source[:60]!r}"
        assert cell.execution_count is None


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_one_parameters_cell_with_profile(path):
    nb = json.loads(path.read_text())
    params = [c for c in nb["cells"] if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(params) == 1, f"{path.name} needs exactly one cell tagged 'parameters'"
    src = "".join(params[0]["source"])
    assert "PROFILE = None" in src and "SIZE_TABLE" in src
    for profile in ("smoke", "cpu", "gpu"):
        assert f'"{profile}"' in src, f"{path.name}: the size table has no {profile!r} entry"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_chapter_shape(path):
    text = path.read_text()
    assert "Experiment" in text, f"{path.name} has no Experiment section"
    assert "record(" in text, f"{path.name} records no claim"
