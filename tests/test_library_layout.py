"""The library keeps what the chapters teach apart from the experiments that measure it (DESIGN.md section 4a).

- No teaching module imports the harness (``course_lib.experiments``) or the tooling (``course_lib.tools``):
  a learner who opens a teaching file never has to follow an import into code that only measures.
- Each teaching file reads in one sitting: at most ``MAX_LINES`` lines and a module docstring of at most
  ``MAX_DOC_LINES`` lines, in ``course_lib/parallel/`` and outside it (``experiments``, ``tools`` and the
  package ``__init__`` maps aside).
- The parallel teaching code as a whole stays about the size a learner can read in a few evenings.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

LIB = Path(__file__).resolve().parent.parent / "course_lib"
NOT_TAUGHT = ("experiments", "tools")  # folders of course_lib that are not teaching code
MAX_LINES = 310          # "about 300"
MAX_DOC_LINES = 16       # "about 15"
# The whole of course_lib/parallel/: 3.3k lines, of which the opt-in robustness layers (sharding/agreement,
# data_parallel/ddp_dynamic) are about 230; the bound keeps it from growing back toward the 5k it once was.
MAX_PARALLEL_LINES = 3_350


def teaching_files(root: Path = LIB) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if p.relative_to(root).parts[0] not in NOT_TAUGHT)


def harness_imports(path: Path, root: Path = LIB) -> list[str]:
    """The modules of ``experiments`` or ``tools`` that ``path`` imports (at any depth of its code)."""
    pkg = root.name
    banned = tuple(f"{pkg}.{n}" for n in NOT_TAUGHT)
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        found += [n for n in names if n == banned[0] or n == banned[1] or n.startswith(tuple(b + "." for b in banned))]
    return found


def doc_lines(path: Path) -> int:
    doc = ast.get_docstring(ast.parse(path.read_text()), clean=False) or ""
    return len(doc.strip().splitlines())


@pytest.mark.parametrize("path", teaching_files(), ids=lambda p: str(p.relative_to(LIB)))
def test_no_teaching_module_imports_the_harness_or_the_tooling(path: Path) -> None:
    bad = harness_imports(path)
    assert not bad, (f"course_lib/{path.relative_to(LIB)} is teaching code but imports {sorted(set(bad))}: "
                     "move what it needs from the harness into it, or move the measuring part to experiments/")


PARALLEL = sorted((LIB / "parallel").rglob("*.py"))
# Every other teaching module too (the single-process chapters, the planner); package __init__ files outside
# parallel/ are maps, not lessons.
SINGLE = sorted(p for p in teaching_files() if p.relative_to(LIB).parts[0] != "parallel" and p.name != "__init__.py")


@pytest.mark.parametrize("path", PARALLEL + SINGLE, ids=lambda p: str(p.relative_to(LIB)))
def test_each_teaching_file_reads_in_one_sitting(path: Path) -> None:
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"course_lib/{path.relative_to(LIB)} has {lines} lines (at most about 300)"
    assert doc_lines(path) <= MAX_DOC_LINES, (
        f"course_lib/{path.relative_to(LIB)}'s module docstring has {doc_lines(path)} lines (at most about 15)")


def test_the_parallel_teaching_code_is_near_3k_lines() -> None:
    total = sum(len(p.read_text().splitlines()) for p in PARALLEL)
    assert total <= MAX_PARALLEL_LINES, f"course_lib/parallel/ holds {total} lines; keep it near 3,000"


def test_the_import_check_finds_a_harness_import(tmp_path: Path) -> None:
    lib = tmp_path / "course_lib"
    (lib / "parallel").mkdir(parents=True)
    (lib / "experiments").mkdir()
    (lib / "parallel" / "good.py").write_text("from course_lib.parallel import collectives\n")
    (lib / "parallel" / "bad.py").write_text("def f():\n    from course_lib.experiments.clock import Clock\n")
    (lib / "experiments" / "free.py").write_text("import course_lib.tools.report\n")
    assert [p.name for p in teaching_files(lib)] == ["bad.py", "good.py"]
    assert harness_imports(lib / "parallel" / "bad.py", lib) == ["course_lib.experiments.clock",
                                                                 "course_lib.experiments.clock.Clock"]
    assert harness_imports(lib / "parallel" / "good.py", lib) == []
