"""The learner's copy of the course (``course release DEST``): everything to follow it, nothing to grade it with.

It holds the lecture notebooks, ``course_lib``, the exercises (generated
afresh from the solutions, so never stale), the data card, a README for
learners and the learners' part of the exercises' README (``readme``), the
docs but the instructors' pages, the benchmarks and the install files. It
leaves out ``solutions/``, the tests and the grading benchmark (which read
the solutions) and anything built. Before it returns, it
reads every file it wrote for any line of any hidden test (lines the
exercises also show are public and allowed) and fails if it finds one. In
the copy, ``course check`` runs the visible tests from ``exercises/``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from course_lib.tools.grading import assign, readme
from course_lib.tools.grading.exercise import ROOT, Catalog, GradingError, split_test

INCLUDE = ["pyproject.toml", "environment.yml", "Makefile", ".gitignore", "notebooks", "course_lib",
           "data/README.md", "data/shapes_examples.jpg", "docs", "benchmarks"]
INSTRUCTORS = ["docs/grading.md", "docs/instructors.md", "docs/testing.md"]  # how to grade and test: the
# learners get the README's words, and no tests
# bench_grading grades the exercises with their solutions: an instructor's benchmark
SKIP = shutil.ignore_patterns("__pycache__", "*.pyc", ".ipynb_checkpoints", "build", "*.egg-info", "bench_grading.py")
MARKER = ".course-release"
SHORTEST = 10  # characters: a shorter line ("else:", "return m") says nothing about a test


def hidden_lines(catalog: Catalog) -> set[str]:
    """Every stripped line of every hidden test (``SHORTEST`` characters or more) that the generated
    exercises do not show anyway."""
    hidden: set[str] = set()
    public: set[str] = set()
    for ex in catalog.exercises.values():
        for q in ex.questions:
            _, part = split_test(q.test_source, ex.name)
            if part is not None:
                for section in (part.inputs, part.answers, part.checks):
                    hidden |= {line.strip() for line in section.source.splitlines() if len(line.strip()) >= SHORTEST}
    for text in assign.planned(catalog.folder, ROOT / "exercises").values():
        for cell in json.loads(text)["cells"]:
            public |= {line.strip() for line in "".join(cell["source"]).splitlines()}
    return hidden - public


def leaks(dest: Path, lines: set[str]) -> list[str]:
    """``file: line`` for every hidden line found in a file under ``dest``."""
    found = []
    for path in sorted(p for p in dest.rglob("*") if p.is_file()):
        text = path.read_bytes().decode("utf-8", errors="ignore")
        found += [f"{path.relative_to(dest)}: {line}" for line in sorted(lines) if line in text]
    return found


def write_release(dest: Path, solutions: Path | str | None = None, force: bool = False) -> dict:
    """Write the learner's copy into ``dest``; raise ``GradingError`` if it would hold a hidden test."""
    dest = Path(dest).resolve()
    copied = {Path(rel).parts[0] for rel in INCLUDE} | {"solutions", "tests", "exercises"}
    if dest == ROOT or dest in ROOT.parents or (ROOT in dest.parents and dest.parts[len(ROOT.parts)] in copied):
        raise GradingError(f"{dest} is the course's own folder, or inside what a release copies: choose another")
    if dest.exists() and any(dest.iterdir()):
        if not (force and (dest / MARKER).exists()):
            raise GradingError(f"{dest} is not empty; choose a new folder"
                               + (" (--force replaces only an earlier release)" if force else ""))
        shutil.rmtree(dest)
    catalog = Catalog(solutions)
    dest.mkdir(parents=True, exist_ok=True)
    for rel in INCLUDE:
        src = ROOT / rel
        if src.is_dir():
            shutil.copytree(src, dest / rel, ignore=SKIP)
        elif src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    for rel in INSTRUCTORS:
        (dest / rel).unlink(missing_ok=True)
    (dest / "README.md").write_text(readme.learner_readme(ROOT, catalog), encoding="utf-8")
    (dest / "exercises").mkdir(exist_ok=True)
    (dest / "exercises" / "README.md").write_text(
        readme.learners_part((ROOT / "exercises" / "README.md").read_text(encoding="utf-8")), encoding="utf-8")
    for path, text in assign.planned(catalog.folder, dest / "exercises").items():
        path.write_text(text, encoding="utf-8")
    lines = hidden_lines(catalog)
    found = leaks(dest, lines)
    if found:
        raise GradingError(f"the release in {dest} would hold hidden tests; fix these before handing it out:\n  "
                           + "\n  ".join(found[:20]))
    (dest / MARKER).write_text(json.dumps({"exercises": sorted(catalog.exercises)}) + "\n")
    files = sum(1 for p in dest.rglob("*") if p.is_file())
    return {"dest": dest, "files": files, "checked_lines": len(lines)}
