"""The backward pass split in two, for zero-bubble schedules (chapter 08): ``B`` then ``W``, no op run twice.

A backward computes *activation gradients*, which flow from the stage's output down to its input (the previous
rank waits for the last one), and *weight gradients*, which branch off that chain and which nobody waits for. For
``z = x A^T + b`` autograd's node gets ``dz`` and computes ``dx = dz A`` (chain) and ``dA = dz^T x``, ``db = sum(dz)``.

``backward_input`` (``B``) asks autograd for the gradient at the stage's input and at every node with a weight on
its other side, with no weight among its targets: autograd computes only what leads to its targets, so it skips
every weight product, and ``B`` keeps the gradient that reached each such node. ``backward_weight`` (``W``) restarts
autograd at each of them with only the node's own weights as targets: nothing below it runs again. Together they
run exactly the ops of one ``backward()`` (``tests/test_pipeline.py`` counts them). Activation nodes are the
outputs of modules and everything computed from them; the rest (a weight, its transpose) is weight side. On the
first stage the input is data: ``W`` runs the embedding's backward. Cost: one autograd call per weight-using node
in ``W``, and the graph stays alive until ``W``.
"""

from __future__ import annotations

import collections
import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


@contextlib.contextmanager
def recording_activations(module: nn.Module) -> Iterator[set[Node]]:
    """While the block runs, collect the autograd node of every tensor that ``module`` or a submodule outputs."""
    nodes: set[Node] = set()

    def hook(_mod: nn.Module, _inp: object, out: object) -> None:
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                nodes.add(t.grad_fn)

    handles = [m.register_forward_hook(hook) for m in module.modules()]
    try:
        yield nodes
    finally:
        for h in handles:
            h.remove()


@dataclass
class WeightGrads:
    """What ``B`` leaves for ``W``: per weight-using node, the gradients that reached it and its weights."""

    edges: list[list[GradientEdge]] = field(default_factory=list)    # where gradients enter the node
    grads: list[list[torch.Tensor]] = field(default_factory=list)    # the gradient B computed at each
    params: list[list[torch.Tensor]] = field(default_factory=list)   # the weights the node leads to


def _reach(start: list[Node], step: Callable[[Node], list[Node]]) -> set[Node]:
    """``start`` and every node reached from it by ``step`` (iterative: graphs can be deep)."""
    seen, todo = set(), list(start)
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo += step(node)
    return seen


def backward_input(out: torch.Tensor, grad: torch.Tensor | None, x: torch.Tensor | None, activations: set[Node],
                   params: Sequence[torch.Tensor]) -> tuple[torch.Tensor | None, WeightGrads]:
    """``B``: the gradient of ``out`` (times ``grad``) at the input ``x``, and what ``W`` needs later (the graph is
    kept for it). ``activations`` comes from ``recording_activations`` around the forward; ``x`` is ``None`` (or
    needs no gradient) on the first stage, whose input is data."""
    if out.grad_fn is None:
        raise ValueError("the stage's output has no autograd graph: run its forward with gradients enabled")
    root = out.grad_fn

    def kids(node: Node) -> list[Node]:                          # the nodes it passes gradients to
        return [f for f, _ in node.next_functions if f is not None]

    below = {n: kids(n) for n in _reach([root], kids)}
    above: dict[Node, list[Node]] = collections.defaultdict(list)
    entries: dict[Node, dict[GradientEdge, None]] = collections.defaultdict(dict)   # where gradients enter a node
    entries[root][get_gradient_edge(out)] = None
    for node in below:
        for f, k in node.next_functions:
            if f is not None:
                above[f].append(node)
                entries[f][GradientEdge(f, k)] = None
    # activation side: everything above an activation, or above an input that wants its gradient (a leaf that is
    # no weight); the rest leads to weights only
    ids = {id(p) for p in params}
    side = _reach([n for n in below if n in activations or (hasattr(n, "variable") and id(n.variable) not in ids)],
                  lambda n: above[n])
    # the weight-using nodes: activation side with an input on the weight side (the root, if all is weight side)
    split = [n for n in side if any(f not in side for f in below[n])] + ([root] if root not in side else [])
    owner: dict[int, Node] = {}
    pending = WeightGrads()
    for node in split:
        weight_side = _reach([f for f in below[node] if f not in side], lambda f: below[f])
        mine = [f.variable for f in weight_side if hasattr(f, "variable")]
        if any(owner.setdefault(id(p), node) is not node for p in mine):
            raise ValueError("a weight is used by two ops of one micro-batch (a shared or reused layer): "
                             "the split backward would count its gradient twice; run this stage unsplit")
        pending.edges.append(list(entries[node]))
        pending.params.append(mine)
    wants_dx = x is not None and x.requires_grad
    targets: list = ([x] if wants_dx else []) + [e for edges in pending.edges for e in edges]
    # retain_graph: W runs the weight-using nodes again, on their weight side only
    got = list(torch.autograd.grad(out, targets, grad, retain_graph=True, allow_unused=True))
    dx = got.pop(0) if wants_dx else None
    for edges in pending.edges:
        pending.grads.append([got.pop(0) for _ in edges])
    return dx, pending


def backward_weight(pending: WeightGrads) -> None:
    """``W``: each weight-using node's weight gradients from what ``B`` left there, added to the ``.grad`` fields."""
    for edges, grads, params in zip(pending.edges, pending.grads, pending.params):
        used = [(e, g) for e, g in zip(edges, grads) if g is not None]
        if used and params:
            # only the node's own weights as targets: autograd runs the node's weight side and nothing below
            torch.autograd.backward([e for e, _ in used], [g for _, g in used], inputs=params, retain_graph=True)
