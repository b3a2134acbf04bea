"""Sharded checkpoints of an FSDP2 model with ``torch.distributed.checkpoint`` (DCP), chapter 09.

Each rank writes only its own shards (``__<rank>_<k>.distcp`` files) and the coordinator writes ``.metadata`` last,
which says where every piece of every tensor lives. Loading reads the pieces each rank needs *at the loader's world
size*, so a checkpoint saved on 2 ranks loads on 1 or 4.

What a crash costs: a folder without ``.metadata`` cannot be loaded, yet DCP would overwrite an older checkpoint in the
same folder. So each checkpoint is written into ``step_NNNNNN.partial`` and renamed to ``step_NNNNNN`` when complete:
``rename`` is atomic on POSIX file systems, so a crash during a save loses only that save. (Chapter 09 crashes,
resumes and reshards a run with these three functions: ``checkpoint_runs`` in the experiments.)
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

CKPT = re.compile(r"^step_(\d{6})$")


def save_checkpoint(root: str | Path, step: int, model: torch.nn.Module, opt: torch.optim.Optimizer,
                    meta: dict, writer: type[FileSystemWriter] = FileSystemWriter) -> Path:
    """Write a sharded checkpoint to ``root/step_NNNNNN`` atomically (every rank calls this); ``meta``: JSON
    that rank 0 saves beside it (``writer``: DCP's storage writer, a subclass to inject a crash)."""
    root = Path(root)
    final, partial = root / f"step_{step:06d}", root / f"step_{step:06d}.partial"
    msd, osd = get_state_dict(model, opt)  # DTensors: each rank hands over only its shards
    dcp.save({"model": msd, "optim": osd}, storage_writer=writer(str(partial)))
    if dist.get_rank() == 0:
        (partial / "meta.json").write_text(json.dumps({**meta, "step": step}))
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
