"""Make the learner's exercise notebooks from the instructor's solutions (``course assign``).

nbgrader's own preprocessors do the work, so a notebook we generate is what
``nbgrader generate_assignment`` would make from the same file:
``ClearSolutions`` swaps each solution region for a stub, ``ClearHiddenTests``
drops the hidden tests, ``ClearOutput`` the outputs and ``LockCells`` makes
test cells read-only in Jupyter. The one thing nbgrader cannot do is put a
different message in each stub (its stub is one string per language), so the
stub carries a placeholder that we replace with the region's ``# HINT:``.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import nbformat
from nbformat import NotebookNode

from course_lib.tools.grading.exercise import (
    EXERCISES, META_KEY, GradingError, hints, parse_exercise, read_notebook, solutions_dir,
)
_PLACEHOLDER = "@@HINT@@"
GENERIC_HINT = "Write your solution here, then run the test cell below."


def _preprocessors() -> list:
    # Imported here: nbgrader takes over a second to import and grading does not need it.
    from nbgrader.preprocessors import ClearHiddenTests, ClearOutput, ClearSolutions, LockCells
    from traitlets.config import Config

    cfg = Config()
    cfg.ClearSolutions.code_stub = {"python": f"# YOUR CODE HERE\nraise NotImplementedError({_PLACEHOLDER})"}
    return [ClearSolutions(config=cfg), ClearHiddenTests(), ClearOutput(), LockCells()]


def make_exercise(solution: NotebookNode, name: str) -> NotebookNode:
    """The learner's copy of a solutions notebook: stubs with hints, no hidden tests, no outputs."""
    nb = copy.deepcopy(solution)
    # Read the hints before ClearSolutions removes the regions that hold them.
    cell_hints = [hints(c.source) if c.cell_type == "code" else [] for c in nb.cells]
    resources: dict = {}
    try:
        for pre in _preprocessors():
            nb, resources = pre.preprocess(nb, resources)
    except RuntimeError as exc:  # nbgrader reports convention errors as RuntimeError
        raise GradingError(f"solutions/{name}.ipynb: {exc}") from None
    for cell, found in zip(nb.cells, cell_hints):
        for hint in found:
            # json.dumps writes a valid Python string literal for any sentence
            cell.source = cell.source.replace(_PLACEHOLDER, json.dumps(hint or GENERIC_HINT, ensure_ascii=False), 1)
        # a solution cell without a region is replaced whole by nbgrader: it gets the generic message
        cell.source = cell.source.replace(_PLACEHOLDER, json.dumps(GENERIC_HINT)).rstrip("\n")
    nb.metadata[META_KEY] = {"exercise": name}
    return nb


def render(nb: NotebookNode) -> str:
    """The exact text ``nbformat.write`` puts in the file (so the check compares like with like)."""
    text = nbformat.writes(nb)
    return text if text.endswith("\n") else text + "\n"


def planned(source_dir: Path | None = None, out_dir: Path | None = None) -> dict[Path, str]:
    """Every exercise file to write, with its text, generated from ``solutions/*.ipynb``."""
    src, out = solutions_dir(source_dir), Path(out_dir or EXERCISES)
    files: dict[Path, str] = {}
    for path in sorted(src.glob("*.ipynb")):
        solution = read_notebook(path)
        parse_exercise(solution, path)  # the convention holds, else a clear error now rather than at grading
        files[out / path.name] = render(make_exercise(solution, path.stem))
    return files


def _orphans(out: Path, files: dict[Path, str]) -> list[Path]:
    """Generated exercises whose solution is gone (renamed or deleted)."""
    found = []
    for path in sorted(out.glob("*.ipynb")):
        if path in files:
            continue
        try:
            if META_KEY in read_notebook(path).metadata:
                found.append(path)
        except (GradingError, OSError):
            continue
    return found


def stale(source_dir: Path | None = None, out_dir: Path | None = None) -> list[str]:
    """What ``assign`` would change: missing or different files, and orphans it would delete."""
    out = Path(out_dir or EXERCISES)
    files = planned(source_dir, out)
    changed = [f"{p.name} (out of date)" if p.exists() else f"{p.name} (missing)"
               for p, text in files.items() if not p.exists() or p.read_text(encoding="utf-8") != text]
    return changed + [f"{p.name} (no solution; would be deleted)" for p in _orphans(out, files)]


def write_exercises(source_dir: Path | None = None, out_dir: Path | None = None) -> list[Path]:
    """Regenerate every exercise notebook; return the files written or deleted."""
    out = Path(out_dir or EXERCISES)
    out.mkdir(parents=True, exist_ok=True)
    files = planned(source_dir, out)
    touched = []
    for path, text in files.items():
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
            touched.append(path)
    for path in _orphans(out, files):
        path.unlink()
        touched.append(path)
    return touched
