"""The docstring of each teaching package of ``course_lib`` is its map: it names every module in the package.

A reader opens ``course_lib/__init__.py`` first to find which module a chapter uses; a module added without a
line there is a room with no door. (``tools`` runs the course and ``experiments/workers`` are entry points: not maps.)
"""

from __future__ import annotations

import ast
import pkgutil
from pathlib import Path

import pytest

LIB = Path(__file__).resolve().parent.parent / "course_lib"
MAPS = ("", "parallel", "parallel/data_parallel", "parallel/pipeline", "parallel/sharding", "parallel/tensor_parallel",
        "parallel/context_parallel", "parallel/expert_parallel", "experiments", "planner")  # relative to course_lib


def unnamed_modules(folder: Path) -> list[str]:
    """The modules and subpackages in ``folder`` whose name the package docstring does not write as ``name``."""
    doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text())) or ""
    names = [m.name for m in pkgutil.iter_modules([str(folder)])]
    return [n for n in names if f"``{n}``" not in doc and f"``{n}/``" not in doc]


@pytest.mark.parametrize("package", MAPS, ids=lambda p: p or "course_lib")
def test_the_package_docstring_names_every_module(package: str) -> None:
    init = (LIB / package / "__init__.py").relative_to(LIB.parent)
    missing = unnamed_modules(LIB / package)
    assert not missing, f"{init}'s docstring should say what these modules are for: {missing}"


def test_the_check_finds_a_module_left_out(tmp_path: Path) -> None:
    (tmp_path / "__init__.py").write_text('"""- ``kept``: named here."""\n')
    for name in ("kept", "forgotten"):
        (tmp_path / f"{name}.py").write_text("")
    assert unnamed_modules(tmp_path) == ["forgotten"]
