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

``save_checkpoint`` writes one (``die_during_save``: the process dies after
its shards, before the metadata, to show what a crash leaves),
``latest_checkpoint`` finds the newest complete one, ``load_checkpoint``
loads it at this world size, and ``full_state_digest`` tells whether the
loaded state is bit for bit the saved one.
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
