"""Chapter 09's sharded checkpoints put to the test: a run that crashes while saving, its resume, a reshard.

``zero_compare --tasks crash,resume,reshard`` runs them on the run of ``run_config`` with FSDP2 and Adam, using the
three functions of ``course_lib.parallel.sharding.sharded_checkpoint``:

- ``crash_run`` trains from scratch, checkpoints every few steps and dies in the middle of one save (every rank,
  once all the shards are written, before the metadata: what a crash leaves);
- ``resume_run`` resumes from the latest complete checkpoint against a run that never stopped (the losses must be
  identical);
- ``reshard_load`` loads it at another world size.

``full_state_digest`` tells whether a loaded state is bit for bit the saved one: each save records it in its meta.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from course_lib.experiments.dp_methods import fsdp2_adam, train_steps
from course_lib.experiments.run_config import RunConfig
from course_lib.parallel.sharding.sharded_checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint

KILLED_EXIT = 75  # the exit code of a rank killed on purpose during a save (any non-zero code would do)


def _digest(obj: object, h: "hashlib._Hash | None" = None) -> str:
    """SHA-256 of a nested state dict's keys and exact tensor bytes (equal digests: bit-for-bit equal)."""
    h = h or hashlib.sha256()
    if isinstance(obj, dict):
        for k in sorted(obj, key=str):
            h.update(str(k).encode())
            _digest(obj[k], h)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _digest(v, h)
    elif torch.is_tensor(obj):
        h.update(obj.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    else:
        h.update(repr(obj).encode())
    return h.hexdigest()


def full_state_digest(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    """Digest of the *full* (gathered) model and optimizer state: the same whatever the world size (a collective)."""
    full = StateDictOptions(full_state_dict=True)
    msd = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in model.state_dict().items()}
    osd = get_optimizer_state_dict(model, opt, options=full)
    return _digest({"model": msd, "optim": osd["state"]})


class DieAfterWrite(FileSystemWriter):
    """A writer that kills its process once this rank's shards are on disk, before the metadata."""

    def write_data(self, plan, planner):
        fut = super().write_data(plan, planner)
        fut.wait()
        # Wait until every rank's shards are on disk: otherwise the first rank to die makes torchrun stop
        # the others, and a slower rank may die before writing. Then the folder holds all the data and
        # still cannot be loaded, which is the point of the demonstration.
        dist.barrier()
        os._exit(KILLED_EXIT)  # no clean-up, no exception handlers: like a power cut or a SIGKILL


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


def crash_run(cfg: RunConfig, root: str, every: int, crash_at: int, device: torch.device) -> CrashResult:
    """Train from scratch, checkpoint every ``every`` steps, die while saving after step ``crash_at``."""
    if every < 1 or crash_at % every or not every <= crash_at <= cfg.steps:
        raise ValueError(f"crash_at={crash_at} must be a checkpoint step (a multiple of every={every}) "
                         f"within the {cfg.steps} steps, after the first checkpoint")
    root_path = Path(root)
    if root_path.exists() and any(root_path.iterdir()):  # every rank checks, so every rank raises
        raise ValueError(f"{root} is not empty: a run from scratch writes its checkpoints into an empty folder")
    dist.barrier()  # every rank has looked before rank 0 creates it
    if dist.get_rank() == 0:
        root_path.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    model, opt = fsdp2_adam(cfg, device)

    def maybe_save(done: int, losses: list[float]) -> None:
        if done % every == 0:
            meta = {"losses": list(losses), "world": dist.get_world_size(), "digest": full_state_digest(model, opt)}
            save_checkpoint(root_path, done, model, opt, meta,
                            writer=DieAfterWrite if done == crash_at else FileSystemWriter)

    losses = train_steps(model, opt, cfg, device, on_step=maybe_save)
    return CrashResult(losses=losses, crashed=False)  # reached only if crash_at was never hit


def _load_latest(cfg: RunConfig, root: str, device: torch.device):
    """The latest complete checkpoint loaded into a fresh FSDP2 model: path, incomplete folders, model, optimizer,
    meta, and whether the loaded full state is the one saved."""
    path, partial = latest_checkpoint(root)
    if path is None:
        raise FileNotFoundError(f"no complete checkpoint under {root}; run the 'crash' task first")
    model, opt = fsdp2_adam(cfg, device)
    meta = load_checkpoint(path, model, opt)
    return path, partial, model, opt, meta, full_state_digest(model, opt) == meta["digest"]


def resume_run(cfg: RunConfig, root: str, device: torch.device) -> ResumeResult:
    """Resume from the latest complete checkpoint, and compare with a run that never stopped."""
    path, partial, model, opt, meta, digest_ok = _load_latest(cfg, root, device)
    start = meta["step"]
    resumed = train_steps(model, opt, cfg, device, start)
    never_stopped = train_steps(*fsdp2_adam(cfg, device), cfg, device)
    return ResumeResult(checkpoint=path.name, incomplete=partial,
                        incomplete_has_metadata=[(Path(root) / p / ".metadata").exists() for p in partial],
                        incomplete_files=[sorted(f.name for f in (Path(root) / p).iterdir()) for p in partial],
                        saved_world=meta["world"], start=start, digest_ok=digest_ok,
                        losses_before_crash=meta["losses"], resumed=resumed, never_stopped=never_stopped,
                        identical=resumed == never_stopped[start:],
                        max_abs_diff=max(abs(a - b) for a, b in zip(resumed, never_stopped[start:])))


def reshard_load(cfg: RunConfig, root: str, device: torch.device, steps: int = 2) -> ReshardResult:
    """Load the latest checkpoint at this world size; check the full state; train ``steps`` more steps.

    The steps run on from the checkpoint's, past ``cfg.steps`` if need be: a launch that only measures (chapter
    09's at world sizes 1 and 4) may train fewer steps than the run that saved.
    """
    path, _, model, opt, meta, digest_ok = _load_latest(cfg, root, device)
    start = meta["step"]
    losses = train_steps(model, opt, cfg, device, start, start + steps)
    return ReshardResult(checkpoint=path.name, saved_world=meta["world"], loaded_world=dist.get_world_size(),
                         digest_ok=digest_ok, start=start, losses=losses)
