"""Exercises do not answer themselves: no chapter shows the core lines of a solution.

A chapter shows the signature and the idea of what its exercise asks the learner to write, never the body
(DESIGN.md section 7). This file takes the *core lines* of every solution and fails when a chapter holds
one in its cells, or prints one with ``inspect.getsource``.

A core line is a line of a solution region (between ``### BEGIN SOLUTION`` and ``### END SOLUTION`` of a
``solutions/*.ipynb`` code cell), normalised by dropping its comment and all whitespace, that

- is at least ``MIN_CHARS`` characters long once normalised (shorter lines such as ``return total`` or
  ``n = len(x)`` are what any answer to any question would write, and would match by chance);
- is not an import, a ``def`` line (the signature is given to the learner on purpose) or a ``raise`` /
  ``assert`` (argument checks the instructions spell out in words);
- does not also appear in the learner's copy in ``exercises/`` (a line the stub hands over is no secret).

Two lines match when their normalised forms are equal; in a markdown cell, when the core line is part of a
normalised line (so a line quoted in backticks counts). The match is exact text, so the test cannot flake:
it fails only when a chapter gains a solution's line or an ``inspect.getsource`` of code that holds one.

The library a learner imports is checked the same way: no line of a ``course_lib/**/*.py`` file may equal a core
line once normalised, or the answer ships beside the question (the grader forbids calling the course's version,
not copying it). A question whose answer the library needs asks for a variant the library does not hold.
"""

import ast
import inspect
import json
import re
from pathlib import Path

import pytest
from IPython.core.inputtransformer2 import TransformerManager

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))
CHAPTERS = sorted((ROOT / "notebooks").glob("*.ipynb"))
LIBRARY = ROOT / "course_lib"
MIN_CHARS = 30


def normalise(line: str) -> str:
    """``line`` without its comment (a ``#`` outside a string) and without any whitespace."""
    out, quote, i = [], None, 0
    while i < len(line):
        ch = line[i]
        if quote:
            if ch == "\\":
                out.append(line[i:i + 2])
                i += 2
                continue
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#":
            break
        out.append(ch)
        i += 1
    return re.sub(r"\s+", "", "".join(out))


def _is_core(norm: str) -> bool:
    if len(norm) < MIN_CHARS:
        return False
    if norm.startswith(("import", "from", "def", "raise", "assert")):
        return False
    return not re.match(r"if.*:raise", norm)  # a one-line argument check


def _cells(path: Path) -> list[dict]:
    return json.loads(path.read_text())["cells"]


def _given_lines(stem: str) -> set[str]:
    exercise = ROOT / "exercises" / f"{stem}.ipynb"
    return {normalise(l) for c in _cells(exercise) for l in "".join(c["source"]).splitlines()}


def core_lines() -> dict[str, tuple[str, str, str]]:
    """Normalised core line -> (exercise, question, the line as written)."""
    found = {}
    for path in SOLUTIONS:
        given = _given_lines(path.stem)
        for cell in _cells(path):
            if cell["cell_type"] != "code":
                continue
            question = cell.get("metadata", {}).get("nbgrader", {}).get("grade_id", "?")
            inside = False
            for line in "".join(cell["source"]).splitlines():
                if "### BEGIN SOLUTION" in line:
                    inside = True
                elif "### END SOLUTION" in line:
                    inside = False
                elif inside:
                    norm = normalise(line)
                    if _is_core(norm) and norm not in given:
                        found.setdefault(norm, (path.name, question, line.strip()))
    return found


CORE = core_lines()


def _leaks_in(text: str, markdown: bool = False) -> list[tuple[str, tuple[str, str, str]]]:
    hits = []
    for line in text.splitlines():
        if markdown:
            squeezed = re.sub(r"\s+", "", line)
            hits += [(line, where) for norm, where in CORE.items() if norm in squeezed]
        elif (norm := normalise(line)) in CORE:
            hits.append((line, CORE[norm]))
    return hits


def _describe(hits, place: str) -> str:
    return "\n".join(f"{ex} {q}: core line {sol!r} leaks in {place}: {line.strip()!r}"
                     for line, (ex, q, sol) in hits)


def test_solutions_have_core_lines():
    """The check has something to check: every solution notebook gives core lines."""
    per_exercise = {ex for ex, _, _ in CORE.values()}
    assert per_exercise == {p.name for p in SOLUTIONS}, sorted({p.name for p in SOLUTIONS} - per_exercise)


def test_a_leak_is_found():
    """A chapter line equal to a core line up to spacing and comment is caught; the normalising is sound."""
    norm, (ex, q, sol) = next(iter(CORE.items()))
    assert _leaks_in("    " + sol.replace(" ", "  ") + "  # spelled out")
    assert _leaks_in(f"write `{sol}` for each piece", markdown=True)
    assert not _leaks_in("x = 1  # " + sol)
    assert normalise('s = "a # b"  # c') == 's="a#b"'


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.name)
def test_chapter_cells_hold_no_solution_line(chapter):
    hits = []
    for i, cell in enumerate(_cells(chapter)):
        hits += [(line, where, i) for line, where in
                 _leaks_in("".join(cell["source"]), markdown=cell["cell_type"] == "markdown")]
    assert not hits, "\n".join(_describe([(line, where)], f"{chapter.name} cell {i}") for line, where, i in hits)


def _source_prints(chapter: Path) -> tuple[list[ast.stmt], list[tuple[int, str]]]:
    """The chapter's import statements and the (cell, expression) of each ``inspect.getsource(...)`` call."""
    imports, prints = [], []
    to_python = TransformerManager().transform_cell
    for i, cell in enumerate(_cells(chapter)):
        if cell["cell_type"] != "code":
            continue
        tree = ast.parse(to_python("".join(cell["source"])))
        imports += [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and node.args
                    and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("getsource", "getsourcelines")):
                prints.append((i, ast.unparse(node.args[0])))
    return imports, prints


def _chapters_that_print_source() -> list[Path]:
    return [p for p in CHAPTERS if "getsource" in p.read_text()]


@pytest.mark.parametrize("chapter", _chapters_that_print_source(), ids=lambda p: p.name)
def test_chapter_prints_no_source_holding_a_solution_line(chapter):
    imports, prints = _source_prints(chapter)
    assert prints, f"{chapter.name} names getsource but no call to it was found"
    namespace: dict = {}
    exec(compile(ast.Module(body=imports, type_ignores=[]), chapter.name, "exec"), namespace)
    problems = []
    for cell, expr in prints:
        try:
            source = inspect.getsource(eval(expr, namespace))
        except Exception as exc:  # a print this test cannot follow is a failure, not a pass
            problems.append(f"{chapter.name} cell {cell}: cannot resolve inspect.getsource({expr}): {exc!r}")
            continue
        hits = _leaks_in(source)
        if hits:
            problems.append(_describe(hits, f"{chapter.name} cell {cell}, which prints inspect.getsource({expr})"))
    assert not problems, "\n".join(problems)


def library_leaks(library: Path) -> list[tuple[str, str, str, str]]:
    """(exercise, question, core line, ``file:line``) of every line under ``library`` equal to a core line."""
    hits = []
    for path in sorted(library.rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if (norm := normalise(line)) in CORE:
                ex, q, sol = CORE[norm]
                hits.append((ex, q, sol, f"{path.relative_to(library.parent)}:{number}"))
    return hits


def _describe_library(hits) -> str:
    return "\n".join(f"{ex} {q}: core line {sol!r} ships in {where}" for ex, q, sol, where in hits)


def test_a_library_leak_is_found(tmp_path):
    """A library line equal to a core line, spaced and commented otherwise, in a nested module, is caught."""
    norm, (ex, q, sol) = next(iter(CORE.items()))
    module = tmp_path / "course_lib" / "inner" / "helpers.py"
    module.parent.mkdir(parents=True)
    module.write_text(f'"""A module."""\n\n\ndef f(x):\n    x = 1  # {sol}\n        {sol.replace(" ", "  ")}  # why\n')
    assert library_leaks(tmp_path / "course_lib") == [(ex, q, sol, "course_lib/inner/helpers.py:6")]


def test_library_holds_no_solution_line():
    """No exercise's core line ships in ``course_lib``, the library the learner imports and can read."""
    hits = library_leaks(LIBRARY)
    assert not hits, _describe_library(hits)
