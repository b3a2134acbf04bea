"""Predict a ``Config``'s peak bytes and step time from the ``Measurements``: arithmetic only (chapter 13, section 3).

Checkpointing follows from the bytes one block saves (chapter 05; Chen et al. 2016: ``k - 1`` segment inputs
kept, at most ``ceil(n/k)`` blocks rebuilt at once); ZeRO divides the states (``memory.zero_memory``) and adds
what is in flight (chapter 09). Tensor parallelism over ``t`` of the ``world = d x t`` ranks splits the blocks'
weights and what they save per sequence (``tp_costs``, chapter 10); ZeRO then runs over the ``d`` data-parallel
ranks. Fused attention is another kernel, measured like a precision (its own line); offloading and the chunked
loss are chapter 11's formulas on top of a measured pass (``offload.predict_offload_peak``,
``chunked_loss.predict_loss_peak``). Time is relative, since timings on a busy machine are noisy:
``A (alpha + beta m)(1 + recompute + extra head) + update + communication / bandwidth + offload traffic / host
bandwidth``, with data parallelism's traffic (chapters 07 and 09) at an inter-node bandwidth and tensor
parallelism's per-layer collectives at an intra-node one. Context parallelism over ``c`` ranks (chapter 12) keeps
``1/c`` of every sequence's activations on a rank and the states whole (ZeRO may shard them over all the
``world / t`` ranks); its ring's key/value blocks travel at the intra-node bandwidth.
"""

from __future__ import annotations

import dataclasses
import math

from course_lib import chunked_loss, offload
from course_lib.checkpointing import recomputed_blocks, segment_plan
from course_lib.parallel.context_parallel import ring_attention as context_parallel
from course_lib.parallel.tensor_parallel import costs as tp_costs
from course_lib.parallel.sharding.zero import MAX_IN_FLIGHT, zero_bytes_per_rank
from course_lib.planner.config import Config
from course_lib.planner.measure import Measurements

# A backward costs about two forwards (6N FLOPs per token, 2N forward + 4N backward; Kaplan et al. 2020,
# section 2.1): rerunning a forward costs a third of a step.
FORWARD_SHARE = 1 / 3
# Data parallelism's traffic (gradients; ZeRO-3's gathers): one PCIe 4.0 x16 link moves about 25 GB/s in
# practice (nominal 32 GB/s), as does a 200 Gb/s InfiniBand port between nodes; pass your interconnect's measured
# all-reduce bandwidth instead (chapter 07).
DEFAULT_BANDWIDTH = 25e9
# Tensor parallelism's per-layer collectives stay inside a node (chapter 10): NVLink 4 moves 450 GB/s each way
# per H100 SXM GPU (NVIDIA's Hopper architecture page; nominal, a real all-reduce reaches less).
DEFAULT_TP_BANDWIDTH = 450e9
# Offloaded activations cross the host link twice per byte (chapter 11): PCIe 4.0 x16 again, about 25 GB/s in
# practice (PCIe 5.0 x16 doubles it). ``offload.OffloadToHost`` copies on the compute stream: the copies add to
# the step's time instead of hiding behind it.
DEFAULT_HOST_BANDWIDTH = 25e9



def activation_bytes(precision: str) -> int:
    """Bytes of an activation between ops: 2 under bf16 autocast; 4 in fp32, and in fp8, whose blocks run in float32
    but for their matmuls (FP8 copies saved inside them are measured, not derived: an estimate under TP)."""
    return 2 if precision == "bf16" else 4

def tp_shares(meas: Measurements, config: Config, world_size: int) -> tuple[int, float, float]:
    """(data-parallel ranks, share of the model states, share of one block's parameters) one rank keeps under
    ``config.tp``-way tensor parallelism: ``1/t`` of the split weights and all of the others (chapter 10)."""
    t, layers = config.tp, meas.layers
    if t < 1 or world_size % t:
        raise ValueError(f"tensor-parallel size {t} does not divide the {world_size} ranks")
    if t == 1:
        return world_size, 1.0, 1.0
    if layers is None or layers.heads % t:
        raise ValueError(f"tensor parallelism over {t} ranks needs transformer blocks whose heads {t} divides")
    if config.sequence_parallel and layers.seq_len % t:
        raise ValueError(f"sequence parallelism over {t} ranks cuts the sequence: {layers.seq_len} tokens do not "
                         f"split; choose a sequence length divisible by {t}")
    return (world_size // t, layers.split_share / t + 1 - layers.split_share,
            layers.block_split_share / t + 1 - layers.block_split_share)


def _measured(meas: Measurements, line: str, config: Config) -> tuple[float, float]:
    """``config``'s measured line ``line`` (``fb``, ``block``, ``time``, ``loss``, ``packed``), or a clear error."""
    lines = getattr(meas, line)
    if config.pass_key not in lines:
        what = {"loss": "the peak of the loss alone (measured for a loss that can be chunked)",
                "packed": "the bytes offloading copies (measured by plan(..., offload=True))"}.get(
                    line, f"the {config.pass_key} pass")
        raise ValueError(f"these measurements lack {what} for {config.describe()}; they have {sorted(lines)}")
    return lines[config.pass_key]


def block_saves(meas: Measurements, config: Config) -> tuple[float, float, float]:
    """Bytes one block saves for backward on one rank, ``(constant, per sample)``, and its output per sample.

    Measured on the whole block; under tensor parallelism each rank keeps the share of the per-sample part that
    ``tp_costs.saved_fraction_per_rank`` gives (torch's ``SequenceParallel``: gathered inputs saved), and with
    sequence parallelism its shard of the output. The constant part (the causal mask; under autocast also bf16
    weight copies, which TP would split too: an overestimate) stays whole.
    """
    const, per_sample = _measured(meas, "block", config)
    boundary = meas.boundary_per_sample.get(config.pass_key, 0.0)
    if config.tp == 1:
        return const, per_sample, boundary
    layers, sp = meas.layers, config.sequence_parallel
    kept = tp_costs.saved_fraction_per_rank(layers.seq_len, layers.width, layers.heads, config.tp, sp,
                                            act_bytes=activation_bytes(config.precision), dropout=layers.dropout)
    return const, per_sample * kept, boundary / (config.tp if sp else 1)


def pipeline_terms(config: Config, n_blocks: int) -> dict:
    """Chapter 08's costs of ``config``'s ``pp``-stage pipeline (``virtual_stages = v``; ``A`` = accumulation steps).

    The ``A`` micro-batches of a step run 1F1B: ``bubble`` ``(p-1)/(v A + p-1)``; ``inflight``, the micro-batches
    whose activations the first stage holds, ``min(p, A)`` (interleaved: ``p (1 + (p-1)/(p v))``, Korthikanti et
    al. 2022); ``crossings``, stage boundaries one micro-batch crosses forward and back, ``2 (p v - 1)``.
    """
    p, v, a = config.pp, config.virtual_stages, config.accumulation_steps
    if n_blocks % (p * v):
        raise ValueError(f"{n_blocks} blocks do not cut into {p} stages of {v} chunks: choose pp x virtual_stages "
                         f"dividing {n_blocks}")
    if v > 1 and a % p:
        raise ValueError(f"interleaved 1F1B runs micro-batches in groups of pp = {p}: use a number of "
                         f"accumulation steps that is a multiple of {p} (got {a})")
    inflight = min(p, a) if v == 1 else p * (1 + (p - 1) / (p * v))
    return {"bubble": (p - 1) / (v * a + p - 1), "inflight": inflight, "crossings": 2 * (p * v - 1)}


def _pipeline_peak(meas: Measurements, config: Config, world_size: int) -> dict:
    """The first stage's peak: ``1/p`` of the model states, and ``inflight`` micro-batches of ``1/p`` of one pass's
    activations (an upper estimate: the constant part of a pass, the causal mask, is counted with them)."""
    p = config.pp
    if world_size % p:
        raise ValueError(f"{p} pipeline stages do not divide the {world_size} ranks")
    terms = pipeline_terms(config, meas.n_blocks)
    whole = predict_peak(meas, dataclasses.replace(config, pp=1, virtual_stages=1), world_size // p)
    scale = terms["inflight"] / p if whole["where"] == "forward/backward" else 1 / p
    out = {k: int(math.ceil(whole[k] / p)) for k in ("params", "grads", "optimizer")}
    out.update(batch=whole["batch"], transient=int(math.ceil(whole["transient"] * scale)))
    out["total"] = sum(out.values())
    out["where"] = whole["where"]
    return out


def predict_peak(meas: Measurements, config: Config, world_size: int = 1) -> dict:
    """Predicted peak bytes on one rank: ``params, grads, optimizer, batch, transient, total`` and ``where``.

    ``transient`` is the larger of the forward/backward part (activations, temporaries, what ZeRO has in flight)
    and the optimizer step's temporaries; ``where`` names it. The forward/backward part assumes the gradients
    exist, as they do from the second micro-batch on: a single micro-batch is overstated by up to its gradients,
    never understated (at any moment of its backward some exist, and no more activations than at the start).
    Offload and the chunked loss are chapter 11's formulas: an offloaded pass keeps one block's saves of its ``n``
    (an upper estimate: the backward brings them back one node at a time), and a chunked loss replaces the
    measured peak of the whole loss by ``chunked_loss.predict_loss_peak``.
    """
    if config.pp > 1:
        return _pipeline_peak(meas, config, world_size)
    n, k, m, s = meas.n_blocks, config.segments, config.micro_batch, config.zero_stage
    N, share, block_share = tp_shares(meas, config, world_size)  # N: the ranks ZeRO shards over
    c, slope = _measured(meas, "fb", config)
    _, per_sample, boundary = block_saves(meas, config)
    fb = c + slope * m - n * (_measured(meas, "block", config)[1] - per_sample) * m  # TP: the blocks keep less
    if config.cp > 1:  # every per-sample byte is per position: T/c of them here (an upper estimate of the ring's
        fb = c + (fb - c) / config.cp + cp_in_flight_bytes(meas, config, world_size)  # n x n scores: 1/c²)
    if k > 1:  # keep k-1 segment inputs; rebuild one segment (at most ceil(n/k) blocks) at a time
        # Only the per-sample part of a block's saves goes: the constant part is bf16 weight copies (and
        # buffers), which autocast's cache keeps to the end of the forward pass, checkpointed or not.
        rebuilt = max(len(r) for r in segment_plan(n, k))
        fb -= ((n - rebuilt) * per_sample - (k - 1) * boundary) * m
    if config.offload:  # no recompute: the blocks' saves wait on the host (the constant part stays, as above)
        fb = offload.predict_offload_peak(fb, n, per_sample * m)
    if config.loss_chunks > 1:  # the whole loss's peak out, the chunked loss's in
        whole_c, whole_d = _measured(meas, "loss", config)
        lm = meas.lm
        fb += (chunked_loss.predict_loss_peak(m * lm.tokens, lm.vocab, lm.width, config.loss_chunks)
               - whole_c - whole_d * m)
    # the states: ZeRO's formula, with the bytes one TP rank holds as the bytes of one "parameter"
    states = zero_bytes_per_rank(share, N, s, meas.param_bytes, meas.grad_bytes, meas.optimizer_bytes)
    in_flight = 0.0
    if N > 1 and s == 2:  # ZeroOptimizer: the bucket being filled, those whose reduce-scatter is in flight (each
        # with gloo's copy of it) and this rank's slice
        in_flight = meas.bucket_bytes * share * (1 + MAX_IN_FLIGHT * (1 + meas.gloo) + 1 / N)
    elif N > 1 and s == 3:  # FSDP2: one block gathered, the next prefetched, one block's gradient (and gloo's copy)
        in_flight = meas.unit_bytes * block_share * (3 + meas.gloo)
    opt_tmp = meas.optimizer_tmp_bytes * share / (N if s >= 1 else 1)  # the update runs on this rank's shard
    parts = dict(**states, batch=meas.batch_bytes_per_sample * m * config.accumulation_steps / config.cp,
                 transient=max(fb + in_flight, opt_tmp))
    out: dict = {key: int(math.ceil(v)) for key, v in parts.items()}
    out["total"] = sum(out.values())
    out["where"] = "forward/backward" if fb + in_flight >= opt_tmp else "optimizer step"
    return out


def cp_in_flight_bytes(meas: Measurements, config: Config, world_size: int) -> float:
    """What the ring holds in flight on a rank: the backward's K, V, dK, dV travelling and the next four arriving
    (chapter 12), ``8 m (T/c) h`` activations; an error unless ``2c`` divides ``T`` and ``t c`` the ranks."""
    layers = meas.layers
    if layers is None:
        raise ValueError("context parallelism needs transformer blocks (the planner found none to split)")
    if world_size % (config.cp * config.tp):
        raise ValueError(f"context-parallel size {config.cp} x tensor-parallel {config.tp} does not divide the "
                         f"{world_size} ranks")
    context_parallel.check_layout(layers.seq_len, config.cp)
    act = activation_bytes(config.precision)
    return 8 * config.micro_batch * layers.seq_len / config.cp * layers.width * act


def cp_comm_bytes(meas: Measurements, config: Config) -> float:
    """Bytes one rank sends per optimizer step around the ring (chapter 12): ``context_parallel.ring_bytes_per_layer``
    per block and micro-batch. Not included: the gradients' sum over the ranks, data parallelism's (``comm_bytes``)."""
    if config.cp == 1:
        return 0.0
    layers, act = meas.layers, activation_bytes(config.precision)
    per_block = context_parallel.ring_bytes_per_layer(layers.seq_len, config.micro_batch, layers.width, config.cp,
                                                      act_bytes=act)
    return config.accumulation_steps * meas.n_blocks * sum(per_block.values())


def comm_bytes(param_bytes: int, config: Config, world_size: int) -> float:
    """Bytes one rank sends per optimizer step, in ring collectives (chapter 09), accumulation included.

    DDP (accumulating under ``no_sync``) and ZeRO-1 send twice the ring share ``(N-1)/N x P`` once per step.
    Sharded gradients cannot accumulate locally: ZeRO-2 reduce-scatters after every micro-batch and all-gathers
    once (A + 1); ZeRO-3 also gathers the parameters for every forward and backward (3A). (FSDP2's
    ``set_requires_gradient_sync(False)`` keeps unsharded gradients instead: less traffic, more memory.)
    """
    share = (world_size - 1) / world_size * param_bytes
    a = config.accumulation_steps
    return share * {0: 2, 1: 2, 2: a + 1, 3: 3 * a}[config.zero_stage]


def tp_comm_bytes(meas: Measurements, config: Config) -> float:
    """Bytes one rank sends per optimizer step in tensor parallelism's per-layer collectives (chapter 10).

    Four activation-sized collectives per block and micro-batch (``tp_costs.comm_bytes_per_layer``, gathered
    inputs saved). Left out, as small: the gathers before the head and of the embedding's gradient, and under
    sequence parallelism the once-per-step sum of the LayerNorms' gradients.
    """
    if config.tp == 1:
        return 0.0
    layers, act = meas.layers, activation_bytes(config.precision)
    per_block = tp_costs.comm_bytes_per_layer(layers.seq_len, config.micro_batch, layers.width, config.tp,
                                              config.sequence_parallel, regather=False, act_bytes=act)
    return config.accumulation_steps * meas.n_blocks * sum(per_block.values())


def offload_bytes(meas: Measurements, config: Config) -> float:
    """Bytes over the host link per optimizer step of an offloading ``config`` (``offload.offload_traffic_bytes``)."""
    if not config.offload:
        return 0.0
    c, d = _measured(meas, "packed", config)
    per_block = int(round(c + d * config.micro_batch))
    return config.accumulation_steps * offload.offload_traffic_bytes(meas.n_blocks, per_block)


def step_time_parts(meas: Measurements, config: Config, world_size: int = 1,
                    bandwidth: float = DEFAULT_BANDWIDTH, tp_bandwidth: float = DEFAULT_TP_BANDWIDTH,
                    host_bandwidth: float = DEFAULT_HOST_BANDWIDTH) -> tuple[float, float]:
    """Seconds of one optimizer step without a pipeline, in two parts: ``(per micro-batch, once per step)``.

    Per micro-batch: the forward and backward compute, recomputation, tensor and context parallelism's messages,
    offloading's copies, all of which a pipeline's bubble stalls. Once per step, after the last micro-batch: the
    optimizer's update and data parallelism's gradient traffic, which a pipeline's flush does not stall.
    """
    alpha, beta = _measured(meas, "time", config)
    dp, share, _ = tp_shares(meas, config, world_size)
    # a TP rank runs 1/t of the blocks' FLOPs and all the rest (embedding, head, loss)
    blocks = meas.block_flop_share / config.tp
    work = 1 - meas.block_flop_share + blocks
    recompute = 0.0
    if config.segments > 1:
        recompute = FORWARD_SHARE * blocks / work * recomputed_blocks(meas.n_blocks, config.segments) / meas.n_blocks
    head = FORWARD_SHARE * meas.head_flop_share / work if config.loss_chunks > 1 else 0.0  # one more forward
    compute = (config.accumulation_steps * (alpha + beta * config.micro_batch * work / config.cp)
               * (1 + recompute + head))  # a context-parallel rank runs 1/c of every sequence
    per_micro = (compute + (tp_comm_bytes(meas, config) + cp_comm_bytes(meas, config)) / tp_bandwidth
                 + offload_bytes(meas, config) / host_bandwidth)
    update = meas.optimizer_s * share / (dp if config.zero_stage >= 1 else 1)
    return per_micro, update + comm_bytes(meas.param_bytes * share, config, dp) / bandwidth


def predict_step_time(meas: Measurements, config: Config, world_size: int = 1,
                      bandwidth: float = DEFAULT_BANDWIDTH, tp_bandwidth: float = DEFAULT_TP_BANDWIDTH,
                      host_bandwidth: float = DEFAULT_HOST_BANDWIDTH) -> float:
    """Predicted seconds of one optimizer step: good for ranking configurations, rough in absolute terms.

    ``bandwidth``: bytes per second of data parallelism's collectives; ``tp_bandwidth``: of tensor parallelism's;
    ``host_bandwidth``: of offloading's copies. A chunked loss runs the head's matmul once more (chapter 11). A
    pipeline (``pp > 1``) divides the work by ``p``; only the per-micro-batch part stalls in the bubble, so it
    alone is divided by ``1 - bubble`` (``pipeline_terms``): the update and the gradients' traffic come once, after
    the flush, for the stage's ``1/p`` of the model. It adds the point-to-point messages at ``tp_bandwidth`` (its
    stages sit in one node).
    """
    if config.pp == 1:
        return sum(step_time_parts(meas, config, world_size, bandwidth, tp_bandwidth, host_bandwidth))
    # each stage runs 1/p of the work, idles the bubble, and passes boundaries on
    terms = pipeline_terms(config, meas.n_blocks)
    per_micro, per_step = step_time_parts(meas, dataclasses.replace(config, pp=1, virtual_stages=1),
                                          world_size // config.pp, bandwidth, tp_bandwidth, host_bandwidth)
    boundary = block_saves(meas, config)[2] * config.micro_batch  # a block's output (this rank's shard)
    p2p = terms["crossings"] / config.pp * config.accumulation_steps * boundary  # per rank, at intra-node speed
    return per_micro / config.pp / (1 - terms["bubble"]) + per_step / config.pp + p2p / tp_bandwidth


def pipeline_runs(meas: Measurements, config: Config) -> bool:
    """Whether ``config``'s pipeline can run: its stages cut the blocks, interleaving gets whole groups."""
    try:
        return config.pp == 1 or pipeline_terms(config, meas.n_blocks) is not None
    except ValueError:
        return False
