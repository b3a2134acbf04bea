"""Chapter 10's experiment: one transformer block split over ranks, by hand and by torch's API, and a 2-D mesh.

    torchrun --nproc-per-node 4 -m course_lib.experiments.workers.tp_compare --tasks ops,byhand,api,mesh

Tasks (``--tasks``, in this order, in one launch, to pay for starting the processes once); rank 0 reports one
``TPReport``:

- ``ops``: the operators f and g (and their sequence-parallel pair) on known tensors;
- ``byhand``: ``TPBlock`` from the model's first block as TP, SP, and SP with Megatron's regather, on groups of 2
  ranks and of the whole world, in float64 and float32, against the single-process block;
- ``api``: the same block under ``parallelize_module`` (TP, then TP + SP) on a 1-D mesh of the whole world;
- ``mesh``: the whole model trained a few Adam steps on (dp, tp) meshes of the world (``--layouts``, e.g.
  ``4x1,2x2,1x4``; SP wherever tp > 1, FSDP2 over dp), against single-process Adam;
- ``vocab``: the embedding, the LM head and the loss split over the vocabulary, on groups of 2 ranks and of the
  whole world, in float64, against one process.

The runs and their checks are ``course_lib.experiments.tp_checks``.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from dataclasses import dataclass

import torch

from course_lib.experiments import launch
from course_lib.experiments import tp_checks
from course_lib.experiments.run_config import RunConfig, build_model
from course_lib.experiments.results import WorkerResult
from course_lib.experiments.tp_checks import BlockResult, MeshResult, VocabResult
from course_lib.env import seed_everything

# ----- what one launch reports: the notebook and the tests rebuild it with TPReport.from_dict -----


@dataclass
class TPReport(WorkerResult):
    """Everything one launch of ``tp_compare`` measured."""

    world: int
    ops: dict
    blocks: list[BlockResult]
    meshes: list[MeshResult]
    ref_saved_bytes: dict[str, int]     # dtype -> what the single-process block saves
    num_params: int = 0
    vocab: list[VocabResult] = dataclasses.field(default_factory=list)

    def block(self, method: str, tp: int, dtype: str = "float64") -> BlockResult:
        """The block run of ``method`` at tensor-parallel size ``tp`` in ``dtype``."""
        for b in self.blocks:
            if (b.method, b.tp, b.dtype) == (method, tp, dtype):
                return b
        raise KeyError(f"no block run {method!r} at tp={tp} in {dtype}; have "
                       f"{sorted({(b.method, b.tp, b.dtype) for b in self.blocks})}")

    def mesh(self, dp: int, tp: int, dtype: str = "float32") -> MeshResult:
        """The training run on a ``dp`` x ``tp`` mesh in ``dtype``."""
        for m in self.meshes:
            if (m.dp, m.tp, m.dtype) == (dp, tp, dtype):
                return m
        raise KeyError(f"no mesh run {dp}x{tp} in {dtype}; have {[(m.dp, m.tp, m.dtype) for m in self.meshes]}")


TASKS = ("ops", "byhand", "api", "mesh", "vocab")


def run_tasks(a: argparse.Namespace, rank: int, world: int, device: torch.device) -> TPReport:
    """Every task of ``a.tasks``: one ``TPReport`` from one launch."""
    cfg, tasks = RunConfig.from_json(a.cfg), launch.pick(a.tasks, TASKS)
    layouts = launch.layouts(a.layouts, world)
    seed_everything(cfg.seed)
    report = TPReport(world=world, ops={}, blocks=[], meshes=[], ref_saved_bytes={},
                      num_params=sum(p.numel() for p in build_model(cfg).parameters()))
    if "ops" in tasks:
        report.ops = tp_checks.run_ops(device)
    if "byhand" in tasks or "api" in tasks:
        report.blocks, report.ref_saved_bytes = tp_checks.run_blocks(cfg, "api" in tasks, device)
        if "byhand" not in tasks:
            report.blocks = [b for b in report.blocks if b.method.startswith("api")]
    if "mesh" in tasks:
        for dtype in [d for d in a.mesh_dtypes.split(",") if d]:
            c = dataclasses.replace(cfg, dtype=dtype)
            ref = tp_checks.reference_training(c)  # once per dtype, for every layout
            report.meshes += [tp_checks.run_mesh(c, dp, tp, device, ref) for dp, tp in layouts]
    if "vocab" in tasks:
        c = dataclasses.replace(cfg, dtype="float64")
        report.vocab = [tp_checks.run_vocab(c, group, device) for group in tp_checks.tp_groups(world).values()]
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated from {TASKS}")
    parser.add_argument("--cfg", default=RunConfig().to_json(), help="RunConfig as JSON (the block and the model)")
    parser.add_argument("--layouts", default="", help="mesh task: comma-separated dp x tp, e.g. 4x1,2x2,1x4")
    parser.add_argument("--mesh-dtypes", default="float32,float64",
                        help="mesh task: train each layout in these dtypes (float64: equality to rounding)")
    # full_tensor() on a 2-D sharded parameter logs a warning that it gathers in two steps: true, and harmless here
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    launch.serve(parser, run_tasks, check=lambda a: launch.pick(a.tasks, TASKS))


if __name__ == "__main__":
    main()
