"""Sharded checkpoints of an FSDP2 model with ``torch.distributed.checkpoint`` (DCP), chapter 09.

Each rank writes only its own shards (``__<rank>_<k>.distcp`` files) and the
coordinator writes ``.metadata`` last, which says where every piece of every
tensor lives. Loading reads the pieces each rank needs *at the loader's world
size*, so a checkpoint saved on 2 ranks loads on 1 or 4.

What a crash costs: a folder without ``.metadata`` cannot be loaded, but
DCP would happily overwrite an older checkpoint in the same folder. So every
checkpoint is written into ``step_NNNNNN.partial`` and renamed to
``step_NNNNNN`` when complete; ``rename`` is atomic on POSIX file systems, so
a checkpoint folder either is complete or does not exist under that name, and
a crash during a save loses only that save.

``save_checkpoint`` writes one (``die_during_save``: every process dies once
all the shards are written, before the metadata, to show what a crash leaves),
``latest_checkpoint`` finds the newest complete one, ``load_checkpoint``
loads it at this world size, and ``full_state_digest`` tells whether the
loaded state is bit for bit the saved one.

Chapter 09 runs them three ways (``zero_compare --tasks crash,resume,reshard``),
on the run of ``experiment`` with FSDP2 and Adam: ``crash_run`` trains from scratch,
checkpoints every few steps and dies in the middle of one save; ``resume_run``
resumes from the latest complete checkpoint against a run that never stopped
(the losses must be identical); ``reshard_load`` loads it at another world size.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                     get_state_dict, set_state_dict)

from course_lib.experiments.dp_methods import fsdp2_adam, train_steps
from course_lib.experiments.run_config import RunConfig

CKPT = re.compile(r"^step_(\d{6})$")
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
    """Digest of the *full* (gathered) model and optimizer state: the same whatever the world size."""
    full = StateDictOptions(full_state_dict=True)
    msd = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in model.state_dict().items()}
    osd = get_optimizer_state_dict(model, opt, options=full)
    return _digest({"model": msd, "optim": osd["state"]})


class _DieAfterWrite(FileSystemWriter):
    """A writer that kills its process once this rank's shards are on disk, before the metadata."""

    def write_data(self, plan, planner):
        fut = super().write_data(plan, planner)
        fut.wait()
        # Wait until every rank's shards are on disk: otherwise the first rank to die makes torchrun stop
        # the others, and a slower rank may die before writing. Then the folder holds all the data and
        # still cannot be loaded, which is the point of the demonstration.
        dist.barrier()
        os._exit(KILLED_EXIT)  # no clean-up, no exception handlers: like a power cut or a SIGKILL


def save_checkpoint(root: str | Path, step: int, model: torch.nn.Module, opt: torch.optim.Optimizer,
                    meta: dict, die_during_save: bool = False) -> Path:
    """Write a sharded checkpoint to ``root/step_NNNNNN`` atomically (every rank calls this)."""
    root = Path(root)
    final, partial = root / f"step_{step:06d}", root / f"step_{step:06d}.partial"
    msd, osd = get_state_dict(model, opt)  # DTensors: each rank hands over only its shards
    writer = (_DieAfterWrite if die_during_save else FileSystemWriter)(str(partial))
    dcp.save({"model": msd, "optim": osd}, storage_writer=writer)
    digest = full_state_digest(model, opt)  # a collective: every rank takes part
    if dist.get_rank() == 0:
        (partial / "meta.json").write_text(json.dumps({**meta, "step": step, "digest": digest}))
        os.replace(partial, final)  # atomic: the folder appears complete, or not at all
    dist.barrier()  # no rank goes on (or looks for the checkpoint) before it exists
    return final


def latest_checkpoint(root: str | Path) -> tuple[Path | None, list[str]]:
    """The complete checkpoint with the highest step (or None), and the names of incomplete folders."""
    root = Path(root)
    complete, partial = [], []
    for d in sorted(root.iterdir()) if root.exists() else []:
        if CKPT.match(d.name) and (d / ".metadata").exists():
            complete.append(d)
        elif d.is_dir():
            partial.append(d.name)
    return (complete[-1] if complete else None), partial


def load_checkpoint(path: str | Path, model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    """Load a sharded checkpoint into an FSDP2 model and its optimizer at *this* world size; return meta."""
    msd, osd = get_state_dict(model, opt)  # the shapes and shards this world size wants
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=str(path))  # reads just the pieces that overlap this rank's shards
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return json.loads((Path(path) / "meta.json").read_text())


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
            save_checkpoint(root_path, done, model, opt, {"losses": list(losses), "world": dist.get_world_size()},
                            die_during_save=(done == crash_at))

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
