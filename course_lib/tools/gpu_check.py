"""``course gpu-check``: the course's GPU code paths, briefly, with CUDA's memory statistics beside its predictions.

The notebooks' ``gpu`` profile needs a GPU, which CI does not have. This is what a
person with one runs first: every library piece a notebook puts on the device, at
small sizes, under bf16 autocast where the notebook trains so (forward, backward,
an optimizer step), then the data-parallel, ZeRO and FSDP workers on one rank per
GPU through ``launch.run``, as chapters 07, 09 and 11 start them. It prints one
table: each check's result and time, CUDA's ``max_memory_allocated`` and
``max_memory_reserved`` during it, the course's prediction of that peak where it
makes one (``estimator``, ``chunked_loss``, the planner, the ZeRO formulas) and
the free memory after it (``mem_get_info``). It exits 0 when every check passed.

Without CUDA it says that it needs a GPU and exits with ``NO_GPU_EXIT``;
``course gpu-check --list`` lists the checks on any machine. The in-process
checks take a ``device``, so the tests run them on the CPU too.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

MiB = 2**20
NO_GPU_EXIT = 2
BUDGET_S = 540.0  # the checks still to start after this many seconds are skipped: the whole run stays under 10 min
LAUNCH_TIMEOUT_S = 240.0


@dataclass
class Measured:
    """What a check reports beside its time: the course's predicted peak, a peak measured on ranks, a note."""

    predicted: float | None = None  # bytes
    peak: int | None = None         # bytes, measured in worker processes (this process's statistics miss them)
    note: str = ""


@dataclass(frozen=True)
class Check:
    """One line of the table: ``run(device)`` does the work; ``ranks``: it launches one worker per GPU."""

    name: str
    chapters: str
    what: str
    run: Callable[[torch.device], Measured]
    ranks: bool = False


@dataclass
class Row:
    """One check's outcome; bytes are ``None`` where nothing was measured (on the CPU, or a failed check)."""

    check: str
    chapters: str
    ok: bool
    seconds: float
    allocated: int | None = None
    reserved: int | None = None
    predicted: float | None = None
    free: int | None = None
    note: str = ""


# ----- helpers the checks share ----------------------------------------------------------------


def _autocast(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> contextlib.AbstractContextManager:
    return torch.autocast(device.type, dtype=dtype)


def _train_step(model: nn.Module, loss: Callable[[], torch.Tensor], device: torch.device,
                optimizer: torch.optim.Optimizer | None = None) -> float:
    """One Adam step under bf16 autocast, as the ``gpu`` profile trains; the loss."""
    optimizer = optimizer or torch.optim.Adam(model.parameters(), lr=1e-3)
    optimizer.zero_grad(set_to_none=True)
    with _autocast(device):
        value = loss()
    value.backward()
    optimizer.step()
    return value.item()


def _tokens(vocab: int, batch: int, seq: int, device: torch.device) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), device=device)


def _transformer(device: torch.device, **options) -> nn.Module:
    from course_lib.models import TinyTransformer

    sizes = dict(vocab=256, d_model=128, n_heads=4, n_layers=4, max_len=128) | options
    return TinyTransformer(**sizes).to(device)


# ----- the checks, in chapter order --------------------------------------------------------------


def check_resnets(device: torch.device) -> Measured:
    """ResNets with BatchNorm, GroupNorm, ghost BatchNorm and MABN, and the MLP: one bf16 Adam step each."""
    from course_lib import estimator, models, norms

    norm_layers = {"bn": nn.BatchNorm2d, "gn": lambda c: norms.make_norm("gn", c),
                   "ghost-bn": lambda c: norms.GhostBatchNorm2d(c, group_size=4),
                   "mabn": lambda c: norms.MABN2d(c, group_size=4)}
    x, y = torch.randn(16, 3, 32, 32, device=device), torch.randint(0, 10, (16,), device=device)
    predicted = 0
    for norm in norm_layers.values():
        net = models.ResNet(width=16, norm_layer=norm).to(device)
        _train_step(net, lambda: F.cross_entropy(net(x), y), device)
        predicted = max(predicted, estimator.estimate(net, tuple(x.shape), "adam", "bf16", device=device)["total"])
    mlp = models.MLP().to(device)
    _train_step(mlp, lambda: F.cross_entropy(mlp(x), y), device)
    return Measured(predicted, note="predicted: estimator.estimate, the largest of the four")


def check_transformer(device: torch.device) -> Measured:
    """The tiny transformer, naive and fused attention: one bf16 Adam step each."""
    from course_lib import estimator
    from course_lib.models import lm_loss

    idx = _tokens(256, 8, 128, device)
    predicted = 0
    for fused in (False, True):
        model = _transformer(device, fused=fused)
        _train_step(model, lambda: lm_loss(model(idx), idx), device)
        predicted = max(predicted, estimator.estimate(model, tuple(idx.shape), "adam", "bf16", device=device)["total"])
    return Measured(predicted, note="predicted: estimator.estimate (naive attention)")


def check_checkpointing(device: torch.device) -> Measured:
    """Checkpointed blocks (full, selective) under bf16, and fp16 with a GradScaler as chapter 05 trains."""
    from course_lib import checkpointing
    from course_lib.models import lm_loss

    idx = _tokens(256, 8, 128, device)
    for mode in ("full", "selective"):
        model = _transformer(device)
        model.blocks = checkpointing.checkpoint_blocks(model.blocks, mode)
        _train_step(model, lambda: lm_loss(model(idx), idx), device)
    chain = checkpointing.checkpointed_sequential(checkpointing.chain(8, 256).to(device), 3)
    scaler = torch.amp.GradScaler(device.type, enabled=device.type == "cuda")
    opt = torch.optim.SGD(chain.parameters(), lr=1e-2)
    with _autocast(device, torch.float16 if device.type == "cuda" else torch.bfloat16):
        loss = chain(torch.randn(64, 256, device=device, requires_grad=True)).pow(2).mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    return Measured()


def check_chunked_loss(device: torch.device) -> Measured:
    """The loss over a large vocabulary in chunks, by hand and checkpointed, under bf16 (chapter 11)."""
    from course_lib import chunked_loss

    vocab, batch, seq, chunks = 8192, 4, 128, 8
    model = _transformer(device, vocab=vocab)
    idx = _tokens(vocab, batch, seq, device)
    for by_hand in (True, False):
        _train_step(model, lambda: chunked_loss.transformer_loss(model, idx, idx, chunks, by_hand=by_hand), device)
    predicted = chunked_loss.predict_loss_peak(batch * seq, vocab, 128, chunks)
    return Measured(predicted, note="predicted: predict_loss_peak, the loss's own peak only")


def check_offload(device: torch.device) -> Measured:
    """Saved activations offloaded by hand and with save_on_cpu (pinned host buffers on a GPU), under bf16."""
    from course_lib import offload
    from course_lib.models import lm_loss

    idx = _tokens(256, 8, 128, device)
    pinned = device.type == "cuda"
    notes = []
    for name, hooks in (("by hand", offload.OffloadToHost(min_bytes=1024, pin_memory=pinned)),
                        ("save_on_cpu", offload.CountedSaveOnCpu(pin_memory=pinned, device_type=device.type))):
        model = _transformer(device)
        model.blocks = offload.offload_blocks(model.blocks, hooks)
        _train_step(model, lambda: lm_loss(model(idx), idx), device)
        notes.append(f"{name}: {hooks.copied_bytes / MiB:.1f} MiB copied")
    return Measured(note="; ".join(notes))


def check_moe(device: torch.device) -> Measured:
    """The mixture of experts, top-1 and top-2, with its auxiliary loss: three Adam steps on the device."""
    from course_lib import moe
    from course_lib.experiments.moe_runs import teacher_task

    x, y = (t.to(device) for t in teacher_task(0, 1024, 32))
    drops = []
    for k in (1, 2):
        layer = moe.MoEMLP(32, 64, n_experts=8, k=k, capacity_factor=1.25).to(device)
        opt = torch.optim.Adam(layer.parameters(), lr=1e-2)
        for _ in range(3):
            _train_step(layer, lambda: F.mse_loss(layer(x), y) + 0.01 * layer.aux_loss, device, opt)
        drops.append(f"k={k} dropped {layer.routing.drop_rate():.1%}")
    return Measured(note=", ".join(drops))


@contextlib.contextmanager
def one_rank_group(device: torch.device) -> Iterator[None]:
    """A process group of this process alone (NCCL for CUDA tensors, gloo for CPU ones), for the TP block."""
    import torch.distributed as dist

    from course_lib.experiments import launch

    if dist.is_initialized():
        yield
        return
    with tempfile.TemporaryDirectory() as d:
        store = dist.FileStore(f"{d}/store", 1)
        if device.type == "cuda":
            dist.init_process_group(launch.NCCL_WITH_CPU, store=store, rank=0, world_size=1, device_id=device)
        else:
            dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def check_tp_block(device: torch.device) -> Measured:
    """A tensor-parallel block (plain, and sequence parallel with regather) on a one-rank group, under bf16."""
    from course_lib.parallel.tensor_parallel import layers as tp
    from course_lib.models import TransformerBlock

    x = torch.randn(4, 128, 128, device=device)
    with one_rank_group(device):
        for sp in (False, True):
            group = tp.TPGroup()
            block = tp.TPBlock(TransformerBlock(128, 4, 128).to(device), group, sp, regather=sp)
            _train_step(block, lambda: block(x).pow(2).mean(), device)
            tp.sync_replicated_grads(block, group)
    return Measured()


def check_ring_attention(device: torch.device) -> Measured:
    """Ring attention in one process against torch's attention, in bf16; a model's forward and backward over it."""
    from course_lib.parallel.context_parallel import model as cp_model
    from course_lib.parallel.context_parallel import ring_attention as cp
    from course_lib.models import lm_loss

    q, k, v = (torch.randn(2, 4, 256, 32, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    out = cp.ring_attention(q, k, v, cp.Ring(256))
    out.float().pow(2).sum().backward()
    diff = (out - F.scaled_dot_product_attention(q, k, v, is_causal=True)).abs().max().item()
    model = _transformer(device)
    idx = _tokens(256, 4, 128, device)
    _train_step(model, lambda: lm_loss(cp_model.model_forward(model, idx, cp.Ring(128)), idx), device)
    return Measured(note=f"bf16 ring vs torch's attention: {diff:.1e}")


def check_planner(device: torch.device) -> Measured:
    """The capstone's planner on this device: its choice for a budget, then that step measured (chapter 13)."""
    from course_lib import planner
    from course_lib.models import lm_loss

    model = _transformer(device)
    batch, seq = (16, 128) if device.type == "cuda" else (4, 64)  # on a CPU (the tests), a quarter of the search
    plan = planner.plan(model, (seq,), batch, 256 * MiB, device=device)
    x = _tokens(256, batch, seq + 1, device)
    inputs, targets = x[:, :-1].contiguous(), x[:, 1:].contiguous()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    planner.train_step(model, lm_loss, inputs, targets, opt, plan.config)  # Adam makes its state
    measured = planner.measure_peak(model, lm_loss, inputs, targets, opt, plan.config)
    return Measured(plan.predicted_peak_bytes, note=f"{plan.config.describe()}; measure_peak {measured / MiB:.1f} MiB")


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _worker_env() -> dict[str, str]:
    return {"COURSE_PROFILE": "gpu"}  # a CPU profile in the environment would keep the ranks on the CPU


def check_zero_fsdp(device: torch.device) -> Measured:
    """DDP, ZeRO-1/2 by hand, FSDP2 (fp32 and bf16) on one rank per GPU: chapter 09's worker, a short run."""
    from course_lib.experiments import launch
    from course_lib.parallel.sharding import zero
    from course_lib.experiments.run_config import RunConfig
    from course_lib.experiments.workers.zero_common import WorkerResult

    world = max(_gpus(), 1)
    cfg = RunConfig(d_model=128, n_layers=2, seq_len=64, batch=8 * world, steps=3)
    methods = ["ddp", "zero1", "zero2", "fsdp2", "fsdp2_bf16"]
    out = WorkerResult.from_dict(launch.run(
        "course_lib.experiments.workers.zero_compare", world, ["--tasks", "compare", "--cfg", cfg.to_json(), "--methods",
                                                   ",".join(methods)], timeout=LAUNCH_TIMEOUT_S, env=_worker_env()))
    stages = {"ddp": 0, "zero1": 1, "zero2": 2, "fsdp2": 3}
    ratios = []
    for name, stage in stages.items():
        held = max(sum(h.values()) for h in out.compare.methods[name].held)
        formula = sum(zero.zero_bytes_per_rank(out.compare.num_params, world, stage).values())
        ratios.append(f"{name} {held / formula:.2f}")
    peak = max(max(r.peak) for r in out.compare.methods.values())
    return Measured(peak=peak, note=f"{world} rank(s) on {out.compare.device}; states / formula: {', '.join(ratios)}")


def check_ddp(device: torch.device) -> Measured:
    """Chapter 07's data-parallel wrappers (by hand, bucketed, torch's DDP) against one process, one rank per GPU."""
    from course_lib.experiments import launch

    world = max(_gpus(), 1)
    out = launch.run("course_lib.experiments.workers.ddp_compare", world, ["--timing-rounds", "0", "--bn"],
                     timeout=LAUNCH_TIMEOUT_S, env=_worker_env())
    # the bucketed wrapper differs in some scenarios on purpose (chapter 07's point); torch's DDP never should
    diff = max(wrappers["torch"]["param_diff"] for wrappers in out["equal"].values())
    return Measured(note=f"{world} rank(s), {out['backend']}; torch's DDP against one process: {diff:.1e}")


def check_fsdp_offload(device: torch.device) -> Measured:
    """Chapter 11's FSDP2 with and without CPUOffloadPolicy (pinned host memory), on up to two GPUs."""
    from course_lib.experiments import launch
    from course_lib.experiments.run_config import RunConfig

    world = min(max(_gpus(), 1), 2)
    cfg = RunConfig(d_model=256, n_layers=2, seq_len=64, batch=4 * world, steps=2)
    out = launch.run("course_lib.experiments.workers.fsdp_offload", world, ["--cfg", cfg.to_json(),
                                                                "--pin-memory", str(int(device.type == "cuda"))],
                     timeout=LAUNCH_TIMEOUT_S, env=_worker_env())
    modes = out["modes"]
    peak = max((max(r["cuda_peak_bytes"]) for r in modes.values() if r["cuda_peak_bytes"]), default=None)
    return Measured(peak=peak, note=f"{world} rank(s) on {out['device']}; offloaded, the states left on the "
                                    f"device: {max(modes['cpu']['device_state_bytes'])} bytes")


CHECKS: tuple[Check, ...] = (
    Check("resnets", "01-04", "ResNets (BN, GN, ghost BN, MABN) and the MLP: a bf16 Adam step", check_resnets),
    Check("transformer", "01, 05, 10", "the tiny transformer, naive and fused attention: a bf16 Adam step",
          check_transformer),
    Check("checkpointing", "05", "checkpointed blocks (full, selective); fp16 with a GradScaler", check_checkpointing),
    Check("chunked-loss", "11", "the loss over a large vocabulary in chunks, by hand and checkpointed",
          check_chunked_loss),
    Check("offload", "11", "saved activations to pinned host memory, by hand and save_on_cpu", check_offload),
    Check("tp-block", "10", "a tensor-parallel block, plain and sequence parallel, on a one-rank group",
          check_tp_block),
    Check("ring-attention", "12", "ring attention in one process in bf16; a model over the ring",
          check_ring_attention),
    Check("moe", "12", "the mixture of experts, top-1 and top-2: three Adam steps", check_moe),
    Check("planner", "13", "the planner's choice for 256 MiB, then that step measured", check_planner),
    Check("ddp", "07", "data-parallel wrappers (by hand, bucketed, torch's) against one process", check_ddp,
          ranks=True),
    Check("zero-fsdp", "09", "DDP, ZeRO-1/2, FSDP2 (fp32, bf16): a short run", check_zero_fsdp,
          ranks=True),
    Check("fsdp-offload", "11", "FSDP2 with and without CPUOffloadPolicy, on up to two GPUs", check_fsdp_offload,
          ranks=True),
)


# ----- running and the table -------------------------------------------------------------------


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:200]


def run_check(check: Check, device: torch.device) -> Row:
    """Run one check; on CUDA with the allocator's peak statistics reset before and read after."""
    cuda = device.type == "cuda"
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    try:
        got, ok = check.run(device), True
    except Exception as exc:  # noqa: BLE001 - a failed check is a row of the table, the others still run
        got, ok = Measured(note=_first_line(exc)), False
    if cuda:
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    row = Row(check.name, check.chapters, ok, seconds, predicted=got.predicted, note=got.note, allocated=got.peak)
    if cuda:
        if got.peak is None:
            row.allocated = torch.cuda.max_memory_allocated(device)
            row.reserved = torch.cuda.max_memory_reserved(device)
        row.free = torch.cuda.mem_get_info(device)[0]
    return row


def run_checks(device: torch.device, checks: tuple[Check, ...] = CHECKS, budget_s: float = BUDGET_S,
               echo: Callable[[str], None] = lambda line: None) -> list[Row]:
    """Every check in order; those not started within ``budget_s`` seconds are listed as skipped."""
    rows, start = [], time.perf_counter()
    for check in checks:
        if time.perf_counter() - start > budget_s:
            rows.append(Row(check.name, check.chapters, False, 0.0, note=f"skipped: past {budget_s:.0f} s"))
            continue
        echo(f"[gpu-check] {check.name} ({check.what}) ...")
        rows.append(run_check(check, device))
        echo(f"[gpu-check] {check.name}: {'ok' if rows[-1].ok else 'FAILED'} in {rows[-1].seconds:.1f} s")
    return rows


def _mib(b: float | None) -> str:
    return "-" if b is None else f"{b / MiB:.1f}"


COLUMNS = ("check", "chapters", "result", "s", "allocated MiB", "reserved MiB", "predicted MiB", "alloc/pred",
           "free MiB", "note")


def format_table(rows: list[Row]) -> str:
    """The rows as an aligned text table, a header first."""
    cells = [COLUMNS]
    for r in rows:
        ratio = f"{r.allocated / r.predicted:.2f}" if r.allocated and r.predicted else "-"
        cells.append((r.check, r.chapters, "ok" if r.ok else "FAILED", f"{r.seconds:.1f}", _mib(r.allocated),
                      _mib(r.reserved), _mib(r.predicted), ratio, _mib(r.free), r.note))
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS) - 1)]
    lines = [" | ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
             + " | " + row[-1] for row in cells]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def list_checks(checks: tuple[Check, ...] = CHECKS) -> str:
    """What ``course gpu-check`` runs, one line a check."""
    width = max(len(c.name) for c in checks)
    return "\n".join(f"{c.name:<{width}}  ch. {c.chapters:<10} {c.what}" + ("  [one rank per GPU]" if c.ranks else "")
                     for c in checks)


def no_gpu_message() -> str:
    return (f"course gpu-check needs a CUDA GPU, and PyTorch sees none (torch {torch.__version__}, "
            "torch.cuda.is_available() is False). It runs the notebooks' gpu-profile code on the device; on this "
            "machine the profiles are cpu and smoke (`course run --profile cpu`). `course doctor` says why a GPU is "
            "not seen; `course gpu-check --list` lists the checks.")


def run(args: argparse.Namespace) -> int:
    """``course gpu-check``: the list (``args.list``), the no-GPU message, or the checks (``args.only``), the table."""
    checks = CHECKS if not args.only else tuple(c for c in CHECKS if c.name in args.only)
    unknown = sorted(set(args.only or ()) - {c.name for c in CHECKS})
    if unknown:
        print(f"course gpu-check: unknown check(s) {', '.join(unknown)}; `course gpu-check --list`", file=sys.stderr)
        return 2
    if args.list:
        print(list_checks(checks))
        return 0
    if not torch.cuda.is_available():
        print(no_gpu_message(), file=sys.stderr)
        return NO_GPU_EXIT
    device = torch.device("cuda", torch.cuda.current_device())
    free, total = torch.cuda.mem_get_info(device)
    print(f"[gpu-check] {torch.cuda.get_device_name(device)}, {_gpus()} GPU(s); {free / MiB:.0f} of "
          f"{total / MiB:.0f} MiB free; torch {torch.__version__}", flush=True)
    start = time.perf_counter()
    rows = run_checks(device, checks, echo=lambda line: print(line, flush=True))
    print(format_table(rows))
    failed = [r.check for r in rows if not r.ok]
    print(f"[gpu-check] {len(rows) - len(failed)} of {len(rows)} passed in {time.perf_counter() - start:.0f} s"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0
