"""No notebook leaves a warning on stderr at the test profile: a learner reads a red box as something gone wrong.

A library's warning that is true but not the chapter's business is silenced where it arises, with a comment that
says why; a progress bar (tqdm) is not a warning. The notebooks run once per session (``conftest``); this reads
the executed copies.
"""

from __future__ import annotations

import re

import nbformat
import pytest

from conftest import OUT, notebook_claims
from course_lib.tools import runner

PROGRESS = re.compile(r"^[^:\n]*: *\d+%\|")  # tqdm: "budgets:  25%|██▌       | 1/4 [00:01<00:04,  1.51s/it]"


def stderr_lines(nb: nbformat.NotebookNode) -> list[str]:
    """The lines an executed notebook wrote to stderr, progress bars left out."""
    lines = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream" and out.get("name") == "stderr":
                lines += [ln.strip() for ln in re.split(r"[\r\n]", out["text"])]
    return [ln for ln in lines if ln and not PROGRESS.match(ln)]


@pytest.mark.parametrize("notebook", runner.find_notebooks(), ids=lambda p: p.name[:2])
def test_no_warning_on_stderr(notebook) -> None:
    notebook_claims(notebook.name[:2])  # executed, once per session
    lines = stderr_lines(nbformat.read(OUT / "notebooks" / notebook.name, as_version=4))
    assert not lines, f"{notebook.name} wrote to stderr at this profile:\n" + "\n".join(lines[:10])


def test_the_check_tells_a_warning_from_a_progress_bar() -> None:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(outputs=[
        nbformat.v4.new_output("stream", name="stderr", text="\rbudgets:  25%|██▌ | 1/4 [00:01<00:04]\n"),
        nbformat.v4.new_output("stream", name="stderr",
                               text="W1205 12:13:49.701000 9218 torch/utils/_pytree.py:630] <enum> is deprecated\n"),
        nbformat.v4.new_output("stream", name="stdout", text="loss 0.5\n")])])
    assert stderr_lines(nb) == ["W1205 12:13:49.701000 9218 torch/utils/_pytree.py:630] <enum> is deprecated"]
