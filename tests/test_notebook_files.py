"""Stored notebooks: valid, without outputs, with a parameters cell, in learning order, no echo clutter."""

import ast
import json
import re
from pathlib import Path

import nbformat
import pytest
from IPython.core.inputtransformer2 import TransformerManager

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
ALL = NOTEBOOKS + sorted((ROOT / "solutions").glob("*.ipynb")) + sorted((ROOT / "exercises").glob("*.ipynb"))


def test_there_are_notebooks():
    assert [nb.name[:2] for nb in NOTEBOOKS][:3] == ["00", "01", "02"]


@pytest.mark.parametrize("path", ALL, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_stored_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type != "code" or "NBVAL_CHECK_OUTPUT" in cell.source:
            continue
        assert not cell.outputs, f"{path.name}: a code cell is stored with outputs: {cell.source[:60]!r}"
        assert cell.execution_count is None


@pytest.mark.parametrize("path", ALL, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_cell_has_a_unique_id(path):
    """nbformat 4.5 cells carry an ``id``; a cell added without one makes every reader warn (and, later, fail)."""
    ids = [c.get("id") for c in json.loads(path.read_text())["cells"]]
    missing = [k for k, i in enumerate(ids) if not i]
    assert not missing, f"{path.name}: cells {missing} have no id (nbformat.validator.normalize adds them)"
    assert len(set(ids)) == len(ids), f"{path.name}: repeated cell ids"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_one_parameters_cell_with_profile(path):
    nb = json.loads(path.read_text())
    params = [c for c in nb["cells"] if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(params) == 1, f"{path.name} needs exactly one cell tagged 'parameters'"
    src = "".join(params[0]["source"])
    assert "PROFILE = None" in src and "SIZE_TABLE" in src
    for profile in ("smoke", "cpu", "gpu"):
        assert f'"{profile}"' in src, f"{path.name}: the size table has no {profile!r} entry"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_chapter_shape(path):
    text = path.read_text()
    assert "Experiment" in text, f"{path.name} has no Experiment section"
    assert "record(" in text, f"{path.name} records no claim"


# ----- no echo clutter: a cell's last line must not make Jupyter print a stray value -----------------------------
# Jupyter echoes the value of a cell's last expression. Some calls return something nobody wants to see there.
# Each rule below names what would be echoed. `record(...)` and `plots.save(...)` are not among them: as a cell's
# last line record returns None (tests/test_report.py; tests/test_cli.py in a real kernel), save always does.
CHECKED = NOTEBOOKS + sorted((ROOT / "solutions").glob("*.ipynb"))  # exercises/ is generated from solutions/
NONE_RETURNING = {"show", "close", "tight_layout", "savefig", "grid", "set_xscale", "set_yscale", "subplots_adjust",
                  "clf", "cla", "set_axis_off", "set_axis_on", "draw"}  # matplotlib methods that return None
FIGURE_NAME = re.compile(r"^(plt|ax|axes|fig|figure)(\d+|_\w+)?$")  # the names the course gives figures and axes
MODULE_METHODS = {"train", "eval", "to", "cuda", "cpu", "apply", "load_state_dict", "half", "float", "bfloat16"}


def _root_name(node: ast.AST) -> str | None:
    """``plt`` for ``plt.gca().legend``, ``ax`` for ``ax[0].plot``: the name a call chain starts from."""
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def echo_clutter(source: str) -> str | None:
    """What Jupyter would echo after this cell's printed output, if it is clutter; else None."""
    code = TransformerManager().transform_cell(source)  # IPython's view: %magics and !commands become Python
    try:
        body = ast.parse(code).body
    except SyntaxError:
        return None  # not Python (a cell in another language): nothing to judge
    if not body or not isinstance(body[-1], ast.Expr) or code.rstrip().endswith(";"):  # ";" silences the echo
        return None
    value = body[-1].value
    if isinstance(value, ast.Name) and FIGURE_NAME.match(value.id):
        return f"a bare `{value.id}` shows the figure a second time (or an Axes repr)"
    if isinstance(value, (ast.ListComp, ast.GeneratorExp)) and isinstance(value.elt, ast.Call):
        return "a comprehension run for its calls echoes their list of results"
    if not isinstance(value, ast.Call):
        return None  # a bare name or value is there to be shown
    func = value.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    root = _root_name(func.value) if isinstance(func, ast.Attribute) else None
    if root == "plots" and name != "save":
        return f"plots.{name}(...) returns the Figure: it is shown a second time, or as `<Figure size ...>`"
    if root and FIGURE_NAME.match(root) and name not in NONE_RETURNING:
        return f"`{root}.{name}(...)` returns a matplotlib object: `[<matplotlib.lines.Line2D ...>]`, `Text(...)`"
    if name in {"manual_seed", "seed_everything"}:
        return f"{name}(...) returns a generator: `<torch._C.Generator at 0x...>`"
    if isinstance(func, ast.Attribute) and name in MODULE_METHODS:
        return f".{name}(...) returns the module, so its whole repr is printed (or a key-matching report)"
    if isinstance(func, ast.Attribute) and name.endswith("_") and not name.startswith("_"):
        return f".{name}(...) works in place and returns the tensor: its repr is printed"
    if name in {"write_text", "write_bytes", "write"}:
        return f".{name}(...) returns the number of characters or bytes written"
    if name == "run" and root == "subprocess":
        return "subprocess.run(...) returns a CompletedProcess"
    return None


def _last_statement(source: str) -> str:
    node = ast.parse(TransformerManager().transform_cell(source)).body[-1]
    return " ".join(ast.unparse(node).split())[:60]


def test_echo_rules_catch_clutter_and_spare_the_rest():
    clutter = ["plt.plot([1, 2])",
               "ax.legend()", "ax1.set(title='t')", "fig", "torch.manual_seed(0)", "model.train()", "w.zero_()",
               "[ax.plot(x) for x in xs]", "plots.curves(series, 't', 'x', 'y')", "%matplotlib inline\nax.legend()"]
    fine = ["record('ch01/x', 1.0)", "plots.save(fig, 'x')", "_ = plots.curves(series, 't', 'x', 'y')", "plt.show()", "fig.tight_layout()",
            "ax.grid(alpha=0.3)", "print(1)", "S", "record('ch01/x', 1.0);", "for k in ks:\n    record(k, 1)",
            "model.zero_grad()", "estimate(model)", ""]
    assert all(echo_clutter(src) for src in clutter), [s for s in clutter if not echo_clutter(s)]
    assert not any(echo_clutter(src) for src in fine), [s for s in fine if echo_clutter(s)]


@pytest.mark.parametrize("path", CHECKED, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_no_cell_ends_in_echo_clutter(path):
    found = []
    for i, cell in enumerate(nbformat.read(path, as_version=4).cells):
        reason = cell.cell_type == "code" and echo_clutter(cell.source)
        if reason:
            found.append(f"cell {i} ends with `{_last_statement(cell.source)}`: {reason}")
    assert not found, f"{path.name}:\n" + "\n".join(found)
