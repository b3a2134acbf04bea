"""Every chapter reference in the course names a chapter that exists, by its number and, where named, its title.

Chapters get renumbered when one is added; a sentence that says "chapter 11" or "Next: 10 · Memory beyond
splitting" must then still point at the right notebook. The chapters are read from ``notebooks/``: the number
is a file's prefix and the title its first heading ``# NN · Title``. The references are read from the prose of
notebooks/, exercises/, solutions/ (markdown cells, and comments and strings of code cells), README.md and
the other Markdown files, docs/, and course_lib's docstrings and comments. What counts as a reference:

- ``chapter NN``, ``chapters NN, MM and PP``, ``chapters NN to MM`` / ``NN-MM`` (a range names every chapter in it);
- ``(NN)``: two digits in parentheses after a word, as in "the depth into checkpointed segments (05)";
- ``NN · Name``: a chapter named by number and title, as in "**Next:** 10 · Memory beyond splitting".

Each must resolve to a notebook. Beyond that: a ``NN · Name`` reference's name must be the title's (every word
of the name in the title); a topic given beside a number ("10 (tensor parallelism)", "the capstone (12)")
must not fit another chapter's title better than the one it names; a notebook does not name itself by number
(it is "this chapter"); its prerequisites name only earlier chapters. Numbers that are not chapter references
("3/11", ``range(11)``, "64 (MiB)") are not read as ones.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from dataclasses import dataclass
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent

# ----- the chapters ---------------------------------------------------------------------------------------------


def chapters_in(folder: Path) -> dict[int, str]:
    """``{number: title}`` of the notebooks in ``folder``, the title from the first heading ``# NN · Title``."""
    found = {}
    for path in sorted(folder.glob("[0-9][0-9]_*.ipynb")):
        number = int(path.name[:2])
        nb = nbformat.read(path, as_version=4)
        heading = next((line for c in nb.cells if c.cell_type == "markdown" for line in c.source.splitlines()
                        if line.startswith("# ")), "")
        m = re.match(r"# (\d\d) · (.+)", heading)
        assert m, f"{path.name}: the first heading should read '# {path.name[:2]} · Title', not {heading!r}"
        assert int(m.group(1)) == number, f"{path.name}: its heading says chapter {m.group(1)}"
        found[number] = m.group(2).strip()
    return found


# ----- words: a title and a topic compared by their content words ------------------------------------------------

STOP = set("""a an and or the of in on at to for with by from into over under as is are it its this that these
what where when how which who why whose then than more less most one two many each every all any not no without
about their there here also first last new own same so through up down out being be was were can does do
chapter chapters course model models memory training train trained step steps large small big
""".split())


def stem(word: str) -> str:
    """A crude stem, enough to tell "parallelism" from "parallel" apart from nothing: suffixes off."""
    for suffix in ("ations", "ation", "isms", "ism", "ings", "ing", "ed", "es", "s"):
        if word.endswith(suffix) and len(word) - len(suffix) >= 4:
            word = word[: -len(suffix)]
            break
    if len(word) > 4 and word[-1] == word[-2] and word[-1] not in "aeiou":  # splitt -> split
        word = word[:-1]
    return word


def content_words(text: str) -> set[str]:
    return {stem(w) for w in re.findall(r"[a-z][a-z0-9]*", text.lower()) if w not in STOP and len(w) > 1}


# ----- references -----------------------------------------------------------------------------------------------

NUM = r"\d{1,2}(?!\d|[./]\d|\s*(?:%|x\b|MiB|GiB|MB|GB|bytes))"  # not 3/11, 1.5, 64 MiB, 16 %
TOPIC = r"(?:\s*\((?![\d$])[^()]*\))?"  # "01 (memory anatomy)"; not "(2)" nor a formula
# after a comma, a number is a chapter only if a list goes on or ends there: not "chapter 09, 16 ranks"
SEP = (r"(?:\s*,\s*(?:and\s+|or\s+)?(?=\d{1,2}(?:\s*\(|\s*,|\s+(?:and|or|to)\b|\s*[-–]\s*\d|\s*[.;:)*]|\s*$))"
       r"|\s+and\s+|\s+or\s+|\s+to\s+|\s*[-–]\s*)")
CHAPTER_LIST = re.compile(rf"\b[Cc]hapters?\s+({NUM}{TOPIC}(?:{SEP}{NUM}{TOPIC})*)")
PAREN = re.compile(r"(?<=[A-Za-z\-,*_`] )\((\d\d(?:\s*(?:,|and|to|-|–)\s*\d\d)*)\)")
NAMED = re.compile(r"(?<![\d.])(\d\d) · \**([^\n:;,.(*]+(?:\n[^\n:;,.(*]+)?)")
PREREQ = re.compile(r"\*\*Prerequisites:?\*\*:?(.*?)(?:\*\*Time|\n\n|$)", re.S)


@dataclass(frozen=True)
class Ref:
    numbers: tuple[int, ...]
    text: str  # the reference as written
    name: str = ""  # "NN · Name": the name; must be in the title
    topic: str = ""  # words given beside the number; must not fit another chapter better
    is_range: bool = False
    in_parentheses: bool = False  # "(NN)"


def _numbers(listed: str) -> tuple[tuple[int, ...], bool]:
    """The chapter numbers of "01 (x), 03 to 05 and 08": ranges expanded."""
    plain = re.sub(r"\([^()]*\)", "", listed)
    tokens = re.findall(r"\d{1,2}|\bto\b|[-–]", plain)
    numbers, is_range = [], False
    for i, tok in enumerate(tokens):
        if tok.isdigit():
            if i >= 2 and tokens[i - 1] in ("to", "-", "–"):
                numbers.extend(range(numbers[-1] + 1, int(tok) + 1))
                is_range = True
            else:
                numbers.append(int(tok))
    return tuple(numbers), is_range


def _topic_before(text: str, start: int) -> str:
    """The words before ``(NN)`` back to the previous punctuation: "then the capstone" in "...; then the capstone
    (12)"."""
    before = re.split(r"[.;:,()\[\]]|\n\n|\*\*", text[max(0, start - 120):start])[-1]
    return before.strip()


def references(text: str) -> list[Ref]:
    """The chapter references in one piece of prose."""
    refs = []
    for m in CHAPTER_LIST.finditer(text):
        listed = m.group(1)
        parts = re.split(SEP, listed)
        items = [re.match(rf"({NUM})({TOPIC})", p.strip()) for p in parts]
        numbers, is_range = _numbers(listed)
        if is_range:
            refs.append(Ref(numbers, m.group(0), is_range=True))
        for item in items:
            if item and item.group(2).strip():  # a number with its topic: checked one by one
                refs.append(Ref((int(item.group(1)),), item.group(0), topic=item.group(2).strip(" ()")))
            elif item and not is_range:
                refs.append(Ref((int(item.group(1)),), item.group(0)))
    for m in PAREN.finditer(text):
        numbers, is_range = _numbers(m.group(1))
        topic = _topic_before(text, m.start()) if len(numbers) == 1 else ""
        refs.append(Ref(numbers, m.group(0), topic=topic, is_range=is_range, in_parentheses=True))
    for m in NAMED.finditer(text):
        refs.append(Ref((int(m.group(1)),), m.group(0), name=" ".join(m.group(2).split())))
    return refs


def problems(text: str, chapters: dict[int, str], own: int | None = None, about: dict[int, str] | None = None,
             ) -> list[str]:
    """What is wrong with the chapter references in ``text``, a part of chapter ``own`` (None: not a chapter).

    ``chapters``: ``{number: title}``; ``about``: more words on what a chapter covers (its README row), so that
    "01 (saved activations)" is not taken for chapter 05's "Activation checkpointing".
    """
    about = about or {}
    out = []
    for ref in references(text):
        if ref.in_parentheses and max(ref.numbers) > max(chapters) + 2:
            continue  # "heads (16)": a size, not a chapter; "(12)" with chapters up to 11 is one that is missing
        missing = [n for n in ref.numbers if n not in chapters]
        if missing:
            out.append(f"{ref.text!r}: there is no chapter {', '.join(f'{n:02d}' for n in missing)} "
                       f"(the notebooks are {', '.join(f'{n:02d}' for n in sorted(chapters))})")
            continue
        if own is not None and own in ref.numbers:
            out.append(f"{ref.text!r}: chapter {own:02d} names itself by number; say 'this chapter'")
        if ref.name:
            (n,) = ref.numbers
            extra = content_words(ref.name) - content_words(chapters[n])
            if extra or not content_words(ref.name):
                out.append(f"{ref.text!r}: chapter {n:02d} is '{chapters[n]}'")
        if ref.topic and len(ref.numbers) == 1:
            (n,) = ref.numbers
            words = content_words(ref.topic)
            fit = {k: len(words & content_words(title)) for k, title in chapters.items() if k != n}
            best = max(fit, key=lambda k: fit[k])
            # wrong when another chapter's title names the topic better than all we know of chapter n does
            if fit[best] > len(words & content_words(f"{chapters[n]} {about.get(n, '')}")):
                out.append(f"{ref.text!r}: chapter {n:02d} is '{chapters[n]}'; "
                           f"'{ref.topic}' is chapter {best:02d}, '{chapters[best]}'")
    if own is not None:
        for m in PREREQ.finditer(text):
            later = sorted({n for ref in references(m.group(1)) for n in ref.numbers if n >= own})
            if later:
                out.append(f"chapter {own:02d}'s prerequisites name chapter(s) {later}, which come after it")
    return out


# ----- where the references are ---------------------------------------------------------------------------------


def python_prose(source: str) -> str:
    """The docstrings and comments of a Python source, one after the other (code itself is not prose)."""
    parts = []
    try:
        tree = ast.parse(source)
    except SyntaxError:  # a notebook cell with IPython magics
        tree = None
    if tree is not None:
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=False)
                if doc:
                    parts.append(doc)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                parts.append(node.value)  # strings a notebook prints
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.COMMENT:
                parts.append(tok.string.lstrip("# "))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass
    return "\n\n".join(dict.fromkeys(parts))


def prose_of(path: Path) -> list[tuple[str, str]]:
    """``[(where, text)]`` for one file: a notebook's cells, a Markdown file, a module's docstrings and comments."""
    if path.suffix == ".ipynb":
        nb = nbformat.read(path, as_version=4)
        out = []
        for i, cell in enumerate(nb.cells):
            text = cell.source if cell.cell_type == "markdown" else python_prose(cell.source)
            if i == 0 or cell.cell_type == "markdown" and cell.source.startswith("# "):
                text = re.sub(r"\A# \d\d · .*", "", text)  # the title defines the chapter, it does not refer to it
            out.append((f"{path.relative_to(ROOT)} cell {i}", text))
        return out
    text = path.read_text()
    if path.suffix == ".py":
        text = python_prose(text)
    return [(str(path.relative_to(ROOT)), text)]


def sources() -> list[Path]:
    files = [*sorted((ROOT / "notebooks").glob("*.ipynb")), *sorted((ROOT / "exercises").glob("*.ipynb")),
             *sorted((ROOT / "solutions").glob("*.ipynb")), ROOT / "README.md",
             *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "exercises").glob("*.md")),
             *sorted((ROOT / "course_lib").rglob("*.py"))]
    return [f for f in files if f.exists()]


def readme_rows(readme: str) -> dict[int, str]:
    """``{number: "name: what you measure"}`` from README's chapter table."""
    rows = re.findall(r"^\| (\d\d) \| \[([^\]]+)\]\([^)]*\) \| ([^|]*) \|", readme, re.M)
    return {int(n): f"{name}: {what.strip()}" for n, name, what in rows}


def own_chapter(path: Path) -> int | None:
    """A lecture notebook's own number: the one it must not name itself by. Exercises name their chapter."""
    return int(path.name[:2]) if path.parent.name == "notebooks" and path.name[:2].isdigit() else None


# ----- the checks -----------------------------------------------------------------------------------------------

CHAPTERS = chapters_in(ROOT / "notebooks")
ABOUT = readme_rows((ROOT / "README.md").read_text())


def test_every_notebook_is_a_numbered_chapter():
    numbers = sorted(CHAPTERS)
    assert numbers and numbers[0] == 0, numbers
    assert len(set(numbers)) == len(list((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))), "two notebooks, one number"


@pytest.mark.parametrize("path", sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_references_resolve(path: Path):
    own = own_chapter(path)
    found = [f"{where}: {p}" for where, text in prose_of(path) for p in problems(text, CHAPTERS, own, ABOUT)]
    assert not found, "\n".join(found)


def test_the_reader_finds_references_in_each_kind_of_file():
    """The check reads what it should: it finds references in notebooks, README and docstrings alike."""
    for rel in ("notebooks/11_memory_beyond_splitting.ipynb", "README.md", "course_lib/planner/config.py"):
        assert any(references(text) for _, text in prose_of(ROOT / rel)), rel


def test_readme_has_a_row_for_each_notebook():
    readme = (ROOT / "README.md").read_text()
    rows = dict(re.findall(r"^\| (\d\d) \| \[[^\]]+\]\(notebooks/(\d\d_[^)]+\.ipynb)\)", readme, re.M))
    for path in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        assert rows.get(path.name[:2]) == path.name, f"README's chapter table has no row '| {path.name[:2]} | " \
                                                     f"[...](notebooks/{path.name})'"
    for number, name in rows.items():
        assert name.startswith(number + "_") and (ROOT / "notebooks" / name).exists(), f"README row {number}: {name}"


# ----- the check catches what renumbering broke -----------------------------------------------------------------

# The chapters when the capstone was chapter 11 (THEN), and when context and expert parallelism became 11 (NOW)
TITLES_00_10 = {
    0: "Start here", 1: "Memory anatomy: where the bytes of a training step go",
    2: "Batch size: what it buys and what it costs", 3: "Gradient accumulation: a large batch in small pieces",
    4: "Normalization at small batch: BatchNorm, GroupNorm and MABN",
    5: "Activation checkpointing and mixed precision: store less, recompute more",
    6: "Data parallelism: one model, many workers, averaged gradients", 7: "Pipeline parallel training",
    8: "Sharded training: ZeRO, FSDP and distributed checkpoints",
    9: "Tensor and sequence parallelism, and 2-D parallel training",
    10: "Memory beyond splitting: fused attention, offloading, a chunked loss and the compiler's budget"}
THEN = TITLES_00_10 | {11: "Capstone: plan the largest model for a memory budget"}
NOW = TITLES_00_10 | {11: "Context and expert parallelism", 12: "Capstone: plan the largest model for a memory budget"}
CAPSTONE_ROW = ("capstone: plan the largest model for a memory budget (precision, accumulation, checkpointing, ZeRO, "
                "tensor parallelism, fused attention, a chunked loss, offload), then verify the plan by measurement")
# README rows of the chapters as numbered then: 06-10 are today's 07-11 (FP8 training became 06)
ABOUT_00_10 = {k: v for k, v in ABOUT.items() if k <= 5} | {k: ABOUT[k + 1] for k in range(6, 11)}
ABOUT_THEN = ABOUT_00_10 | {11: CAPSTONE_ROW}
ABOUT_NOW = ABOUT_00_10 | {11: "ring attention, experts over ranks", 12: CAPSTONE_ROW}

# The three sentences as the renumbering left them, each in the chapter it was in
OLD_CAPSTONE_PREREQS = ("**Prerequisites:** chapters 01 (memory anatomy), 03 (accumulation), 05 (checkpointing, "
                        "bf16), 08 (ZeRO),\n10 (tensor parallelism), 11 (fused attention, offloading, the chunked "
                        "loss). **Time:** 60 minutes.")
OLD_09_NEXT = ("answers with `course check exercises/09_tensor_parallel.ipynb`. **Next:** 10 · Memory beyond "
               "splitting; then the\ncapstone (12), whose planner also weighs tensor parallelism.")
OLD_10_OPENING = ("Chapters 03 to 10 made training fit by **splitting**: the batch into micro-batches (03), the depth "
                  "into\ncheckpointed segments (05), the model states over ranks (08), the layers themselves over "
                  "ranks (09).")


def test_catches_the_capstones_prerequisites():
    found = problems(OLD_CAPSTONE_PREREQS, THEN, 11, ABOUT_THEN)
    assert any("'10 (tensor parallelism)'" in p and "chapter 09" in p for p in found), found
    assert any("'11 (fused attention" in p and "names itself" in p for p in found), found
    assert any("prerequisites name chapter(s) [11]" in p for p in found), found
    # renumbered: 09 is tensor parallelism, 10 fused attention; naming 10's topic as 11 is still caught
    assert not problems(OLD_CAPSTONE_PREREQS.replace("10 (", "09 (").replace("11 (", "10 ("), NOW, 12, ABOUT_NOW)
    found = problems(OLD_CAPSTONE_PREREQS, NOW, 12, ABOUT_NOW)
    assert any("'11 (fused attention" in p and "chapter 10" in p for p in found), found


def test_catches_the_capstone_numbered_12_while_it_was_11():
    found = problems(OLD_09_NEXT, THEN, 9, ABOUT_THEN)
    assert found == ["'(12)': there is no chapter 12 (the notebooks are 00, 01, 02, 03, 04, 05, 06, 07, 08, 09, 10, "
                     "11)"], found
    assert not problems(OLD_09_NEXT, NOW, 9, ABOUT_NOW)  # right once the capstone is 12
    # and the capstone numbered 11 once 11 is another chapter
    assert problems(OLD_09_NEXT.replace("(12)", "(11)"), NOW, 9, ABOUT_NOW)


def test_catches_a_chapter_that_counts_itself_among_the_earlier_ones():
    found = problems(OLD_10_OPENING, THEN, 10, ABOUT_THEN)
    assert any("'Chapters 03 to 10'" in p and "names itself" in p for p in found), found
    assert not problems(OLD_10_OPENING.replace("03 to 10", "03 to 09"), THEN, 10, ABOUT_THEN)


def test_catches_a_wrong_title_and_a_missing_chapter():
    assert problems("**Next:** 10 · Capstone: plan the largest model", NOW)
    assert problems("**Next:** 11 · Memory beyond splitting", NOW)
    assert not problems("**Next:** 11 · Context and expert parallelism: ring attention", NOW)
    assert not problems("**Next:** 06 · Data parallel: many GPUs, one model each.", NOW)  # parallel ~ parallelism
    assert problems("as chapter 13 shows", NOW) and problems("chapters 10-14 run ranks", NOW)
    assert problems("Next: **13 · Conclusion**", NOW)


@pytest.mark.parametrize("text", [
    "cell 3/11, 1 min 05 s", "for i in range(11):", "x = f(11)", "batch 32 (2 of 16)", "at chapter 05's 64 MiB",
    "chapter 04 measured 16 % at batch 2", "see (a) and (b)", "heads (16) of 64 dims", "lr 3e-4 (0.0003)",
    "chapter 09, 16 ranks", "2(N-1)/N", "Table 2 (11)",
])
def test_numbers_that_are_not_chapter_references(text: str):
    assert not problems(text, NOW), references(text)
