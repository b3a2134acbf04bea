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

The tasks (run through ``course_lib.workers.zero_compare --tasks ...``):

- ``crash_run``: train from scratch, checkpoint every few steps, and die
  (``os._exit``) in the middle of one save, after the shards and before the metadata;
- ``resume_run``: resume from the latest complete checkpoint and train on; also
  train a run that never stopped; the losses must be identical;
- ``reshard_load``: load the latest checkpoint at this world size; the full
  state must be bit-for-bit what was saved.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                     get_state_dict, set_state_dict)

from course_lib.distributed.experiment import RunConfig, build_model, local_batch
from course_lib.distributed.results import mean_over_ranks
from course_lib.distributed.zero import shard_fsdp2
from course_lib.models import lm_loss
from course_lib.workers.zero_common import CrashResult, ReshardResult, ResumeResult

CKPT = re.compile(r"^step_(\d{6})$")
KILLED_EXIT = 75  # the exit code of a rank killed on purpose during a save (any non-zero code would do)


# ----- saving and finding checkpoints ----------------------------------------------------


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


# ----- the runs ---------------------------------------------------------------------------


def _fsdp(cfg: RunConfig, device: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = shard_fsdp2(build_model(cfg, device))
    return model, torch.optim.Adam(model.parameters(), lr=cfg.lr)


def _train(model, opt, cfg: RunConfig, start: int, stop: int, device: torch.device, on_step=None) -> list[float]:
    """Steps ``start .. stop-1``; each step's batch depends only on its number. Returns the mean losses."""
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(start, stop):
        x, y = local_batch(cfg, step, rank, world, device)
        opt.zero_grad()
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(mean_over_ranks(loss.item(), device))
        if on_step is not None:
            on_step(step + 1, losses)  # step + 1 steps are done
    return losses


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
    model, opt = _fsdp(cfg, device)

    def maybe_save(done: int, losses: list[float]) -> None:
        if done % every == 0:
            save_checkpoint(root_path, done, model, opt, {"losses": list(losses), "world": dist.get_world_size()},
                            die_during_save=(done == crash_at))

    losses = _train(model, opt, cfg, 0, cfg.steps, device, maybe_save)
    return CrashResult(losses=losses, crashed=False)  # reached only if crash_at was never hit


def _load_latest(cfg: RunConfig, root: str, device: torch.device):
    """The latest complete checkpoint loaded into a fresh FSDP2 model: path, incomplete folders, model, optimizer,
    meta, and whether the loaded full state is the one saved."""
    path, partial = latest_checkpoint(root)
    if path is None:
        raise FileNotFoundError(f"no complete checkpoint under {root}; run the 'crash' task first")
    model, opt = _fsdp(cfg, device)
    meta = load_checkpoint(path, model, opt)
    return path, partial, model, opt, meta, full_state_digest(model, opt) == meta["digest"]


def resume_run(cfg: RunConfig, root: str, device: torch.device) -> ResumeResult:
    """Resume from the latest complete checkpoint, and compare with a run that never stopped."""
    path, partial, model, opt, meta, digest_ok = _load_latest(cfg, root, device)
    start = meta["step"]
    resumed = _train(model, opt, cfg, start, cfg.steps, device)
    model2, opt2 = _fsdp(cfg, device)
    never_stopped = _train(model2, opt2, cfg, 0, cfg.steps, device)
    return ResumeResult(checkpoint=path.name, incomplete=partial,
                        incomplete_has_metadata=[(Path(root) / p / ".metadata").exists() for p in partial],
                        incomplete_files=[sorted(f.name for f in (Path(root) / p).iterdir()) for p in partial],
                        saved_world=meta["world"], start=start, digest_ok=digest_ok,
                        losses_before_crash=meta["losses"], resumed=resumed, never_stopped=never_stopped,
                        identical=resumed == never_stopped[start:],
                        max_abs_diff=max(abs(a - b) for a, b in zip(resumed, never_stopped[start:])))


def reshard_load(cfg: RunConfig, root: str, device: torch.device, steps: int = 2) -> ReshardResult:
    """Load the latest checkpoint at this world size; check the full state; train ``steps`` more steps."""
    path, _, model, opt, meta, digest_ok = _load_latest(cfg, root, device)
    start = meta["step"]
    losses = _train(model, opt, cfg, start, min(cfg.steps, start + steps), device)
    return ReshardResult(checkpoint=path.name, saved_world=meta["world"], loaded_world=dist.get_world_size(),
                         digest_ok=digest_ok, start=start, losses=losses)
