"""Chapter 10's experiment: one transformer block split over ranks, by hand and by torch's API, and a 2-D mesh.

    torchrun --nproc-per-node 4 -m course_lib.workers.tp_compare --tasks ops,byhand,api,mesh

Tasks (``--tasks``, run in this order in one launch, to pay for starting the processes once):

- ``ops``: the operators f and g (and their sequence-parallel pair) on known tensors;
- ``byhand``: ``TPBlock`` from the first block of the tiny transformer, as
  TP, SP, and SP with Megatron's regather, on tensor-parallel groups of 2
  ranks and of the whole world, in float64 and float32: output, input and
  parameter gradients against the single-process block, bytes and calls per
  collective (forward, backward), saved activations per rank;
- ``api``: the same block under ``parallelize_module`` (TP, then TP + SP) on a 1-D mesh of the whole world;
- ``mesh``: the whole model trained a few Adam steps on (dp, tp) meshes of
  the world (``--layouts``, e.g. ``4x1,2x2,1x4``; SP wherever tp > 1), with
  FSDP2 over dp, against single-process Adam: losses, parameters, bytes held
  and saved per rank, bytes sent per step.

The runs and their checks are ``course_lib.distributed.tp_checks``. Every rank
builds the same model from the same seed; the single-process reference runs
on each rank (it is small), so every rank can compare its own part.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from course_lib.distributed import launch
from course_lib.distributed.experiment import RunConfig, build_model
from course_lib.distributed.results import WorkerResult
from course_lib.distributed.tensor_parallel import (TPGroup, copy_to_tp, gather_from_sequence, reduce_from_tp,
                                                    reduce_scatter_to_sequence)
from course_lib.distributed.tp_checks import (BYHAND, BlockResult, MeshResult, block_inputs, block_reference,
                                              reference_training, run_api, run_byhand, run_mesh)
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


def ops_check(device: torch.device) -> dict:
    """f, g and the sequence pair on tensors whose sums are known: rank r holds the value r + 1."""
    tp, world, rank = TPGroup(), dist.get_world_size(), dist.get_rank()

    def ends(y: torch.Tensor, g: torch.Tensor) -> dict:
        return {"forward": y[0, 0, 0].item(), "backward": g[0, 0, 0].item()}

    checks = {  # name: (operator, the gradient sent back, what to read from its output and the input's gradient)
        "f": (copy_to_tp, rank + 1.0, ends),
        "g": (reduce_from_tp, rank + 1.0, ends),
        # (2, world * world, 3): the rank's value in its own rows
        "gather_seq": (gather_from_sequence, 1.0, lambda y, g: {
            "shape": list(y.shape), "rows_of_rank": [y[0, r * world, 0].item() for r in range(world)],
            "backward": g[0, 0, 0].item()}),
        # (2, 1, 3): the sum, this rank's row
        "reduce_scatter_seq": (reduce_scatter_to_sequence, rank + 1.0, lambda y, g: {
            "shape": list(y.shape), "forward": y[0, 0, 0].item(),
            "backward_rows": [g[0, r, 0].item() for r in range(world)]}),
    }
    out = {}
    for name, (op, grad, read) in checks.items():
        x = torch.full((2, world, 3), rank + 1.0, device=device, requires_grad=True)
        y = op(x, tp)
        y.backward(torch.full_like(y, grad))
        out[name] = read(y, x.grad)
    out["sum_of_values"] = world * (world + 1) / 2  # 1 + 2 + ... + world
    return out


def blocks_task(cfg: RunConfig, with_api: bool, device) -> tuple[list[BlockResult], dict[str, int]]:
    """``byhand`` (and ``api``) in float64 and float32, on groups of 2 and of the whole world."""
    world = dist.get_world_size()
    sizes = sorted({s for s in (2, world) if s > 1 and world % s == 0})
    groups = {world: TPGroup()}
    if 2 in sizes and world > 2:
        groups[2] = TPGroup(dist.new_subgroups(2)[0])  # every rank joins its pair: ranks (0, 1), (2, 3), ...
    mesh = init_device_mesh(device.type, (world,)) if with_api else None
    results, ref_saved = [], {}
    for dtype in ("float64", "float32"):
        block, x, w = block_inputs(dataclasses.replace(cfg, dtype=dtype), device)
        ref = block_reference(block, x, w)
        ref_saved[dtype] = ref[3]
        for size in sizes:
            results += [run_byhand(m, block, x, w, ref, groups[size], device) for m in BYHAND]
        if with_api:
            results += [run_api(m, block, x, w, ref, mesh, device) for m in ("api_tp", "api_sp", "api_sp_local")]
    return results, ref_saved


TASKS = ("ops", "byhand", "api", "mesh")


def run_tasks(a: argparse.Namespace, rank: int, world: int, device: torch.device) -> TPReport:
    """Every task of ``a.tasks``: one ``TPReport`` from one launch."""
    cfg, tasks = RunConfig.from_json(a.cfg), launch.pick(a.tasks, TASKS)
    layouts = [tuple(int(v) for v in s.split("x")) for s in a.layouts.split(",") if s] or [(world, 1)]
    for dp, tp in layouts:
        if dp * tp != world:
            raise ValueError(f"layout {dp}x{tp} needs {dp * tp} ranks, the launch has {world}")
    seed_everything(cfg.seed)
    report = TPReport(world=world, ops={}, blocks=[], meshes=[], ref_saved_bytes={},
                      num_params=sum(p.numel() for p in build_model(cfg).parameters()))
    if "ops" in tasks:
        report.ops = ops_check(device)
    if "byhand" in tasks or "api" in tasks:
        report.blocks, report.ref_saved_bytes = blocks_task(cfg, "api" in tasks, device)
        if "byhand" not in tasks:
            report.blocks = [b for b in report.blocks if b.method.startswith("api")]
    if "mesh" in tasks:
        for dtype in [d for d in a.mesh_dtypes.split(",") if d]:
            c = dataclasses.replace(cfg, dtype=dtype)
            ref = reference_training(c)
            report.meshes += [run_mesh(c, dp, tp, device, ref) for dp, tp in layouts]
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
