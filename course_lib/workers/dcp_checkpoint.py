"""Chapter 09's checkpoint tasks: a crash during a save, a resumed run, and a load at another world size.

The checkpoints are sharded, with ``torch.distributed.checkpoint``, and
written atomically (``course_lib.distributed.sharded_checkpoint``): a crash
during a save loses only that save, and a checkpoint saved on 2 ranks loads on 1 or 4.

The tasks (run through ``course_lib.workers.zero_compare --tasks ...``):

- ``crash_run``: train from scratch, checkpoint every few steps, and die
  (``os._exit``) in the middle of one save, after the shards and before the metadata;
- ``resume_run``: resume from the latest complete checkpoint and train on; also
  train a run that never stopped; the losses must be identical;
- ``reshard_load``: load the latest checkpoint at this world size; the full
  state must be bit-for-bit what was saved.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from course_lib.distributed.experiment import RunConfig, build_model, local_batch
from course_lib.distributed.results import mean_over_ranks
from course_lib.distributed.sharded_checkpoint import (full_state_digest, latest_checkpoint, load_checkpoint,
                                                       save_checkpoint)
from course_lib.distributed.zero import shard_fsdp2
from course_lib.models import lm_loss
from course_lib.workers.zero_common import CrashResult, ReshardResult, ResumeResult


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
