"""Whether a learner's answer uses what its question asks them to write themselves.

Many questions have a reference in ``course_lib`` or in PyTorch (the
chapter's ``memory.zero_memory``, ``ddp.assign_buckets``, ``F.group_norm``);
a one-line call to it would answer the question. A test cell lists such names
in ``metadata.course.forbid``, and the grader reads the learner's source (it
never runs it here) for uses of them:

- in the question's own cells, and in every function, class or assignment
  those cells reach through the notebook's names: any use;
- anywhere in the notebook: a forbidden name, or a function that uses one,
  handed on as a value (assigned, stored, passed, wrapped in a lambda), which
  is how a use would be hidden from the first rule; a plain call at the top of
  a cell, to try the library out, is allowed;
- a string equal to a forbidden name's last part (``getattr(memory, "zero_memory")``);
- in the code the question reaches: ``eval``, ``exec``, ``compile``,
  ``__import__``, ``importlib``, ``globals()``, ``vars()``, ``sys.modules``,
  ``__dict__`` or ``getattr`` with a computed name, which the scan cannot see through.

Names are resolved through imports (``import torch.nn.functional as F`` makes
``F.group_norm`` read ``torch.nn.functional.group_norm``). The limit: this is a
reading of the source, not a proof; a learner determined to hide a call (say,
by building the name from pieces and importing it through a module the
scan does not know) can; the instructions say what not to call, and the
CSV names each rejection so an instructor can look.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

DYNAMIC_CALLS = {"eval", "exec", "compile", "__import__", "globals", "vars", "locals", "breakpoint"}


@dataclass
class _Cell:
    index: int            # the learner's cell number (1-based), for messages
    tree: ast.Module


def parse_cell(source: str) -> ast.Module | None:
    """The AST of a cell as IPython would run it (magics become calls); ``None`` if it does not parse."""
    try:
        from IPython.core.inputtransformer2 import TransformerManager

        source = TransformerManager().transform_cell(source)
    except Exception:  # no IPython here, or a cell it cannot transform: read it as plain Python
        pass
    try:
        return ast.parse(source)
    except (SyntaxError, ValueError):
        return None


class _Names:
    """Import aliases of the whole notebook: local name -> dotted name."""

    def __init__(self, cells: list[_Cell]) -> None:
        self.alias: dict[str, str] = {}
        for cell in cells:
            for node in ast.walk(cell.tree):
                if isinstance(node, ast.Import):
                    for a in node.names:
                        if a.asname:
                            self.alias[a.asname] = a.name
                        else:
                            self.alias.setdefault(a.name.split(".")[0], a.name.split(".")[0])
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    for a in node.names:
                        self.alias[a.asname or a.name] = f"{node.module}.{a.name}"

    def dotted(self, node: ast.AST) -> str | None:
        """``F.group_norm`` -> ``torch.nn.functional.group_norm``; ``None`` for anything else."""
        parts: list[str] = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name):
            return None
        parts.append(self.alias.get(node.id, node.id))
        return ".".join(reversed(parts))


def _matches(dotted: str | None, names: set[str]) -> str | None:
    if dotted is None:
        return None
    return next((n for n in names if dotted == n or dotted.startswith(n + ".")), None)


def _bindings(cells: list[_Cell]) -> dict[str, list[ast.AST]]:
    """Module-level name -> the statements that bind it (defs, classes, assignments, ``global`` writers)."""
    out: dict[str, list[ast.AST]] = {}
    for cell in cells:
        for stmt in cell.tree.body:
            targets: list[str] = []
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                targets = [stmt.name]
                for inner in ast.walk(stmt):  # a function that writes a global binds it too
                    if isinstance(inner, ast.Global):
                        targets += inner.names
            elif isinstance(stmt, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.For, ast.With)):
                heads = (stmt.targets if isinstance(stmt, ast.Assign) else
                         [stmt.target] if not isinstance(stmt, ast.With) else
                         [i.optional_vars for i in stmt.items if i.optional_vars is not None])
                targets = [n.id for h in heads for n in ast.walk(h) if isinstance(n, ast.Name)]
            for name in targets:
                out.setdefault(name, []).append(stmt)
    return out


def _loads(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def _value_uses(tree: ast.AST, names: _Names, bad: set[str]) -> list[tuple[ast.AST, str]]:
    """References to ``bad`` that are not the function of a call; and, outside function bodies, every
    reference inside a lambda (a lambda is a value that can be stored for later)."""
    out: list[tuple[ast.AST, str]] = []

    def visit(node: ast.AST, in_def: bool, in_lambda: bool, called: bool) -> None:
        if isinstance(node, (ast.Name, ast.Attribute)) and isinstance(node.ctx, ast.Load):
            hit = _matches(names.dotted(node), bad)
            if hit and (not called or (in_lambda and not in_def)):
                out.append((node, hit))
                return
        in_def = in_def or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        in_lambda = in_lambda or isinstance(node, ast.Lambda)
        for child in ast.iter_child_nodes(node):
            visit(child, in_def, in_lambda, isinstance(node, ast.Call) and child is node.func)

    visit(tree, False, False, False)
    return out


def violations(sources: list[str], own: list[int], forbid: tuple[str, ...],
               labels: list[str] | None = None) -> list[str]:
    """Why the learner's code (``sources``, their code cells in order, test cells left out) breaks
    ``forbid`` for a question whose cells are ``own`` (indices into ``sources``); empty when it does not.
    ``labels`` name the cells in messages (default ``cell N``)."""
    if not forbid:
        return []
    cells = [_Cell(i + 1, t) for i, s in enumerate(sources) if (t := parse_cell(s)) is not None]
    names = _Names(cells)
    bound = _bindings(cells)
    forbidden = set(forbid)

    # functions and classes that use a forbidden name, directly or through another one
    tainted: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name, stmts in bound.items():
            if name in tainted or name in forbidden:
                continue
            for stmt in stmts:
                if not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    continue
                refs = {names.dotted(n) for n in ast.walk(stmt) if isinstance(n, (ast.Name, ast.Attribute))}
                if any(_matches(r, forbidden) for r in refs) or _loads(stmt) & tainted:
                    tainted.add(name)
                    changed = True
                    break
    bad = forbidden | tainted

    found: list[str] = []

    def report(cell: _Cell, node: ast.AST, what: str) -> None:
        name = labels[cell.index - 1] if labels else f"cell {cell.index}"
        found.append(f"{what} ({name}, line {getattr(node, 'lineno', '?')})")

    # 1. the code the question reaches: its own cells, then what their names are bound to
    reach: list[tuple[_Cell, ast.AST]] = [(c, c.tree) for c in cells if c.index - 1 in own]
    seen: set[str] = set()
    stack = [n for _, t in reach for n in _loads(t)]
    where = {id(s): c for c in cells for s in c.tree.body}
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        for stmt in bound.get(name, []):
            reach.append((where[id(stmt)], stmt))
            stack += _loads(stmt)
    for cell, tree in reach:
        for node in ast.walk(tree):
            if isinstance(node, (ast.Name, ast.Attribute)) and isinstance(node.ctx, ast.Load):
                dotted = names.dotted(node) or ""
                hit = _matches(dotted, forbidden)
                if hit:
                    report(cell, node, f"uses {hit}")
                elif dotted == "sys.modules" or dotted.endswith((".__dict__", ".__getattribute__")):
                    report(cell, node, f"reads {dotted}, which hides what it uses")
            elif isinstance(node, ast.Call):
                fn = names.dotted(node.func) or ""
                computed = fn in ("getattr", "setattr") and len(node.args) > 1 and not isinstance(node.args[1], ast.Constant)
                if fn in DYNAMIC_CALLS or fn.startswith("importlib") or computed:
                    report(cell, node, f"calls {fn}, which hides what it uses")

    # 2. anywhere: a forbidden name (or a function using one) handed on as a value
    for cell in cells:
        for node, hit in _value_uses(cell.tree, names, bad):
            what = hit if hit in forbidden else f"{hit} (which uses {', '.join(sorted(forbidden))})"
            report(cell, node, f"hands on {what} as a value")
        # 3. the name spelled as a string, for getattr and friends
        last = {f.rsplit(".", 1)[1] for f in forbidden}
        for node in ast.walk(cell.tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in last:
                report(cell, node, f"spells {node.value!r}")
    return sorted(set(found), key=found.index)
