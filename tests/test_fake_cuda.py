"""The modules the notebooks put on the GPU, run on a fake CUDA device; and every tensor factory names its device.

No GPU is needed. Under ``torch._subclasses.fake_tensor.FakeTensorMode`` a
tensor made on ``cuda:0`` has a device, a shape and a dtype but no data. Every
op checks its inputs' devices, so a CPU tensor mixed with a CUDA one raises
``FakeTensorDeviceMismatchError`` as CUDA would; and every op that reads data
on the host (``.item()``, ``int(t)``, ``bool(t)``, ``.tolist()``, ``bincount``,
a boolean mask) raises too. A forward that runs here mixes no devices and hides
no wait for the device. Where a module reads host integers on purpose, in one
named function (``moe.queue_lengths``), the test hands it integers a real
router could give and runs the rest fake. Each forward runs in float32 and
under bf16 autocast (as the ``gpu`` profile trains); the backward needs a real
device (autograd's engine asks CUDA for a context), so it is ``course
gpu-check``'s part.

Two stand-ins for what a machine without a GPU lacks: ``torch.cuda.is_available``
says yes while an autocast context is made (autocast turns itself off without
CUDA), and a module is moved to the fake device parameter by parameter
(``Module.to`` swaps fake tensors, which it cannot do here).

The factory check reads the source of every module of ``course_lib`` that
handles model tensors (all but ``data.py``, whose datasets are built on the host
and moved by the loader, and the grading package, which serialises tensors
between processes). A call of a tensor factory (``torch.arange``, ``zeros``,
``ones``, ``empty``, ``full``, ``tensor``, ``randn``, ``randperm``, ...; see
``FACTORIES``) must say where its tensor lives:

- it passes ``device=`` (or ``pin_memory=``: pinned memory is host memory), or
- its result is moved at once (``torch.randn(...).to(device)``), or
- it initialises a parameter or a buffer (inside ``nn.Parameter(...)`` or
  ``register_buffer(...)``), which the module's ``.to(device)`` moves, or
- it is host-side on purpose, and a line of its statement says so with a
  comment that starts ``# host`` (``# host: why``, or a comment above that
  explains, and ``# host`` on the line).
"""

from __future__ import annotations

import ast
import contextlib
import io
import math
import re
import tokenize
from pathlib import Path
from typing import Callable, Iterator
from unittest import mock

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import (FakeTensor, FakeTensorDeviceMismatchError, FakeTensorMode,
                                            unset_fake_temporarily)

from course_lib import checkpointing, chunked_loss, fp8_linear, models, moe, norms, offload, planner
from course_lib.parallel.context_parallel import model as cp_model
from course_lib.parallel.context_parallel import ring_attention as cp
from course_lib.experiments import cp_checks
from course_lib.experiments.cp_checks import MeasuredRing
from course_lib.parallel.tensor_parallel import layers as tp

CUDA = torch.device("cuda", 0)
ROOT = Path(__file__).resolve().parent.parent
PRECISIONS = ("fp32", "bf16-autocast")


# ----- the fake device -----------------------------------------------------------------------


def to_fake_cuda(module: nn.Module) -> nn.Module:
    """``module.to("cuda")`` for fake tensors: each parameter and buffer replaced by its CUDA copy (ties kept).

    A module built outside the fake mode (real CPU tensors) gets fake copies of its tensors first.
    """
    mode = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)

    def move(t: torch.Tensor) -> torch.Tensor:
        return (t if isinstance(t, FakeTensor) else mode.from_tensor(t)).detach().to(CUDA)
    moved: dict[int, torch.Tensor] = {}
    for m in module.modules():
        for name, p in m._parameters.items():
            if p is not None:
                if id(p) not in moved:
                    moved[id(p)] = nn.Parameter(move(p), requires_grad=p.requires_grad)
                m._parameters[name] = moved[id(p)]
        for name, b in m._buffers.items():
            if b is not None:
                m._buffers[name] = move(b)
    return module


def autocast_bf16() -> torch.autocast:
    """CUDA bf16 autocast, made as on a GPU machine (without CUDA, autocast disables itself when it is made)."""
    with mock.patch.object(torch.cuda, "is_available", return_value=True), \
            mock.patch.object(torch.cuda, "is_bf16_supported", return_value=True):
        return torch.autocast("cuda", dtype=torch.bfloat16)


@contextlib.contextmanager
def fake_cuda(precision: str = "fp32") -> Iterator[FakeTensorMode]:
    """Fake tensors, and under ``bf16-autocast`` CUDA's bf16 autocast around what runs inside."""
    with FakeTensorMode() as mode, (autocast_bf16() if precision == "bf16-autocast" else contextlib.nullcontext()):
        yield mode


def cuda_randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, device=CUDA)


def cuda_tokens(vocab: int, *shape: int) -> torch.Tensor:
    return torch.randint(0, vocab, shape, device=CUDA)


def _assert_on_cuda(*outs: torch.Tensor) -> None:
    for out in outs:
        assert out.device == CUDA, f"an output on {out.device}"


def test_the_fake_device_catches_a_mix_and_a_host_read() -> None:
    with fake_cuda():
        x = cuda_randn(4)
        with pytest.raises(FakeTensorDeviceMismatchError):
            x - torch.arange(4)
        with pytest.raises(Exception, match="local_scalar_dense"):
            int(x.sum())


# ----- the forwards -----------------------------------------------------------------------------


def _tiny() -> models.TinyTransformer:
    return models.TinyTransformer(vocab=32, d_model=16, n_heads=2, n_layers=2, max_len=8)


def _resnet(norm_layer: Callable[[int], nn.Module]) -> Callable[[], torch.Tensor]:
    def run() -> torch.Tensor:
        net = to_fake_cuda(models.ResNet(width=8, norm_layer=norm_layer))
        return net(cuda_randn(4, 3, 16, 16))
    return run


def _transformer(fused: bool) -> torch.Tensor:
    model = to_fake_cuda(models.TinyTransformer(32, 16, 2, 2, 8, fused=fused))
    idx = cuda_tokens(32, 2, 8)
    return models.lm_loss(model(idx), idx)


def _fp8_transformer() -> torch.Tensor:
    """The planner's fp8 precision: the blocks' linear layers through chapter 06's FP8 matmuls (no host check)."""
    model = to_fake_cuda(models.TinyTransformer(32, 16, 2, 2, 8))
    idx = cuda_tokens(32, 2, 8)
    with planner.fp8_matmuls(model):
        return models.lm_loss(model(idx), idx)


def _torchao_transformer() -> torch.Tensor:
    """Chapter 06's model through torchao's Float8Linear, as the notebook runs it at the gpu profile."""
    from torchao.float8 import convert_to_float8_training
    model = to_fake_cuda(convert_to_float8_training(models.TinyTransformer(32, 16, 2, 2, 8)))
    idx = cuda_tokens(32, 2, 8)
    return models.lm_loss(model(idx), idx)


def _checkpointed_chain() -> torch.Tensor:
    blocks = to_fake_cuda(checkpointing.chain(4, 8))
    return checkpointing.checkpointed_sequential(blocks, 2)(cuda_randn(3, 8).requires_grad_())


def _checkpointed_blocks(mode: str) -> Callable[[], torch.Tensor]:
    def run() -> torch.Tensor:
        model = to_fake_cuda(_tiny())
        model.blocks = checkpointing.checkpoint_blocks(model.blocks, mode)
        return model(cuda_tokens(32, 2, 8))
    return run


def _chunked_loss(by_hand: bool) -> Callable[[], torch.Tensor]:
    def run() -> torch.Tensor:
        model = to_fake_cuda(_tiny())
        idx = cuda_tokens(32, 2, 8)
        return chunked_loss.transformer_loss(model, idx, idx, chunks=4, by_hand=by_hand)
    return run


def _offloaded(kind: str) -> Callable[[], torch.Tensor]:
    def run() -> torch.Tensor:
        model = to_fake_cuda(_tiny())
        hooks = offload.OffloadToHost() if kind == "by_hand" else offload.CountedSaveOnCpu(device_type="cuda")
        model.blocks = offload.offload_blocks(model.blocks, hooks)
        out = model(cuda_tokens(32, 2, 8))
        # save_on_cpu's copies are told by their data pointers, which fake tensors do not have
        assert kind != "by_hand" or hooks.copies > 0, "the saved tensors were copied to the host"
        return out
    return run


def _moe(k: int) -> Callable[[], torch.Tensor]:
    def run() -> torch.Tensor:
        layer = to_fake_cuda(moe.MoEMLP(8, 16, n_experts=4, k=k, capacity_factor=1.0))
        out = layer(cuda_randn(2, 8, 8))
        _assert_on_cuda(layer.aux_loss, *(getattr(layer.routing, f) for f in ("order", "position", "kept")))
        return out
    return run


class _OneRank(tp.TPGroup):
    """A tensor-parallel group of one rank without a process group: its collectives return their input."""

    size = 1
    rank = 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return x.contiguous()

    def reduce_scatter(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return x.contiguous()


def _tp_block(sequence_parallel: bool) -> Callable[[], torch.Tensor]:
    def run() -> torch.Tensor:
        # built from real tensors: TPBlock deep-copies the block's norms, and a deep copy of a fake tensor lands in
        # a fake mode of its own, which this one cannot mix with
        with unset_fake_temporarily():
            split = tp.TPBlock(models.TransformerBlock(16, 2, 8), _OneRank(), sequence_parallel, sequence_parallel)
        return to_fake_cuda(split)(cuda_randn(2, 8, 16).requires_grad_())
    return run


def _ring_attention() -> torch.Tensor:
    q, k, v = (cuda_randn(2, 2, 8, 4).requires_grad_() for _ in range(3))
    ring = MeasuredRing(8)
    out = cp.ring_attention(q, k, v, ring)
    assert ring.pairs == [36]
    return out


def _ring_model() -> torch.Tensor:
    model = to_fake_cuda(_tiny())
    return cp_model.model_forward(model, cuda_tokens(32, 2, 8), cp.Ring(8))


def _ring_blocks() -> torch.Tensor:
    q, k, v = (cuda_randn(1, 2, 4, 4) for _ in range(3))
    early, late = cp.position_list(8, 2, 0), cp.position_list(8, 2, 1)
    o1, l1, _ = cp.block_attention(q, k, v, late, early)
    o2, l2, _ = cp.block_attention(q, k, v, late, late)
    o, lse = cp.merge(o1, l1, o2, l2)
    dq, dk, dv = cp_checks.block_attention_backward(q, k, v, cuda_randn(1, 2, 4, 4), lse, cuda_randn(1, 2, 4, 1),
                                                    late, early)
    return o, lse, dq, dk, dv


FORWARDS: dict[str, Callable[[], object]] = {
    "resnet-batchnorm": _resnet(nn.BatchNorm2d),
    "resnet-groupnorm": _resnet(lambda c: norms.GroupNorm(2, c)),
    "resnet-ghost-batchnorm": _resnet(lambda c: norms.GhostBatchNorm2d(c, group_size=2)),
    "resnet-mabn-per-device": _resnet(lambda c: norms.MABN2d(c, group_size=2)),
    "resnet-mabn-in-sequence": _resnet(lambda c: norms.MABN2d(c, group_size=2, sequential=True)),
    "resnet-centralised-convs": lambda: to_fake_cuda(norms.centralize_convs(
        models.ResNet(width=8, norm_layer=lambda c: norms.make_norm("gn", c))))(cuda_randn(2, 3, 16, 16)),
    "mlp": lambda: to_fake_cuda(models.MLP(48, (16,), 10))(cuda_randn(2, 3, 4, 4)),
    "transformer": lambda: _transformer(fused=False),
    "transformer-fused-attention": lambda: _transformer(fused=True),
    "fp8-linear": lambda: to_fake_cuda(fp8_linear.FP8Linear(32, 48))(cuda_randn(4, 32)),
    "transformer-fp8-matmuls": _fp8_transformer,
    "transformer-torchao-float8": _torchao_transformer,
    "checkpointed-chain": _checkpointed_chain,
    "checkpointed-blocks-full": _checkpointed_blocks("full"),
    "checkpointed-blocks-selective": _checkpointed_blocks("selective"),
    "chunked-loss": _chunked_loss(by_hand=False),
    "chunked-loss-by-hand": _chunked_loss(by_hand=True),
    "offload-by-hand": _offloaded("by_hand"),
    "offload-save-on-cpu": _offloaded("save_on_cpu"),
    "moe-top-1": _moe(1),
    "moe-top-2": _moe(2),
    "tp-block": _tp_block(sequence_parallel=False),
    "tp-block-sequence-parallel": _tp_block(sequence_parallel=True),
    "ring-attention-one-process": _ring_attention,
    "ring-model-one-process": _ring_model,
    "ring-blocks": _ring_blocks,
}


def _even_queues(r: moe.Routing) -> list[int]:
    """What ``moe.queue_lengths`` reads on a GPU, for a router that spreads the choices evenly."""
    n_experts, choices = r.probs.shape[1], r.expert.numel()
    return [choices // n_experts + (e < choices % n_experts) for e in range(n_experts)]


@pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor")  # offload's keep set, empty here
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("name", list(FORWARDS))
def test_forward_on_a_fake_cuda_device(name: str, precision: str, monkeypatch) -> None:
    monkeypatch.setattr(moe, "queue_lengths", _even_queues)  # the one read of host integers, named
    with fake_cuda(precision):
        out = FORWARDS[name]()
        _assert_on_cuda(*(out if isinstance(out, tuple) else (out,)))


def test_moe_routing_needs_no_host_read() -> None:
    # everything of a routing but the queue lengths stays on the device: counts, queues, the loss
    with fake_cuda():
        logits = cuda_randn(16, 4)
        r = moe.route(logits, 2, 1.0)
        _assert_on_cuda(r.tokens_per_expert(), r.order, r.position, r.kept,
                        moe.load_balancing_loss(r.probs, r.expert[:, 0]))
        assert r.tokens_per_expert().dtype == torch.long


def test_moe_counts_equal_bincount_on_the_host() -> None:
    ids = torch.tensor([3, 0, 3, 1, 3, 0])
    assert moe.expert_counts(ids, 5).tolist() == torch.bincount(ids, minlength=5).tolist() == [2, 1, 0, 3, 0]
    r = moe.route(torch.randn(32, 4), 2, 0.5)
    batches = moe.expert_batches(r, moe.queue_lengths(r))
    kept = r.order[r.kept[r.order]]  # the kept choices in queue order, by a mask (a wait for the device on a GPU)
    assert torch.equal(torch.cat(batches), kept)
    assert [len(b) for b in batches] == [min(n, r.capacity) for n in moe.queue_lengths(r)]


# ----- the factory check ------------------------------------------------------------------------

FACTORIES = frozenset({"arange", "zeros", "ones", "empty", "full", "tensor", "as_tensor", "randn", "rand",
                       "randint", "randperm", "normal", "eye", "linspace", "logspace", "empty_strided", "tril_indices",
                       "triu_indices"})
SCOPE_SKIPPED = ("course_lib/data.py", "course_lib/tools/grading/")
HOST_MARK = re.compile(r"#\s*host\b")
# Host-side on purpose, in modules whose code this change leaves alone: each one's own `# host` mark belongs
# there (then take it out of this list; an entry that no longer matches fails the check).
UNMARKED_HOST_SITES: dict[tuple[str, str], str] = {}


def _host_marked_lines(source: str) -> set[int]:
    lines = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and HOST_MARK.match(tok.string):
            lines.add(tok.start[0])
    return lines


def _placed(call: ast.Call, parents: dict[ast.AST, ast.AST]) -> bool:
    """Whether the factory's tensor is placed where it is made: a device, a move at once, a module's state."""
    if any(kw.arg in ("device", "pin_memory") for kw in call.keywords):
        return True
    parent = parents.get(call)
    moved = isinstance(parent, ast.Attribute) and parent.attr in ("to", "cuda")
    if moved and isinstance(parents.get(parent), ast.Call):
        return True
    node = call
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if name in ("Parameter", "register_buffer"):
                return True
        if isinstance(node, ast.stmt):
            return False
    return False


def unplaced_factories(path: Path, source: str) -> list[tuple[int, str]]:
    """``(line, call)`` of each factory in ``source`` that neither names its device nor is marked ``# host``."""
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    marked = _host_marked_lines(source)
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in FACTORIES
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"):
            continue
        stmt = node
        while not isinstance(stmt, ast.stmt):
            stmt = parents[stmt]
        if _placed(node, parents) or marked & set(range(stmt.lineno, stmt.end_lineno + 1)):
            continue
        found.append((node.lineno, ast.get_source_segment(source, node)))
    return found


def _scope() -> list[Path]:
    files = sorted((ROOT / "course_lib").rglob("*.py"))
    return [f for f in files if not str(f.relative_to(ROOT)).startswith(SCOPE_SKIPPED)]


def test_every_tensor_factory_names_its_device_or_says_it_is_host_side() -> None:
    unplaced, listed = [], set()
    for path in _scope():
        rel = str(path.relative_to(ROOT))
        for line, call in unplaced_factories(path, path.read_text()):
            if (rel, call) in UNMARKED_HOST_SITES:
                listed.add((rel, call))
            else:
                unplaced.append(f"{rel}:{line}: {call}")
    assert not unplaced, ("tensor factories that name no device: pass device=, move the result at once, or mark a "
                          "host-side one with a trailing `# host` comment\n" + "\n".join(unplaced))
    stale = set(UNMARKED_HOST_SITES) - listed
    assert not stale, f"marked or gone now, take them out of UNMARKED_HOST_SITES: {sorted(stale)}"


@pytest.mark.parametrize("code, bad", [
    ("x = torch.arange(n)\n", True),
    ("x = torch.arange(n, device=d)\n", False),
    ("x = torch.arange(n)  # host: an index\n", False),
    ("x = torch.cat([torch.arange(n),  # host\n               torch.arange(m)])\n", False),
    ("x = torch.randn(3, generator=g).to(d)\n", False),
    ("self.w = nn.Parameter(torch.ones(3))\n", False),
    ("self.register_buffer('m', torch.ones(3, 3).tril())\n", False),
    ("y = torch.empty(s, pin_memory=p)\n", False),
    ("y = x - torch.arange(x.numel())\n", True),
    ("y = torch.zeros_like(x) + torch.tensor([1.0])  # the host mark must start the comment: not host\n", True),
])
def test_the_factory_check_reads_the_conventions(code: str, bad: bool) -> None:
    assert bool(unplaced_factories(Path("x.py"), code)) == bad


def test_the_old_dispatch_indices_fails_the_factory_check() -> None:
    old = "position[order] = torch.arange(flat.numel()) - starts[flat[order]]\n"
    assert unplaced_factories(Path("moe.py"), old) == [(1, "torch.arange(flat.numel())")]


def test_ring_blocks_compute_with_no_key_visible() -> None:
    # a block no query sees is skipped: zeros and L = -inf, in the accumulation dtype, without reading the device
    with fake_cuda():
        q, k, v = (cuda_randn(1, 1, 2, 4).to(torch.bfloat16) for _ in range(3))
        o, lse, pairs = cp.block_attention(q, k, v, [0, 1], [2, 3])
        assert pairs == 0 and o.dtype == lse.dtype == torch.float32
    assert math.isinf(cp.block_attention(torch.ones(1, 1, 4), torch.ones(1, 1, 4), torch.ones(1, 1, 4),
                                         [0], [1])[1].item())
