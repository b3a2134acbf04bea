"""Each distributed chapter (07-13) states its notation once, at the top, and uses it.

A chapter opens (within its first four cells) with a markdown cell holding a line that starts ``**Symbols**`` and
a table headed ``| symbol | meaning |`` of at least three rows. Each row's first column names one or more
symbols, written as the chapter writes them: in ``$...$`` (read against the math of the chapter's other markdown
cells), in backticks (read against their code spans) or plain (read against their text). Every symbol so named
must appear in another markdown cell of the chapter, as a whole symbol (``N`` does not count inside ``N_1`` or
``\\Nu``): a table of letters the chapter never uses would be decoration.
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
CHAPTERS = [path for path in sorted(NOTEBOOKS.glob("*.ipynb")) if 7 <= int(path.name[:2]) <= 13]
HEAD = re.compile(r"^\|\s*symbol\s*\|\s*meaning\s*\|\s*$", re.MULTILINE)
MATH = re.compile(r"\$\$?([^$]+)\$\$?")
CODE = re.compile(r"`([^`]+)`")


def _markdown(path: Path) -> list[str]:
    nb = nbformat.read(path, as_version=4)
    return [cell.source if cell.cell_type == "markdown" else "" for cell in nb.cells]


def _symbols_cell(cells: list[str]) -> int | None:
    for i, source in enumerate(cells[:4]):
        if re.search(r"^\*\*Symbols\*\*", source, re.MULTILINE) and HEAD.search(source):
            return i
    return None


def _rows(source: str) -> list[str]:
    """The first column of each row below the ``| symbol | meaning |`` header (the ``|---|`` line skipped)."""
    rows = []
    for line in source[HEAD.search(source).end():].splitlines():
        line = line.strip()
        if not line.startswith("|"):
            if rows or line:
                break
            continue
        first = line.strip("|").split("|")[0].strip()
        if not set(first) <= set("-: "):
            rows.append(first)
    return rows


def _names(first_column: str) -> list[tuple[str, str]]:
    """(kind, symbol) for each symbol a table cell names: kind is 'math', 'code' or 'text'."""
    names = [("math", m.strip()) for m in MATH.findall(first_column)]
    names += [("code", c.strip()) for c in CODE.findall(first_column)]
    if not names:
        names = [("text", part.strip()) for part in first_column.split(",") if part.strip()]
    return names


def _occurs(symbol: str, text: str) -> bool:
    return re.search(r"(?<![A-Za-z0-9\\])" + re.escape(symbol) + r"(?![A-Za-z0-9_])", text) is not None


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_symbols_table_at_the_top(path):
    cells = _markdown(path)
    where = _symbols_cell(cells)
    assert where is not None, (f"{path.name}: no markdown cell among the first 4 with a '**Symbols**' line and a "
                               "'| symbol | meaning |' table")
    rows = _rows(cells[where])
    assert len(rows) >= 3, f"{path.name}: the Symbols table has {len(rows)} rows, fewer than 3"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_every_symbol_is_used(path):
    cells = _markdown(path)
    where = _symbols_cell(cells)
    assert where is not None, f"{path.name}: no Symbols table"
    others = [source for i, source in enumerate(cells) if i != where]
    spans = {
        "math": " ".join(m for source in others for m in MATH.findall(source)),
        "code": " ".join(c for source in others for c in CODE.findall(source)),
        "text": "\n".join(others),
    }
    unused = [f"{kind} {symbol!r}" for row in _rows(cells[where]) for kind, symbol in _names(row)
              if not _occurs(symbol, spans[kind])]
    assert not unused, f"{path.name}: symbols in the table that the chapter's markdown never uses: {unused}"


def test_the_reader_finds_every_chapter():
    assert [int(path.name[:2]) for path in CHAPTERS] == list(range(7, 14))


def test_symbol_matching():
    assert _occurs("N", "2(N-1)/N") and not _occurs("N", "N_1 + N_2") and not _occurs("T", "\\Theta")
    assert _occurs("t_f", "m\\,(t_f + t_b)") and not _occurs("t_f", "t_fw") and _occurs("Ψ", "with Ψ parameters")
    assert _names("$t_f$, $t_b$") == [("math", "t_f"), ("math", "t_b")]
    assert _names("`N`") == [("code", "N")] and _names("Ψ") == [("text", "Ψ")]
    table = "**Symbols**\n\n| symbol | meaning |\n|---|---|\n| $p$ | stages |\n| `k` | chunks |\n\nText."
    assert _rows(table) == ["$p$", "`k`"]
