"""Build a notebook from a percent-format script (an authoring aid; the .ipynb is what the course ships).

    python tools/nbbuild.py draft.py notebooks/03_gradient_accumulation.ipynb

Cells start with ``# %%`` (code) or ``# %% [markdown]`` (markdown, each line
starting with ``# ``). ``# %% tags=["parameters"]`` tags a code cell; any
``key=value`` JSON after the marker goes into the cell's metadata, e.g.
``# %% nbgrader={"grade": true, "grade_id": "q1_tests", "points": 2}``.
Outputs are never stored.
"""

from __future__ import annotations

import json
import re
import sys

import nbformat

MARK = re.compile(r"^# %%(?P<md> \[markdown\])?(?P<meta>.*)$")


def parse_meta(text: str) -> dict:
    meta: dict = {}
    for key, value in re.findall(r'(\w+)=(\[.*?\]|\{.*?\}(?=\s+\w+=|\s*$)|\S+)', text.strip()):
        meta[key] = json.loads(value)
    return meta


def build(source: str) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    cells: list[tuple[bool, str, list[str]]] = []
    for line in source.splitlines():
        m = MARK.match(line)
        if m:
            cells.append((bool(m["md"]), m["meta"], []))
        elif cells:
            cells[-1][2].append(line)
    for is_md, meta_text, lines in cells:
        while lines and not lines[-1].strip():
            lines.pop()
        while lines and not lines[0].strip():
            lines.pop(0)
        meta = parse_meta(meta_text)
        if is_md:
            text = "\n".join(re.sub(r"^# ?", "", l) for l in lines)
            cell = nbformat.v4.new_markdown_cell(text)
        else:
            cell = nbformat.v4.new_code_cell("\n".join(lines))
        cell.metadata.update(meta)
        nb.cells.append(cell)
    return nb


if __name__ == "__main__":
    src, dst = sys.argv[1], sys.argv[2]
    nb = build(open(src).read())
    nbformat.validate(nb)
    nbformat.write(nb, dst)
    print(f"wrote {dst}: {len(nb.cells)} cells")
