"""Context parallelism checked against one process (chapter 12): ring attention and the model, both layouts; the
activations a block saves; training; torch's ``context_parallel``; the ring's hops timed against its tiles.

Every rank builds the same model and batch from the same seed (``experiment``) and
runs the single-process reference itself (it is small), so each compares its own
part. ``MeasuredRing`` is the ring with the instruments plugged in (bytes per kind
of message, the work of each pass, seconds per step). ``run_layout`` returns a
``LayoutResult``; the other runs return plain dicts of what they measured, per
rank where a list (``results.gather_per_rank``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib import memory, timing
from course_lib.parallel.collectives import Exchange, nbytes
from course_lib.parallel.context_parallel import layout as cp_layout
from course_lib.parallel.context_parallel import model as cp_model
from course_lib.parallel.context_parallel import ring_attention as cp
from course_lib.experiments.counting import ByteCounter
from course_lib.experiments.dp_methods import Method, profile_or_time
from course_lib.experiments.run_config import RunConfig, build_model, global_batch, local_batch, reference
from course_lib.experiments.results import gather_per_rank, max_abs_diff
from course_lib.experiments.zero_meters import held_bytes
from course_lib.parallel.sharding.zero import ZeroOptimizer
from course_lib.models import TransformerBlock, lm_loss

OPS = {cp.KV_TAG: "ring_kv", cp.KV_BACK_TAG: "ring_kv_bwd", cp.DKV_TAG: "ring_dkv"}  # the counter's name per tag
PASS_OPS = {"forward": ("ring_kv",), "backward": ("ring_kv_bwd", "ring_dkv")}


def sent_per_pass(counter: ByteCounter) -> dict[str, float]:
    """The bytes a ring's ``counter`` counted, forward and backward (``ring_bytes_per_layer``'s two keys)."""
    return {name: sum(counter.by_op.get(op, 0.0) for op in ops) for name, ops in PASS_OPS.items()}


def causal_pairs(T: int, c: int, layout: str = "zigzag") -> list[int]:
    """Query-key pairs each rank's queries attend to under the causal mask: the position p sees p + 1 keys."""
    return [int((cp_layout.positions(T, c, r, layout) + 1).sum()) for r in range(c)]


def tile_scores(T: int, c: int, layout: str = "zigzag") -> list[int]:
    """Score elements each rank's forward computes per sequence and head, tiles only: under the zigzag
    ``n^2 + (c-1) n^2/2`` (own block whole, the others' half), ``n = T/c``."""
    pos = [cp_layout.position_list(T, c, r, layout) for r in range(c)]
    return [sum(cp_layout.Tile.of(pos[r], pos[j], "cpu").scores for j in range(c)) for r in range(c)]


def full_block_scores(T: int, c: int, layout: str = "zigzag") -> list[int]:
    """The same count for whole ``n x n`` blocks, masked, every block with a visible pair computed: ``c n^2`` per
    rank under the zigzag (what a kernel that masks but never slices computes)."""
    n, pos = T // c, [cp_layout.position_list(T, c, r, layout) for r in range(c)]
    return [n * n * sum(cp_layout.Tile.of(pos[r], pos[j], "cpu").pairs > 0 for j in range(c)) for r in range(c)]


def block_attention_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, lse: torch.Tensor,
                             delta: torch.Tensor, q_pos: cp_layout.Positions, k_pos: cp_layout.Positions
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block's terms of ``dq, dk, dv`` as a rank computes them (``attend_backward`` on its ``Tile``, zero
    elsewhere): the backward twin of ``ring_attention.block_attention``, for the tests and the notebook's timing."""
    tile = cp_layout.Tile.of(q_pos, k_pos, q.device)
    acc = cp.accumulation_dtype(q.dtype)
    dq, dk, dv = (torch.zeros(t.shape, dtype=acc, device=t.device) for t in (q, k, v))
    if tile.pairs:
        r, c = tile.rows, tile.cols
        dq[..., r, :], dk[..., c, :], dv[..., c, :] = cp.attend_backward(
            q[..., r, :], k[..., c, :], v[..., c, :], do[..., r, :], lse[..., r, :], delta[..., r, :], tile.visible)
    return dq, dk, dv


def sum_grads(model: torch.nn.Module) -> None:
    """Sum every parameter's gradient over the ranks: each rank's tokens gave one term."""
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)


_DP_GROUPS: dict[int, list[dist.ProcessGroup]] = {}  # dp -> its rings' groups, made once per process


def data_parallel_group(dp: int) -> dist.ProcessGroup | None:
    """This rank's ring when the ranks form ``dp`` data-parallel groups of ``world / dp`` consecutive ranks, each
    group one ring over the whole sequence (``None``: the default group). Every rank makes every group, once, as
    ``new_group`` requires. ``Ring.of(T, group=data_parallel_group(dp))`` is this rank's ring."""
    world = dist.get_world_size()
    if dp < 1 or world % dp:
        raise ValueError(f"{dp} data-parallel groups do not divide the {world} ranks")
    if dp == 1:
        return None
    c = world // dp
    if dp not in _DP_GROUPS:
        _DP_GROUPS[dp] = [dist.new_group(list(range(g * c, (g + 1) * c))) for g in range(dp)]
    return _DP_GROUPS[dp][dist.get_rank() // c]


@dataclass
class HopTimes:
    """Seconds per ring step of one pass: computing the step's tile, and waiting for its messages afterwards
    (the part of the transfer the computation did not hide)."""

    compute: list[float] = field(default_factory=list)
    wait: list[float] = field(default_factory=list)


@dataclass
class MeasuredRing(cp.Ring):
    """A ``Ring`` that measures what passes through it, the algorithm untouched.

    ``counter``: the bytes this rank sends, per kind of message (``OPS``); ``pairs``
    and ``scores``: the visible query-key pairs and the score elements of each pass
    (a pass starts at the tile of the rank's own block; a forward's and its
    backward's are the same); inside ``timing(direction, device)``, each step's
    seconds computing and waiting go to ``times[direction]`` (a step starts at its
    tile; on a GPU a sync at each mark, paid only when timing).
    """

    counter: ByteCounter = field(default_factory=ByteCounter)
    pairs: list[int] = field(default_factory=list)
    scores: list[int] = field(default_factory=list)
    times: dict[str, list[HopTimes]] = field(default_factory=dict)
    _clock: list = field(default_factory=list, repr=False, compare=False)  # [HopTimes, device, last mark] or []

    def tile(self, source: int, device: torch.device) -> cp.Tile:
        t = super().tile(source, device)
        if (source - self.rank) % self.world == 0:  # step 0: a new pass
            self.pairs.append(0)
            self.scores.append(0)
        self.pairs[-1] += t.pairs
        self.scores[-1] += t.scores
        if self._clock:
            times = self._clock[0]
            if times.compute:  # the step before ends here
                self._lap("compute")
            times.compute.append(0.0)
            times.wait.append(0.0)
        return t

    def pass_on(self, tensors: list[torch.Tensor], tag: int) -> tuple[Exchange, list[torch.Tensor]]:
        self.counter.add(OPS[tag], sum(nbytes(t) for t in tensors))
        hop, bufs = super().pass_on(tensors, tag)
        return (_TimedHop(hop, self) if self._clock else hop), bufs

    @contextlib.contextmanager
    def timing(self, direction: str, device: torch.device) -> Iterator[HopTimes]:
        """Time the pass run inside: one ``HopTimes`` appended to ``times[direction]``."""
        times = HopTimes()
        self.times.setdefault(direction, []).append(times)
        self._clock[:] = [times, torch.device(device), 0.0]
        self._clock[2] = self._now()
        try:
            yield times
            self._lap("compute")  # the last step ends with the pass
        finally:
            self._clock.clear()

    def _now(self) -> float:
        device = self._clock[1]
        if device.type == "cuda":  # the device's queued work done
            torch.cuda.current_stream(device).synchronize()
        return time.perf_counter()

    def _lap(self, kind: str) -> None:  # the time since the last mark goes to this step's ``kind``
        times, _, last = self._clock
        now = self._now()
        if getattr(times, kind):
            getattr(times, kind)[-1] += now - last
        self._clock[2] = now


class _TimedHop:
    """A hop whose ``wait`` is timed: the time before it is the step's compute, the time inside it its wait."""

    def __init__(self, hop: Exchange, ring: MeasuredRing) -> None:
        self.hop, self.ring = hop, ring

    def wait(self) -> None:
        self.ring._lap("compute")
        self.hop.wait()
        self.ring._lap("wait")


@dataclass
class LayoutResult:
    """One layout's checks; lists hold one entry per rank."""

    layout: str
    attn_out_diff: float         # float64, max |ring - one process| of the output
    attn_grad_diff: float        # ... of dq, dk, dv
    loss_diff: float             # float64 model: the loss
    grad_diff: float             # ... every parameter's gradient, summed over ranks
    pairs: list[int]             # query-key pairs each rank's forward computed (one attention)
    scores: list[int]            # score elements each rank's forward computed (its tiles), per sequence and head
    blocks: list[int]            # key/value blocks each rank computed (masked-out blocks skipped)
    sent_forward: float          # bytes rank 0 sent per layer, float32 model
    sent_backward: float
    calls: dict[str, int]        # messages rank 0 sent per layer


def _gathered(t: torch.Tensor, layout: str, dim: int) -> torch.Tensor:
    return cp_layout.unshard([p.cpu() for p in gather_per_rank(t.detach().cpu())], layout, dim)


def _against_one_process(cfg: RunConfig, x: torch.Tensor, y: torch.Tensor, model: torch.nn.Module,
                         loss: torch.Tensor) -> tuple[float, float]:
    """This rank's loss share and gradients, summed over the ranks, against one process on the whole batch ``x, y``:
    (loss difference, largest gradient difference)."""
    one = build_model(cfg)
    ref = lm_loss(one(x), y)
    ref.backward()
    sum_grads(model)
    total = loss.detach().clone()
    dist.all_reduce(total)
    return abs(total.item() - ref.item()), max_abs_diff([p.grad for p in model.parameters()],
                                                        [r.grad for r in one.parameters()])


def run_layout(cfg: RunConfig, layout: str, device: torch.device) -> LayoutResult:
    """In float64, ring attention of random ``q, k, v`` (output and gradients, every rank's part gathered) and the
    model's loss and gradients against one process; the pairs and scores each rank computed; the bytes per layer."""
    rank, world = dist.get_rank(), dist.get_world_size()
    T, C, H = cfg.seq_len, cfg.d_model, cfg.n_heads
    g = torch.Generator().manual_seed(cfg.seed)
    q, k, v, grad_out = (torch.randn(cfg.batch, H, T, C // H, generator=g, dtype=torch.float64)  # host
                         for _ in range(4))
    ref_q, ref_k, ref_v = (t.clone().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(ref_q, ref_k, ref_v, is_causal=True)
    ref.backward(grad_out)
    ring = MeasuredRing.of(T, layout)
    local = [cp_layout.shard(t, world, rank, layout, dim=2).to(device).requires_grad_() for t in (q, k, v)]
    out = cp.ring_attention(*local, ring)
    out.backward(cp_layout.shard(grad_out, world, rank, layout, dim=2).to(device))
    attn_out = max_abs_diff(_gathered(out, layout, 2), ref)
    attn_grad = max_abs_diff([_gathered(t.grad, layout, 2) for t in local], [ref_q.grad, ref_k.grad, ref_v.grad])
    mine = cp_layout.positions(T, world, rank, layout)
    blocks = sum(int(mine.max() >= cp_layout.positions(T, world, j, layout).min()) for j in range(world))
    # the whole model, float64
    c64 = dataclasses.replace(cfg, dtype="float64")
    x, y = global_batch(c64, 0)
    model = build_model(c64, device)
    loss = cp_model.cp_loss(model, x.to(device), y.to(device), cp.Ring.of(T, layout))
    loss.backward()
    loss_diff, grad_diff = _against_one_process(c64, x, y, model, loss)
    # bytes per layer, float32
    ring32 = MeasuredRing.of(T, layout)
    cp_model.cp_loss(build_model(cfg, device), x.to(device), y.to(device), ring32).backward()
    sent = sent_per_pass(ring32.counter)
    per_layer = {op: n // cfg.n_layers for op, n in ring32.counter.calls.items()}
    return LayoutResult(layout, attn_out, attn_grad, loss_diff, grad_diff, gather_per_rank(ring.pairs[0]),
                        gather_per_rank(ring.scores[0]), gather_per_rank(blocks), sent["forward"] / cfg.n_layers,
                        sent["backward"] / cfg.n_layers, per_layer)


def run_saved(cfg: RunConfig, device: torch.device, dp: int = 1) -> dict[str, list[int]]:
    """Bytes one block saves for the backward: on each rank of the ring (``cp``), and in one process (``one_process``:
    the same code; ``naive``, ``fused``: the course's block). With ``dp`` data-parallel groups
    (``data_parallel_group``), a group's ``batch / dp`` sequences around its ring."""
    ring = MeasuredRing.of(cfg.seq_len, group=data_parallel_group(dp))
    block = build_model(cfg, device).blocks[0]
    params = list(block.parameters())
    x = torch.randn(cfg.batch // dp, cfg.seq_len, cfg.d_model, device=device, requires_grad=True)
    local = cp_layout.shard(x.detach(), ring.world, ring.rank, "zigzag").requires_grad_()
    # the block's input counts: in a model it is the previous block's output, kept for this block's backward
    per_rank = memory.saved_activation_bytes(lambda: cp_model.block_forward(block, local, ring), exclude=params)
    one = memory.saved_activation_bytes(lambda: cp_model.block_forward(block, x, cp.Ring(cfg.seq_len)), exclude=params)
    naive = memory.saved_activation_bytes(lambda: block(x), exclude=params)
    fused = TransformerBlock(cfg.d_model, cfg.n_heads, cfg.seq_len, fused=True).to(device)
    fused.load_state_dict(block.state_dict())
    fused_bytes = memory.saved_activation_bytes(lambda: fused(x), exclude=list(fused.parameters()))
    return {"cp": gather_per_rank(per_rank), "one_process": [one], "naive": [naive], "fused": [fused_bytes]}


def cp_method(cfg: RunConfig, device: torch.device, ring: MeasuredRing, zero_stage: int = 0) -> Method:
    """Adam on the whole model, its step the ring's (zigzag): a ``dp_methods.Method`` whose step returns this rank's
    loss share (a tensor, summed over the ring by the caller).

    Every rank keeps the whole model, so the gradients are summed over all the ranks: by an all-reduce
    (``zero_stage`` 0), or by ``ZeroOptimizer`` (stages 1, 2: Adam's state, and at stage 2 the gradients, sharded
    over all the ranks). ZeroOptimizer averages over its ranks, as DDP does, and a rank's loss is its share of a
    sum: the backward runs on the share times the world, whose mean is the sum.
    """
    if zero_stage not in (0, 1, 2):
        raise ValueError(f"the train task runs ZeRO stages 0-2, got {zero_stage}")
    model = build_model(cfg, device)
    if zero_stage:
        zopt = ZeroOptimizer(model, torch.optim.Adam, zero_stage, bucket_cap_mb=cfg.bucket_mb, lr=cfg.lr)
        zero_grad, update, held = zopt.zero_grad, zopt.step, zopt.state_bytes
    else:
        opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
        # zeroed, not freed: nothing allocated before the CPU profiler's window is freed inside it
        zero_grad = functools.partial(opt.zero_grad, set_to_none=False)
        held = functools.partial(held_bytes, model, opt)  # the states this rank holds, as chapter 01 counts them

        def update() -> None:
            sum_grads(model)
            opt.step()
    scale = dist.get_world_size() if zero_stage else 1

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        zero_grad()
        part = cp_model.cp_local_loss(model, x, y, ring, cfg.batch * cfg.seq_len)
        (part * scale).backward()
        update()
        return part.detach()
    return Method(model, zero_grad, step, held, ring.counter)


PROFILED_STEPS = (1, 2, 3)  # run_train's peak: the lowest of these (gloo frees some buffers late, on its own thread)


def run_train(cfg: RunConfig, device: torch.device, dp: int = 1, zero_stage: int = 0) -> dict:
    """``cfg.steps`` Adam steps of the whole model with CP (``cp_method``) against one process: losses, seconds per
    step, bytes sent per step, the peak and the states per rank.

    The ranks form ``dp`` data-parallel groups of ``c = world / dp`` consecutive ranks; each group runs its rows of
    the batch around its own ring. The peak is ``dp_methods.measure_step``'s on steps 1-3 (Adam's state exists from
    step 1 on), the lowest kept. The profiler slows the steps it watches, so only the others are timed, from step 4 on
    (step 0 pays for first-call allocations): ``seconds`` is empty below 5 steps.
    """
    ring = MeasuredRing.of(cfg.seq_len, group=data_parallel_group(dp))
    ref_losses, _ = reference(cfg)  # one process, the whole batch: what the ring must equal
    m = cp_method(cfg, device, ring, zero_stage)
    losses, seconds, peaks = [], [], []
    for step in range(cfg.steps):
        x, y = local_batch(cfg, step, dist.get_rank() // ring.world, dp)  # this data-parallel group's rows
        x, y = (cp_layout.shard(t, ring.world, ring.rank, ring.layout).to(device) for t in (x, y))  # this rank's positions
        part, mem, took = profile_or_time(m, x, y, device, profile=step in PROFILED_STEPS)
        if mem is not None:
            peaks.append(mem[1])
        elif step > 0:
            seconds.append(took)
        dist.all_reduce(part)
        losses.append(part.item())
    return {"ref_losses": ref_losses, "losses": losses, "seconds": gather_per_rank(seconds),
            "sent_per_step": ring.counter.bytes / cfg.steps, "peak": gather_per_rank(min(peaks, default=None)),
            "held": gather_per_rank(m.held()), "dp": dp, "zero_stage": zero_stage, "device": device.type,
            "batch_bytes": gather_per_rank(memory.tensor_bytes(x) + memory.tensor_bytes(y))}


def run_api(cfg: RunConfig, device: torch.device) -> dict:
    """torch's ``context_parallel`` on the model with fused attention: losses and gradients against one process,
    or the error it raises."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    x, y = global_batch(cfg, 0)
    model = build_model(cfg, device)
    for blk in model.blocks:
        blk.attn.fused = True  # F.scaled_dot_product_attention: what context_parallel replaces
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    idx, tgt = x.to(device), y.to(device)
    pos = torch.arange(cfg.seq_len, device=device).expand_as(idx).contiguous()
    try:
        with context_parallel(mesh, buffers=[idx, tgt, pos], buffer_seq_dims=[1, 1, 1]):
            h = model.embed.tok(idx) + model.embed.pos(pos)  # pos: this rank's global positions
            logits = model.head(model.blocks(h))
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), reduction="sum") / y.numel()
            loss.backward()
    except Exception as exc:  # noqa: BLE001 - the point is to report what this torch does on this backend
        return {"ran": False, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0]}", "backend": dist.get_backend()}
    loss_diff, grad_diff = _against_one_process(cfg, x, y, model, loss)
    return {"ran": True, "loss_diff": loss_diff, "grad_diff": grad_diff, "backend": dist.get_backend(),
            "positions_rank0": pos[0].tolist()}


def run_overlap(cfg: RunConfig, device: torch.device, repeats: int = 10) -> dict:
    """Ring attention alone (float32, zigzag, ``batch x heads x T/c x d``), timed ``repeats`` times after one untimed
    pass: per pass and rank, the seconds computing tiles and waiting for hops (``HopTimes`` summed over the
    steps), forward and backward; and a K, V hop and a dK, dV hop alone, sent and waited for with nothing to compute.
    Lists: one per rank, one value per repeat (ten by default: their median steadies a busy machine's noise)."""
    world = dist.get_world_size()
    T, C, H = cfg.seq_len, cfg.d_model, cfg.n_heads
    g = torch.Generator().manual_seed(cfg.seed + dist.get_rank())
    q, k, v, grad = (torch.randn(cfg.batch, H, T // world, C // H, generator=g).to(device) for _ in range(4))
    ring = MeasuredRing.of(T)

    def one_pass(timed: bool) -> None:
        mine = [t.clone().requires_grad_() for t in (q, k, v)]
        with ring.timing("forward", device) if timed else contextlib.nullcontext():
            out = cp.ring_attention(*mine, ring)
        with ring.timing("backward", device) if timed else contextlib.nullcontext():
            out.backward(grad)
    one_pass(timed=False)  # the tiles and the first messages' set-up
    for _ in range(repeats):
        dist.barrier()  # every rank starts the pass together: a wait is then the hop's, not a late neighbour's
        one_pass(timed=True)
    alone: dict[str, list[float]] = {"kv": [], "dkv": []}
    messages = {"kv": (torch.stack([k, v]), cp.KV_TAG), "dkv": (torch.zeros((2, *k.shape), device=device), cp.DKV_TAG)}
    for _ in range(repeats if world > 1 else 0):  # one rank has no neighbour to send to
        for name, (tensor, tag) in messages.items():
            def hop_alone(tensor: torch.Tensor = tensor, name: str = name, tag: int = tag) -> None:
                hop, _ = cp.Ring.pass_on(ring, [tensor], tag)  # uncounted, untimed: the plain ring's hop
                hop.wait()  # on a GPU: the stream waits for NCCL's copy, and the end event comes after it
            dist.barrier()
            alone[name].append(timing.time_s(hop_alone, device))
    out: dict = {f"{d}_{kind}": gather_per_rank([sum(getattr(t, kind)) for t in ring.times[d]])
                 for d in ("forward", "backward") for kind in ("compute", "wait")}
    out |= {f"alone_{name}": gather_per_rank(ts) for name, ts in alone.items()}
    out["hops"] = {"forward": world - 1, "backward_kv": world - 1, "backward_dkv": world if world > 1 else 0}
    return out
