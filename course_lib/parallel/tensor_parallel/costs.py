"""What tensor and sequence parallelism cost, in formulas (chapter 10; the capstone's planner uses them).

Notation of Korthikanti et al. 2022: s the sequence length, b the micro-batch, h the width, a the heads, t the
tensor-parallel size, d the data-parallel size, v the vocabulary. The layer is the course's ``TransformerBlock``
(GPT-2's: pre-norm, fused QKV, a 4h MLP with GELU), which is also the paper's. Per rank: the model states
(``block_param_split``, ``state_bytes_per_rank``), the activations a layer saves (``activation_bytes_per_layer``),
the bytes its collectives send (``comm_bytes_per_layer``, against its matmuls: ``comm_over_compute``) and the
vocabulary split's (``vocab_parallel_bytes``, against gathering the logits: ``gathered_logits_bytes``).
"""

from __future__ import annotations

from course_lib.parallel.collectives import ring_factor
from course_lib.parallel.sharding.zero import zero_bytes_per_rank


def _check_sizes(**sizes: int) -> None:
    for name, value in sizes.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def block_param_split(h: int) -> tuple[int, int]:
    """(parameters TP splits, parameters every TP rank keeps whole) of one block of width h. Split: QKV 3h² + 3h, output
    projection h², MLP 4h² + 4h and 4h² (12h² + 7h). Whole: the two LayerNorms 4h, the row-parallel biases 2h (6h)."""
    _check_sizes(h=h)
    return 12 * h * h + 7 * h, 6 * h


def state_bytes_per_rank(split_params: float, whole_params: float, tp: int = 1, dp: int = 1, zero_stage: int = 3,
                         param_bytes: int = 4, grad_bytes: int = 4, optimizer_bytes: int = 8) -> dict[str, float]:
    """Bytes of ``params``, ``grads``, ``optimizer`` one rank holds on a dp x tp mesh: each TP rank holds
    ``split_params / tp + whole_params`` parameters; ZeRO ``zero_stage`` over the ``dp`` ranks divides those (3 = FSDP).
    Defaults: fp32 Adam, 4 + 4 + 8 bytes per parameter (``zero.zero_bytes_per_rank``)."""
    _check_sizes(tp=tp, dp=dp)
    per_tp_rank = split_params / tp + whole_params
    return zero_bytes_per_rank(per_tp_rank, dp, zero_stage, param_bytes, grad_bytes, optimizer_bytes)


def activation_bytes_per_layer(s: int, b: int, h: int, a: int, tp: int = 1, sequence_parallel: bool = False,
                               act_bytes: int = 2, mask_bytes: int = 1, dropout: bool = True,
                               regather: bool = True) -> float:
    """Bytes one rank saves for the backward of one transformer layer (Korthikanti et al. 2022, Table 2). Defaults give
    the paper's 34sbh + 5as²b at t = 1, sbh(10 + 24/t + 5as/ht) under TP (all but the 10sbh of the LayerNorm regions
    divided by t) and sbh/t (34 + 5as/h) under TP + SP. ``act_bytes``: bytes per saved element (4 in fp32).
    ``dropout=False``: a layer without dropout (the course's blocks): no masks, no dropped-out attention copy.
    ``regather=False``: the sequence-parallel linears save their gathered input, t times the shard, as torch's
    ``SequenceParallel`` does; the paper (and Megatron-LM) save the shard."""
    _check_sizes(s=s, b=b, h=h, a=a, tp=tp)
    sbh = s * b * h
    norms = 2 * sbh * act_bytes                     # the inputs of the two LayerNorms
    linear_inputs = 2 * sbh * act_bytes             # the inputs of QKV and of the MLP's first linear
    masks = 2 * sbh * mask_bytes if dropout else 0  # dropout after attention and after the MLP
    # Q, K, V (3), the output projection's input (1), GELU's input (4), the second linear's input (4)
    split = 12 * sbh * act_bytes
    # softmax output; with dropout its mask and the dropped-out copy that att @ v saves
    scores = a * s * s * b * (act_bytes + (mask_bytes + act_bytes if dropout else 0))
    per_rank = (split + scores) / tp
    if not sequence_parallel:
        return per_rank + norms + linear_inputs + masks
    return per_rank + (norms + masks) / tp + (linear_inputs / tp if regather else linear_inputs)


def norm_stats_bytes(s: int, b: int, tp: int = 1, sequence_parallel: bool = False, stats_bytes: int = 4) -> float:
    """Bytes the two LayerNorms of a layer save besides their inputs: a mean and a reciprocal standard deviation
    per position they normalise (this rank's positions under sequence parallelism). The paper leaves them out."""
    _check_sizes(s=s, b=b, tp=tp)
    return 2 * 2 * s * b / (tp if sequence_parallel else 1) * stats_bytes


def saved_fraction_per_rank(s: int, h: int, a: int, tp: int, sequence_parallel: bool = False, act_bytes: int = 4,
                            dropout: bool = False, regather: bool = False) -> float:
    """The share of what one layer saves per sequence that each of ``tp`` ranks keeps (1 at ``tp = 1``): Table 2's
    terms and the LayerNorms' statistics (``act_bytes`` each); the causal mask (s² bytes a layer saves once per
    micro-batch, whole on every rank) is not per sequence, so not in it. The defaults: the course's block in fp32
    under torch's ``SequenceParallel`` (no dropout, gathered inputs saved)."""
    def per_rank(t: int) -> float:
        return (activation_bytes_per_layer(s, 1, h, a, t, sequence_parallel, act_bytes, dropout=dropout,
                                           regather=regather)
                + norm_stats_bytes(s, 1, t, sequence_parallel, act_bytes))
    return per_rank(tp) / per_rank(1)


def collectives_per_layer(sequence_parallel: bool = False, regather: bool = True) -> dict[str, tuple[int, int]]:
    """How many of each collective one layer runs per micro-batch: ``{op: (forward, backward)}``."""
    if not sequence_parallel:
        return {"all_reduce": (2, 2)}  # g after attention and after the MLP; f before each, backward
    # forward: all-gather before each column-parallel linear, reduce-scatter after each row-parallel one;
    # backward: the conjugates, plus the regather of the two saved shards
    return {"all_gather": (2, 2 + 2 * regather), "reduce_scatter": (2, 2)}


def comm_bytes_per_layer(s: int, b: int, h: int, tp: int, sequence_parallel: bool = False,
                         regather: bool = True, act_bytes: int = 2) -> dict[str, float]:
    """Bytes one rank sends per layer per micro-batch (forward + backward), ring algorithm, by collective. Every
    collective moves one (s, b, h) activation: an all-reduce sends 2(t-1)/t of it, an all-gather or a reduce-scatter
    (t-1)/t; SP's pair sends what TP's all-reduce does. Not included: under SP, the once-per-step sum of the replicated
    parameters' gradients (6h per layer: ``block_param_split``)."""
    _check_sizes(s=s, b=b, h=h, tp=tp)
    activation = s * b * h * act_bytes
    return {op: (fwd + bwd) * ring_factor(op, tp) * activation
            for op, (fwd, bwd) in collectives_per_layer(sequence_parallel, regather).items()}


def layer_flops(s: int, b: int, h: int) -> float:
    """FLOPs of one layer's forward and backward: 3 x (24bsh² + 4bs²h) (Narayanan et al. 2021, appendix A)."""
    _check_sizes(s=s, b=b, h=h)
    return 3 * (24 * b * s * h * h + 4 * b * s * s * h)


def comm_over_compute(s: int, h: int, tp: int, flops_per_s: float, bytes_per_s: float, act_bytes: int = 2) -> float:
    """Seconds of TP's collectives per second of matmuls in one layer, on devices of the given speeds. Both grow like
    s·b, so the batch cancels: a larger batch cannot hide TP's traffic behind more compute (data parallelism's
    gradient all-reduce is once per step and can). ``bytes_per_s``: what one rank sends per second."""
    comm_s = sum(comm_bytes_per_layer(s, 1, h, tp, act_bytes=act_bytes).values()) / bytes_per_s
    compute_s = layer_flops(s, 1, h) / tp / flops_per_s
    return comm_s / compute_s


def vocab_parallel_bytes(s: int, b: int, h: int, tp: int, act_bytes: int = 2) -> dict[str, float]:
    """Bytes one rank sends per micro-batch for the vocabulary split (``vocab_parallel``), by part, ring algorithm.
    ``embedding``: ``g``'s all-reduce of the (s, b, h) embeddings, forward. ``head``: ``f``'s all-reduce of the head
    input's gradient, backward. ``loss``: three all-reduces of s·b numbers (the max, the target's logit, the sum of
    exp), forward; its backward sends nothing."""
    _check_sizes(s=s, b=b, h=h, tp=tp)
    all_reduce = ring_factor("all_reduce", tp) * act_bytes
    return {"embedding": all_reduce * s * b * h, "head": all_reduce * s * b * h, "loss": 3 * all_reduce * s * b}


def gathered_logits_bytes(s: int, b: int, v: int, tp: int, act_bytes: int = 2) -> float:
    """Bytes one rank sends to gather the whole (s, b, v) logits from their vocabulary slices instead: one
    all-gather, (t-1)/t of them. Against ``vocab_parallel_bytes(...)["loss"]``: a ratio of 6/v."""
    _check_sizes(s=s, b=b, v=v, tp=tp)
    return ring_factor("all_gather", tp) * s * b * v * act_bytes
