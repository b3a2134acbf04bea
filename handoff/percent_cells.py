"""Turn a percent-format file of this folder into nbformat cells, to insert into a notebook.

    import nbformat, sys; sys.path.insert(0, "handoff")
    from percent_cells import cells
    nb = nbformat.read(path, 4)
    nb.cells[i:i] = cells("handoff/moe_section.py", drop_preamble=True)
    nbformat.write(nb, path)

``# %% key={json}`` on a cell's first line becomes that cell's metadata (nbgrader, course).
``drop_preamble`` leaves out the cells before the first ``## `` heading (the standalone imports and sizes).
"""

from __future__ import annotations

import json
import re

import nbformat


def cells(path: str, drop_preamble: bool = False) -> list:
    out = []
    for block in re.split(r"^(?=# %%)", open(path).read(), flags=re.M):
        if not block.startswith("# %%"):
            continue
        head, _, body = block.partition("\n")
        m = re.match(r"# %%( \[markdown\])?(.*)$", head)
        meta = {k: json.loads(v) for k, v in re.findall(r"(\w+)=(\{.*?\})(?= \w+=|$)", m.group(2).strip())}
        body = body.strip("\n")
        if m.group(1):
            cell = nbformat.v4.new_markdown_cell("\n".join(line[2:] if line.startswith("# ") else line.lstrip("#")
                                                           for line in body.splitlines()))
        else:
            cell = nbformat.v4.new_code_cell(body)
        cell.metadata.update(meta)
        out.append(cell)
    if drop_preamble:
        first = next(i for i, c in enumerate(out) if c.cell_type == "markdown" and c.source.startswith("## "))
        out = out[first:]
    return out
