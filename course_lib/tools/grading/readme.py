"""What the learner's copy of the course (``course release``) says to learners: how to study and check.

Its ``README.md`` is written here, not copied from the course's own, which is
the instructor's (the solutions, grading, the sandbox): the chapters are read
from the notebooks' first headings, the exercises' chapters and question
counts from the exercises. Its ``exercises/README.md`` keeps only the
learners' sections of the course's (the preamble, and the sections whose
heading ends in ``(learners)``).
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat

from course_lib.tools.grading.exercise import Catalog

_HEADING = re.compile(r"^#\s+(\d\d)\s+·\s+(.+?)\s*$")
_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def chapters(notebooks: Path) -> list[tuple[str, str, str]]:
    """``(number, title, file name)`` of each numbered notebook in ``notebooks``, from its first heading."""
    out = []
    for path in sorted(notebooks.glob("[0-9][0-9]_*.ipynb")):
        cells = nbformat.read(path, as_version=4).cells
        first = cells[0].source.splitlines()[0] if cells and cells[0].source else ""
        m = _HEADING.match(first)
        out.append((m[1], m[2], path.name) if m else (path.name[:2], path.stem[3:].replace("_", " "), path.name))
    return out


def learners_part(text: str) -> str:
    """The learners' part of a README: its preamble and its sections headed ``... (learners)``."""
    parts = re.split(r"(?m)^(?=## )", text)
    kept = [parts[0]] + [p for p in parts[1:] if p.splitlines()[0].rstrip().endswith("(learners)")]
    return "".join(kept).rstrip() + "\n"


def learner_readme(root: Path, catalog: Catalog) -> str:
    """The learner's copy's README: set up, the chapters, working and checking an exercise, running it all."""
    numbers = sorted(name[:2] for name in catalog.exercises)
    counts = [len(ex.questions) for ex in catalog.exercises.values()]
    example = f"exercises/{sorted(catalog.exercises)[0]}.ipynb"
    found = chapters(root / "notebooks")
    rows = [f"| {n} | [{title}](notebooks/{name}) |" for n, title, name in found]
    return "\n".join([
        "# Training neural networks that do not fit",
        "",
        "A hands-on PyTorch course about the memory and time of training, and the techniques that make a model",
        "train when it does not fit. Every technique is built by hand, then used through the real PyTorch API,",
        "and every claim is measured by the code beside it, on your machine.",
        "",
        "## Set up",
        "",
        "You need Python 3.10 or newer and `make`; no GPU and no network dataset are needed.",
        "",
        "```bash",
        "make lab      # the first time: creates .venv and installs the course, then starts JupyterLab",
        "```",
        "",
        "As root (a container, a cloud VM), `make lab` adds Jupyter's `--allow-root` for you.",
        "",
        "## Study",
        "",
        f"Start with [{found[0][1]}](notebooks/{found[0][2]}): run its cells from the top (Shift-Enter runs one). Then take the chapters in order:",
        "",
        "| # | notebook |",
        "|---|---|",
        *rows,
        "",
        "## Work and check the exercises",
        "",
        f"Chapters {numbers[0]}-{numbers[-1]} each come with a graded exercise notebook in `exercises/` with the "
        f"chapter's name: {_WORDS[min(counts)]} to {_WORDS[max(counts)]} questions, each a function to write with a "
        "hint in its stub, followed by a test cell. [exercises/README.md](exercises/README.md) says how to work one.",
        "When you have written one, check it the way the grader runs it (a fresh kernel on a copy of the notebook):",
        "",
        "```bash",
        f".venv/bin/course check {example}",
        "```",
        "",
        "For each question it prints `ok`, `to do`, `failed`, `error`, `timeout` or `rejected` with the reason and "
        "the hint, and it ends with \"visible tests passed; hidden tests check more\" when they all pass. Your",
        "notebook is graded with more tests than you see (other inputs, edge cases, the invalid arguments the "
        "docstring names): read each docstring and handle every case it names. Hand the notebook in under its "
        "own file name, with every cell running from the top.",
        "",
        "## Run the whole course",
        "",
        "```bash",
        "make course                                  # every notebook into build/, then build/report.md",
        ".venv/bin/course run --profile cpu 04        # one chapter, by its number",
        ".venv/bin/course doctor                      # versions, device, datasets, what to fix",
        "```",
        "",
        "The profile (`smoke`, `cpu` or `gpu`) sets how big the experiments are: `gpu` where PyTorch sees a GPU,",
        "`cpu` otherwise; set `COURSE_PROFILE` to choose. [docs/running.md](docs/running.md) says more: the",
        "profiles, how long each notebook took on the CPUs measured, and what the course does where your CPU's bf16",
        "or FP8 kernels are slow or broken; [docs/gpu.md](docs/gpu.md) covers GPUs and hosted notebooks.",
        "",
    ])
