"""Chapter 10's tensor and sequence parallelism: the layers by hand, torch's API, the 2-D mesh, the formulas.

The single-process tests check the building blocks and the formulas against
the paper's closed forms; one launch on 4 ranks checks the collectives, the
equality with the single-process block and model, and every byte count
against sizes computed here from the shapes.
"""

from __future__ import annotations

import copy
import tempfile

import pytest
import torch
import torch.distributed as dist

from course_lib import memory
from course_lib.experiments import launch
from course_lib.experiments.counting import ByteCounter, counted
from course_lib.parallel.tensor_parallel import costs as tp_costs
from course_lib.experiments.run_config import RunConfig, build_model
from course_lib.experiments.tp_meters import saved_bytes_in
from course_lib.models import CausalSelfAttention
from course_lib.parallel.tensor_parallel.layers import (ColumnParallelLinear, Conjugate, TPBlock, TPGroup,
                                                        sync_replicated_grads)
from course_lib.parallel.tensor_parallel.vocab_parallel import (VocabParallelEmbedding, vocab_parallel_cross_entropy,
                                                                vocab_range)
from course_lib.experiments.workers.tp_compare import TPReport

CFG = RunConfig(vocab=40, d_model=48, n_heads=4, n_layers=2, seq_len=8, batch=4, steps=2)
WORLD = 4


# ----- one process ---------------------------------------------------------------------------


def _heads_of_rank(attn: CausalSelfAttention, r: int, t: int) -> CausalSelfAttention:
    """Rank r's part of ``attn``: contiguous block r of qkv's rows, block r of proj's columns, no proj bias."""
    part = copy.deepcopy(attn)
    C = attn.proj.in_features
    part.qkv = torch.nn.Linear(C, 3 * C // t).double()
    part.proj = torch.nn.Linear(C // t, C, bias=False).double()
    with torch.no_grad():
        part.qkv.weight.copy_(attn.qkv.weight.chunk(t)[r])
        part.qkv.bias.copy_(attn.qkv.bias.chunk(t)[r])
        part.proj.weight.copy_(attn.proj.weight.chunk(t, 1)[r])
    return part


def test_contiguous_qkv_rows_are_whole_heads() -> None:
    """The model stores qkv head by head, so a contiguous block of its rows is whole heads with their q, k, v."""
    attn = build_model(RunConfig(d_model=24, n_heads=3, seq_len=6, dtype="float64")).blocks[0].attn
    # head j, part i (q, k, v), component d is row j * 3hd + i * hd + d: with hd = 8, rank 1 of 3 holds head 1
    x = torch.randn(2, 6, 24, dtype=torch.float64)
    rows = attn.qkv(x).view(2, 6, 3, 3, 8)[:, :, 1]                     # (B, T, q/k/v, hd) of head 1
    assert torch.equal(rows.flatten(2), attn.qkv(x).chunk(3, dim=-1)[1])
    for t in (1, 3):  # the same attention, computed by t ranks of whole heads each, summed
        xs = [x.clone().requires_grad_() for _ in range(t + 1)]
        parts = [_heads_of_rank(attn, r, t) for r in range(t)]
        full = attn(xs[t])
        split = sum(p(xr) for p, xr in zip(parts, xs)) + attn.proj.bias
        assert torch.allclose(split, full, atol=1e-13, rtol=0)
        full.square().sum().backward()
        split.square().sum().backward()
        assert torch.allclose(sum(xr.grad for xr in xs[:t]), xs[t].grad, atol=1e-13, rtol=0)
        got = torch.cat([p.qkv.weight.grad for p in parts])
        assert torch.allclose(got, attn.qkv.weight.grad, atol=1e-13, rtol=0)
        attn.zero_grad()
    with pytest.raises(ValueError, match="divisible"):
        CausalSelfAttention(8, 3, 6)


def test_conjugate_runs_one_function_forward_and_the_other_backward() -> None:
    """f, g and sequence parallelism's pair are each one ``Conjugate``: a collective forward, its conjugate backward."""
    x = torch.ones(3, requires_grad=True)
    y = Conjugate.apply(x, lambda t: 2 * t, lambda g: 3 * g)
    y.sum().backward()
    assert torch.equal(y, torch.full((3,), 2.0)) and torch.equal(x.grad, torch.full((3,), 3.0))


def test_paper_formulas() -> None:
    """Korthikanti et al. 2022, Table 2, with the default 16-bit activations and 1-byte masks."""
    s, b, h, a = 2048, 1, 12288, 96  # GPT-3 175B
    sbh = s * b * h
    act = tp_costs.activation_bytes_per_layer
    assert act(s, b, h, a) == pytest.approx(sbh * (34 + 5 * a * s / h))
    for t in (2, 8):
        assert act(s, b, h, a, tp=t) == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)))
        assert act(s, b, h, a, tp=t, sequence_parallel=True) == pytest.approx(sbh / t * (34 + 5 * a * s / h))
    # without dropout, in fp32: 16 saved activations of sbh elements, one of as²b (the softmax output)
    assert act(s, b, h, a, act_bytes=4, dropout=False) == pytest.approx(4 * (16 * sbh + a * s * s * b))
    # torch's SequenceParallel keeps the two gathered linear inputs whole
    assert (act(s, b, h, a, tp=8, sequence_parallel=True, regather=False)
            - act(s, b, h, a, tp=8, sequence_parallel=True)) == pytest.approx(2 * 2 * sbh * (1 - 1 / 8))
    comm4 = tp_costs.comm_bytes_per_layer(s, b, h, tp=4)
    assert comm4 == {"all_reduce": pytest.approx(4 * 2 * 3 / 4 * 2 * sbh)}
    sp = tp_costs.comm_bytes_per_layer(s, b, h, tp=4, sequence_parallel=True, regather=False)
    assert sum(sp.values()) == pytest.approx(sum(comm4.values())), "SP moves what TP moves"
    assert tp_costs.block_param_split(h) == (12 * h * h + 7 * h, 6 * h)
    block = build_model(RunConfig(d_model=64)).blocks[0]
    assert sum(tp_costs.block_param_split(64)) == sum(p.numel() for p in block.parameters())
    assert tp_costs.layer_flops(s, b, h) == 3 * (24 * b * s * h * h + 4 * b * s * s * h)


def test_comm_over_compute_cancels_the_batch() -> None:
    r = tp_costs.comm_over_compute(2048, 12288, 8, flops_per_s=1e15, bytes_per_s=4.5e11)
    # by hand: 8 (t-1)/t sbh x 2 bytes / bandwidth over 72 sbh² (1 + s/6h) / t / flops
    want = (8 * 7 / 8 * 2 / 4.5e11) / (72 * 12288 * (1 + 2048 / (6 * 12288)) / 8 / 1e15)
    assert r == pytest.approx(want)


def test_state_bytes_per_rank() -> None:
    parts = tp_costs.state_bytes_per_rank(split_params=800, whole_params=40, tp=4, dp=2)
    assert parts == {"params": 4 * 240 / 2, "grads": 4 * 240 / 2, "optimizer": 8 * 240 / 2}
    no_zero = tp_costs.state_bytes_per_rank(800, 40, tp=4, dp=2, zero_stage=0)
    assert no_zero["params"] == 4 * 240


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="positive"):
        tp_costs.activation_bytes_per_layer(0, 1, 8, 2)
    with pytest.raises(ValueError, match="positive"):
        tp_costs.comm_bytes_per_layer(8, 1, 8, tp=0)


def test_layouts_must_cover_the_world() -> None:
    assert launch.layouts("4x1,2x2,1x4", 4) == [(4, 1), (2, 2), (1, 4)]
    assert launch.layouts("", 2) == [(2, 1)]
    with pytest.raises(ValueError, match="layout 2x1 needs 2 ranks, the launch has 4"):
        launch.layouts("4x1,2x1", 4)


@pytest.fixture
def one_rank_group():
    """A gloo process group of one rank, in this process."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", store=dist.FileStore(f"{d}/store", 1), rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


class _TwoRanks(TPGroup):
    """Says it has 2 ranks: enough for the size checks, which run before any collective."""

    size = 2  # type: ignore[assignment]
    rank = 0  # type: ignore[assignment]


def test_tp_block_on_one_rank_and_its_size_checks(one_rank_group) -> None:
    block = build_model(RunConfig(d_model=24, n_heads=3, seq_len=6)).blocks[0]
    tp, counter = TPGroup(), ByteCounter()
    x = torch.randn(2, 6, 24)
    with counted(counter):
        out = TPBlock(block, tp, sequence_parallel=True, regather=True)(x)
    assert torch.allclose(out, block(x), atol=1e-6) and counter.bytes == 0  # one rank sends nothing
    with pytest.raises(ValueError, match="3 heads do not split over 2 ranks"):
        TPBlock(block, _TwoRanks())
    with pytest.raises(ValueError, match="sequence length divisible by 2"):
        _TwoRanks().reduce_scatter(torch.randn(2, 5, 3), dim=1)
    with pytest.raises(ValueError, match="sequence_parallel"):
        ColumnParallelLinear(block.mlp[0], tp, regather=True)
    with pytest.raises(ValueError, match="do not split over"):
        ColumnParallelLinear(torch.nn.Linear(4, 3), _TwoRanks())



def test_regathering_block_trains_under_bf16_autocast(one_rank_group) -> None:
    # the regathering linear's backward runs outside autocast: it casts the weight and the shard to the gradient's
    # bf16 as the forward's autocast did (a float32 weight against a bf16 gradient would not multiply)
    block = build_model(RunConfig(d_model=24, n_heads=3, seq_len=6)).blocks[0]
    split = TPBlock(block, TPGroup(), sequence_parallel=True, regather=True)
    x = torch.randn(2, 6, 24, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = split(x)
    out.float().pow(2).mean().backward()
    assert x.grad.dtype == torch.float32 and all(p.grad.dtype == torch.float32 for p in split.parameters())
    assert all(torch.isfinite(p.grad).all() for p in split.parameters())

def test_dtensor_meter_agrees_with_the_plain_one() -> None:
    block = build_model(RunConfig(d_model=32, seq_len=8)).blocks[0]
    x = torch.randn(2, 8, 32, requires_grad=True)
    plain = memory.saved_activation_bytes(lambda: block(x), exclude=list(block.parameters()))
    assert saved_bytes_in([block], lambda: block(x)) == plain > 0


# ----- 4 ranks -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rep() -> TPReport:
    out = launch.run("course_lib.experiments.workers.tp_compare", WORLD,
                     ["--tasks", "ops,byhand,api,mesh,vocab", "--cfg", CFG.to_json(), "--layouts", "2x2,1x4"],
                     timeout=240)
    return TPReport.from_dict(out)


def _elem(dtype: str) -> int:
    return {"float64": 8, "float32": 4}[dtype]


def _extras(b: int, s: int, s_norm: int, elem: int) -> int:
    """What a block saves beyond the paper's terms: 2 LayerNorms x (mean, rstd) per row, the s x s causal mask."""
    return 2 * 2 * b * s_norm * elem + s * s


@pytest.mark.slow
def test_f_and_g(rep: TPReport) -> None:
    ops, total = rep.ops, rep.ops["sum_of_values"]  # rank r holds r + 1: the sum is 10
    assert total == 10
    assert ops["f"] == {"forward": 1.0, "backward": total}, "f: identity forward, all-reduce backward"
    assert ops["g"] == {"forward": total, "backward": 1.0}, "g: all-reduce forward, identity backward"
    assert ops["gather_seq"]["rows_of_rank"] == [1.0, 2.0, 3.0, 4.0] and ops["gather_seq"]["backward"] == WORLD
    assert ops["reduce_scatter_seq"]["forward"] == total
    assert ops["reduce_scatter_seq"]["backward_rows"] == [1.0, 2.0, 3.0, 4.0]


@pytest.mark.slow
def test_shard_shapes(rep: TPReport) -> None:
    h = CFG.d_model
    for t in (2, 4):
        shapes = rep.block("tp", t).local_shapes
        assert shapes["attn.qkv.weight"] == [3 * h // t, h] and shapes["attn.qkv.bias"] == [3 * h // t]
        assert shapes["attn.proj.weight"] == [h, h // t] and shapes["attn.proj.bias"] == [h]
        assert shapes["mlp.0.weight"] == [4 * h // t, h] and shapes["mlp.2.weight"] == [h, 4 * h // t]
        assert shapes["ln1.weight"] == [h]
    assert rep.block("api_tp", 4).local_shapes == rep.block("tp", 4).local_shapes


@pytest.mark.slow
def test_split_blocks_equal_one_process(rep: TPReport) -> None:
    assert {(b.method, b.tp) for b in rep.blocks} >= {(m, t) for m in ("tp", "sp", "sp_regather") for t in (2, 4)}
    for b in rep.blocks:
        tol = 1e-12 if b.dtype == "float64" else 1e-5
        for what in ("out_diff", "input_grad_diff", "param_grad_diff"):
            assert getattr(b, what) < tol, f"{b.method} t={b.tp} {b.dtype}: {what} = {getattr(b, what)}"


@pytest.mark.slow
def test_bytes_sent_per_block(rep: TPReport) -> None:
    """Counted bytes against the sizes of the activations that move, computed here."""
    for b in rep.blocks:
        x = CFG.batch * CFG.seq_len * CFG.d_model * _elem(b.dtype)  # one (b, s, h) activation
        t = b.tp
        if b.method in ("tp", "api_tp"):
            assert b.calls_forward == {"all_reduce": 2} and b.calls_backward == {"all_reduce": 2}
            assert b.sent_forward["all_reduce"] == b.sent_backward["all_reduce"] == 2 * 2 * (t - 1) / t * x
        elif b.method == "api_sp_local":  # plain tensors between the regions: all-reduces where RS would do
            assert b.calls_backward == {"all_gather": 2, "all_reduce": 2}
            assert b.sent_backward["all_reduce"] == 2 * 2 * (t - 1) / t * x
            continue
        else:
            regather = b.method == "sp_regather"
            assert b.calls_forward == {"all_gather": 2, "reduce_scatter": 2}
            assert b.calls_backward == {"all_gather": 2 + 2 * regather, "reduce_scatter": 2}
            assert b.sent_backward["all_gather"] == (2 + 2 * regather) * (t - 1) / t * x
            assert b.sent_forward["reduce_scatter"] == 2 * (t - 1) / t * x
        if b.method.startswith("sp"):  # LayerNorms and row biases: 6h gradients summed once
            assert b.sync_bytes == 2 * (t - 1) / t * 6 * CFG.d_model * _elem(b.dtype)
        # and the prediction function the planner uses
        sp = b.method in ("sp", "sp_regather", "api_sp")
        want = tp_costs.comm_bytes_per_layer(CFG.seq_len, CFG.batch, CFG.d_model, t, sp,
                                             regather=b.method == "sp_regather", act_bytes=_elem(b.dtype))
        sent = {k: b.sent_forward.get(k, 0) + b.sent_backward.get(k, 0) for k in want}
        assert sent == pytest.approx(want)


@pytest.mark.slow
def test_activations_per_rank(rep: TPReport) -> None:
    s, bsz, h, a = CFG.seq_len, CFG.batch, CFG.d_model, CFG.n_heads
    for dtype in ("float64", "float32"):
        e = _elem(dtype)
        assert rep.ref_saved_bytes[dtype] == 4 * e * 4 * s * bsz * h + e * a * s * s * bsz + _extras(bsz, s, s, e)
        assert rep.ref_saved_bytes[dtype] == tp_costs.activation_bytes_per_layer(
            s, bsz, h, a, act_bytes=e, dropout=False) + _extras(bsz, s, s, e)
    for b in rep.blocks:
        e, t = _elem(b.dtype), b.tp
        sp, regather = b.method in ("sp", "sp_regather", "api_sp", "api_sp_local"), b.method == "sp_regather"
        want = tp_costs.activation_bytes_per_layer(s, bsz, h, a, t, sp, act_bytes=e, dropout=False,
                                                   regather=regather)
        assert b.saved_bytes == [want + _extras(bsz, s, s // t if sp else s, e)] * WORLD, f"{b.method} t={t}"


def _param_split(cfg: RunConfig) -> tuple[int, int]:
    """(parameters TP splits, parameters kept whole), counted from the model's own tensors."""
    model = build_model(cfg)
    split_names = ("attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight", "mlp.0.weight", "mlp.0.bias",
                   "mlp.2.weight")
    split = sum(p.numel() for n, p in model.named_parameters() if n.endswith(split_names))
    return split, sum(p.numel() for p in model.parameters()) - split


@pytest.mark.slow
def test_mesh_training_equals_one_process(rep: TPReport) -> None:
    for dp, tp in ((2, 2), (1, 4)):
        exact = rep.mesh(dp, tp, "float64")
        assert exact.max_param_diff < 1e-10 and exact.max_loss_diff < 1e-12
        assert rep.mesh(dp, tp, "float32").max_loss_diff < 1e-5
    tp_only = rep.mesh(1, 4)  # no FSDP: the LayerNorms' partial gradients reach the optimizer
    assert tp_only.partial_grads == 4 * CFG.n_layers  # 2 LayerNorms x (weight, bias) per block
    assert tp_only.lazy_optimizer_calls == {"all_reduce": 3 * 4 * CFG.n_layers}  # Adam reads each 3 times
    assert rep.mesh(2, 2).partial_grads == 0  # FSDP2 summed them in its gradient reduction
    placements = rep.mesh(2, 2).param_placements
    assert placements["blocks.0.attn.proj.weight"] == "(Shard(dim=0), Shard(dim=1))"  # FSDP rows, TP columns


@pytest.mark.slow
def test_mesh_memory_per_rank(rep: TPReport) -> None:
    split, whole = _param_split(CFG)
    tensors = len(list(build_model(CFG).parameters()))
    s, h, a, L = CFG.seq_len, CFG.d_model, CFG.n_heads, CFG.n_layers
    for dp, tp in ((2, 2), (1, 4)):
        m = rep.mesh(dp, tp)
        per_rank = (split / tp + whole) / dp
        for held in m.held:
            assert held["params"] == held["grads"] == 4 * per_rank
            assert held["optimizer"] == 8 * per_rank + 4 * tensors  # Adam's moments, and a step count per tensor
        formula = tp_costs.state_bytes_per_rank(split, whole, tp, dp)
        assert m.held[0]["params"] == formula["params"]
        b = CFG.batch // dp  # each dp rank its rows; SP cuts the sequence over tp
        want = L * (tp_costs.activation_bytes_per_layer(s, b, h, a, tp, True, act_bytes=4, dropout=False,
                                                         regather=False) + _extras(b, s, s // tp, 4))
        assert m.saved_bytes == [want] * WORLD, "torch's SP keeps the gathered linear inputs whole"


@pytest.mark.slow
def test_mesh_traffic(rep: TPReport) -> None:
    s, h, L = CFG.seq_len, CFG.d_model, CFG.n_layers
    m = rep.mesh(2, 2)
    x = s * (CFG.batch // 2) * h * 4  # one (b, s, h) activation of a dp rank, fp32
    # blocks: 4 reduce-scatters per layer; all-gathers: 4 per layer, the head's input and the embedding's gradient
    assert m.tp_sent_per_step["reduce_scatter"] == L * 4 * 1 / 2 * x
    assert m.tp_sent_per_step["all_gather"] == (L * 4 + 2) * 1 / 2 * x
    assert m.tp_sent_per_step["all_reduce"] == 2 * 1 / 2 * L * 4 * h * 4  # the LayerNorms' partial gradients
    split, whole = _param_split(CFG)
    tp_rank_bytes = 4 * (split / 2 + whole)  # what one TP rank holds before FSDP shards it
    assert m.dp_sent_per_step == {"all_gather": pytest.approx(2 * 1 / 2 * tp_rank_bytes),
                                  "reduce_scatter": pytest.approx(1 / 2 * tp_rank_bytes)}


def test_tp_block_refuses_to_train_with_dropout(one_rank_group) -> None:
    model = build_model(RunConfig(d_model=24, n_heads=3, seq_len=6))
    block = type(model.blocks[0])(24, 3, 6, dropout=0.1)  # the same block with attention dropout
    tpb = TPBlock(block, TPGroup())
    x = torch.randn(2, 6, 24)
    with pytest.raises(ValueError, match="same masks for different heads"):
        tpb(x)
    tpb.eval(), block.eval()  # inference: no dropout, no masks to share
    assert torch.allclose(tpb(x), block(x), atol=1e-6)


def test_sync_replicated_grads_only_under_sequence_parallelism(one_rank_group) -> None:
    block = build_model(RunConfig(d_model=24, n_heads=3, seq_len=6)).blocks[0]
    for sp, calls in ((False, {}), (True, {"all_reduce": 1})):
        tpb = TPBlock(block, TPGroup(), sequence_parallel=sp)
        tpb(torch.randn(2, 6, 24)).sum().backward()
        counter = ByteCounter()
        with counted(counter):
            sync_replicated_grads(tpb, TPGroup())
        # without sequence parallelism the replicated gradients are complete: a sum over t ranks would scale them
        assert counter.calls == calls, sp
    mixed = torch.nn.Sequential(TPBlock(block, TPGroup()), TPBlock(block, TPGroup(), sequence_parallel=True))
    with pytest.raises(ValueError, match="mixes"):
        sync_replicated_grads(mixed, TPGroup())


# ----- the vocabulary split ------------------------------------------------------------------


def test_vocab_parallel_formulas() -> None:
    s, b, h, v = 2048, 1, 12288, 51200
    for t in (2, 8):
        ar = 2 * (t - 1) / t
        parts = tp_costs.vocab_parallel_bytes(s, b, h, t)
        assert parts == {"embedding": pytest.approx(ar * 2 * s * b * h), "head": pytest.approx(ar * 2 * s * b * h),
                         "loss": pytest.approx(3 * ar * 2 * s * b)}
        gathered = tp_costs.gathered_logits_bytes(s, b, v, t)
        assert gathered == pytest.approx((t - 1) / t * 2 * s * b * v)
        assert parts["loss"] / gathered == pytest.approx(6 / v), "3 all-reduces of s·b numbers against s·b·v logits"
    with pytest.raises(ValueError, match="positive"):
        tp_costs.gathered_logits_bytes(8, 1, 0, 2)


def test_vocab_parallel_pieces_on_one_rank(one_rank_group) -> None:
    tp = TPGroup()
    emb = torch.nn.Embedding(10, 4).double()
    ids = torch.tensor([[0, 3, 9], [9, 1, 1]])
    assert torch.equal(VocabParallelEmbedding(emb, tp)(ids), emb(ids))
    logits = torch.randn(2, 3, 10, dtype=torch.float64, requires_grad=True)
    loss = vocab_parallel_cross_entropy(logits, ids, tp)
    ref = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten(), reduction="none").view(2, 3)
    assert torch.allclose(loss, ref, atol=1e-14, rtol=0)
    # the hand-written backward against finite differences
    assert torch.autograd.gradcheck(lambda z: vocab_parallel_cross_entropy(z, ids, tp), (logits,))
    with pytest.raises(ValueError, match="does not split over 2 ranks"):
        vocab_range(11, _TwoRanks())
    assert vocab_range(10, _TwoRanks()) == (0, 5)


@pytest.mark.slow
def test_vocab_parallel_equals_one_process(rep: TPReport) -> None:
    assert sorted(v.tp for v in rep.vocab) == [2, 4]
    for v in rep.vocab:
        assert v.dtype == "float64" and v.loss > 0
        assert v.loss_diff < 1e-12, f"t={v.tp}: loss off by {v.loss_diff}"
        assert set(v.grad_diff) == {"embed.tok", "embed.pos", "head.ln", "head.out.weight", "head.out.bias"}
        assert all(d < 1e-12 for d in v.grad_diff.values()), f"t={v.tp}: {v.grad_diff}"


@pytest.mark.slow
def test_vocab_parallel_bytes(rep: TPReport) -> None:
    s, b, h, v = CFG.seq_len, CFG.batch, CFG.d_model, CFG.vocab
    for r in rep.vocab:
        assert r.calls == {"embedding": {"all_reduce": 1}, "loss": {"all_reduce": 3}, "head": {"all_reduce": 1}}
        want = tp_costs.vocab_parallel_bytes(s, b, h, r.tp, act_bytes=8)
        assert r.sent == pytest.approx(want)
        assert r.sent["loss"] == 3 * 2 * (r.tp - 1) / r.tp * s * b * 8  # three (b, s) float64 tensors
        gathered = tp_costs.gathered_logits_bytes(s, b, v, r.tp, act_bytes=8)
        assert r.sent["loss"] / gathered == pytest.approx(6 / v)

