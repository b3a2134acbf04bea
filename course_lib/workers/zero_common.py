"""What the chapter-09 workers share: the run's configuration, the model, the data, and the typed results the workers report and the parent side (notebook 09, tests, benchmarks) reads back.

Every rank builds the same model from the same seed and reads the same global
batch for a given step (a function of the step number, so a resumed run reads
exactly what an uninterrupted one would), then keeps its own rows of it.

A worker fills the result dataclasses below and reports a ``WorkerResult``;
``run_workers`` launches it and returns ``WorkerResult.from_dict`` of what rank 0 reported.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from course_lib.data import make_tokens
from course_lib.distributed import results
from course_lib.env import seed_everything
from course_lib.models import TinyTransformer, lm_loss


@dataclass
class RunConfig:
    """Sizes of one chapter-09 run; the global batch is split evenly over the ranks."""

    vocab: int = 64
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    seq_len: int = 32
    batch: int = 8          # global batch: the same whatever the world size
    steps: int = 6
    lr: float = 3e-3
    seed: int = 0
    dtype: str = "float32"  # "float64" makes rounding negligible, for exact-equality checks
    accumulation: int = 1   # micro-batches per step on each rank (its rows of the batch, split evenly)
    bucket_mb: float = 0.25  # ZeroOptimizer's bucket cap, MiB: small against these models' gradients

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "float64"):
            raise ValueError(f"dtype must be 'float32' or 'float64', got {self.dtype!r}")
        if self.accumulation < 1 or self.bucket_mb <= 0:
            raise ValueError(f"need accumulation >= 1 and bucket_mb > 0, got {self.accumulation}, {self.bucket_mb}")

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "RunConfig":
        return cls(**json.loads(text))


def build_model(cfg: RunConfig, device: torch.device | str = "cpu") -> TinyTransformer:
    """The tiny transformer, seeded: every rank (and the single-process reference) gets the same weights."""
    seed_everything(cfg.seed)
    return TinyTransformer(vocab=cfg.vocab, d_model=cfg.d_model, n_heads=cfg.n_heads, n_layers=cfg.n_layers,
                           max_len=cfg.seq_len).to(device=device, dtype=getattr(torch, cfg.dtype))


def global_batch(cfg: RunConfig, step: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch of ``step`` (inputs, targets), identical on every rank and in every run."""
    x, y = make_tokens(cfg.batch, cfg.seq_len, vocab=cfg.vocab, seed=cfg.seed * 100_003 + step)
    return x.to(device), y.to(device)


def local_batch(cfg: RunConfig, step: int, rank: int, world: int,
                device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of the global batch of ``step``."""
    if cfg.batch % (world * cfg.accumulation):
        raise ValueError(f"global batch {cfg.batch} does not split evenly over {world} ranks x "
                         f"{cfg.accumulation} micro-batches; choose a multiple of {world * cfg.accumulation}")
    b = cfg.batch // world
    x, y = global_batch(cfg, step, device)
    return x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b]


def reference(cfg: RunConfig) -> tuple[list[float], list[torch.Tensor]]:
    """Single-process Adam on the whole batch: losses and final parameters (what every method must equal)."""
    model = build_model(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    losses = []
    for step in range(cfg.steps):
        x, y = global_batch(cfg, step)
        opt.zero_grad()
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


# ----- results: filled by the workers, read by notebook 09, the tests and the benchmarks ----------


@dataclass
class MethodResult:
    """One training method's run. Lists hold one entry per rank; bytes are per rank."""

    losses: list[float]              # per step, the mean over ranks
    held: list[dict[str, int]]       # params, grads, optimizer state after the last step
    resident: list[int]              # at the start of the measured step: model states and the batch
    batch_bytes: list[int]           # of which the batch (this rank's inputs and targets)
    peak: list[int]                  # resident + the highest transient during zero_grad+forward+backward+step
    sent_per_step: list[float]       # bytes sent (ring formulas of ``comm``)
    sent_by_op: dict[str, float]     # rank 0, per collective
    calls_per_step: dict[str, float]  # rank 0, per collective
    step_s: float                    # median seconds per step, rank 0
    max_param_diff: float | None = None         # rank 0, from single-process Adam on the whole batch
    max_loss_diff: float | None = None
    max_param_diff_vs_ddp: float | None = None
    example_param: dict | None = None           # FSDP2: type, placements and shapes of a sharded parameter

    @property
    def transient(self) -> list[int]:
        """Bytes above the resident ones at the peak: activations, buckets, gathered layers, temporaries."""
        return [p - r for p, r in zip(self.peak, self.resident)]


@dataclass
class CompareResult:
    """Every method trained on the same batches, and the single-process reference (rank 0)."""

    world: int
    device: str                      # where the ranks ran: "cpu" (gloo) or "cuda" (NCCL, one GPU per rank)
    num_params: int
    dtype: str
    accumulation: int
    ref_losses: list[float] | None
    methods: dict[str, MethodResult]


@dataclass
class BucketTimeline:
    """When ZeroOptimizer's buckets leave, seen from each parameter's gradient as the backward computes it."""

    stage: int
    buckets: int
    names: list[str]                 # parameters in the order their gradients were computed
    reduce_scatters_seen: list[int]  # reduce-scatters already issued when that gradient was computed
    after_backward: int              # reduce-scatters issued by the end of the backward
    full_grad_bytes_after_backward: int  # bytes of the parameters' .grad left after the backward
    slice_grad_bytes: int            # bytes of this rank's averaged gradient slices after the backward


@dataclass
class CrashResult:
    losses: list[float]
    crashed: bool


@dataclass
class ResumeResult:
    """A run resumed from the latest complete checkpoint against one that never stopped."""

    checkpoint: str
    incomplete: list[str]
    incomplete_has_metadata: list[bool]
    incomplete_files: list[list[str]]
    saved_world: int
    start: int
    digest_ok: bool                  # the loaded full state equals the saved one, bit for bit
    losses_before_crash: list[float]
    resumed: list[float]
    never_stopped: list[float]
    identical: bool
    max_abs_diff: float


@dataclass
class ReshardResult:
    """A checkpoint loaded at this world size: state intact, and a few more steps."""

    checkpoint: str
    saved_world: int
    loaded_world: int
    digest_ok: bool
    start: int
    losses: list[float]


@dataclass
class WorkerResult(results.WorkerResult):
    """What one launch of ``course_lib.workers.zero_compare`` reports: one entry per task it ran."""

    world: int
    compare: CompareResult | None = None
    exact: CompareResult | None = None
    timeline: list[BucketTimeline] = field(default_factory=list)
    crash: CrashResult | None = None
    resume: ResumeResult | None = None
    reshard: ReshardResult | None = None
    trace: list[str] = field(default_factory=list)  # rank 0's trace files (task ``trace``: one per rank each)


TASKS = ("compare", "exact", "timeline", "trace", "crash", "resume", "reshard")


def run_workers(world: int, tasks: list[str], cfg: RunConfig, methods: list[str] | None = None,
                ckpt_dir: str | Path | None = None, every: int = 2, crash_at: int = 4, timeout: float = 300,
                log_dir: str | Path | None = None, trace_dir: str | Path | None = None) -> WorkerResult:
    """Launch ``course_lib.workers.zero_compare`` on ``world`` ranks for ``tasks`` (run in this order)."""
    from course_lib.distributed import launch  # the parent side only

    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"unknown task(s) {unknown}; choose from {', '.join(TASKS)}")
    args = ["--tasks", ",".join(tasks), "--cfg", cfg.to_json(), "--every", str(every), "--crash-at", str(crash_at)]
    if methods:
        args += ["--methods", ",".join(methods)]
    if ckpt_dir is not None:
        args += ["--ckpt-dir", str(ckpt_dir)]
    if trace_dir is not None:
        args += ["--trace-dir", str(trace_dir)]
    out = launch.run("course_lib.workers.zero_compare", world, args, timeout=timeout, log_dir=log_dir)
    return WorkerResult.from_dict(out)
