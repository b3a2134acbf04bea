"""Weak scaling of data-parallel training: throughput against world size (chapter 07).

    torchrun --nproc-per-node 4 -m course_lib.experiments.workers.ddp_scaling --batch 16 --steps 5

Each rank trains a ResNet with torch DDP on its own ``--batch`` samples per
step (weak scaling: the global batch grows with the world size), reading its
shard of the offline shapes dataset through ``DistributedSampler``. Rank 0
reports (``ScalingResult``) samples per second over all ranks, the step time,
the step time with ``no_sync()`` (the same work without the all-reduce:
compute alone) and its CPU time, and the bytes a hand-written ring all-reduce
of the gradient sends, against the 2(N-1)/N formula. Times come from CUDA
events on GPU ranks (``clock.clock_for``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from course_lib import data
from course_lib.parallel import collectives as comm
from course_lib.experiments import launch
from course_lib.experiments.clock import Clock, clock_for, slowest_rank_s
from course_lib.experiments.counting import ByteCounter, counted
from course_lib.experiments.results import WorkerResult
from course_lib.models import ResNet


@dataclass
class ScalingResult(WorkerResult):
    world: int
    batch_per_rank: int
    global_batch: int
    step_ms: float          # median step, as slow as the slowest rank
    compute_ms: float       # the same step under no_sync(): the work without the all-reduce
    compute_cpu_ms: float   # CPU time of one such step on rank 0: the work itself, whatever else runs
    samples_per_s: float
    clock: str
    grad_bytes: int
    ring_bytes: float
    ring_ratio: float
    ring_max_abs_diff: float
    shard_size: int         # samples of the dataset that DistributedSampler gave rank 0
    cpu_count: int
    backend: str


def _timed_steps(model: DDP, opt: torch.optim.Optimizer, batches: list, sync: bool,
                 clock: Clock) -> tuple[float, float]:
    """Median seconds per step over ``batches`` (each step as slow as the slowest rank), and the CPU seconds of the
    least disturbed step (ranks sharing cores inflate one another's CPU time: caches, memory bandwidth)."""
    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        with contextlib.nullcontext() if sync else model.no_sync():
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
        opt.step()
    times, cpu = zip(*(slowest_rank_s(lambda: step(x, y), clock, x.device) for x, y in batches))
    return statistics.median(times), min(cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16, help="samples per rank per step")
    parser.add_argument("--steps", type=int, default=5, help="timed steps (after one warm-up step)")
    parser.add_argument("--width", type=int, default=8, help="ResNet width")
    parser.add_argument("--seed", type=int, default=0)
    launch.serve(parser, weak_scaling)


def weak_scaling(a: argparse.Namespace, rank: int, world: int, device: torch.device) -> ScalingResult:
    """Time DDP steps on this rank's shard, with and without the all-reduce; one ring all-reduce counted."""
    dataset = data.load_dataset("shapes", "train", n=world * a.batch * (a.steps + 1), seed=a.seed)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=a.seed)
    sampler.set_epoch(0)  # a different shuffle each epoch, the same on every rank
    loader = DataLoader(dataset, batch_size=a.batch, sampler=sampler, drop_last=True)
    batches = [(x.to(device), y.to(device)) for x, y in loader]  # loaded up front: time the training, not the loader

    torch.manual_seed(a.seed)
    model = DDP(ResNet(a.width).to(device), device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    clock = clock_for(device)
    _timed_steps(model, opt, batches[:1], True, clock)  # warm-up: allocations, DDP's first-step bookkeeping
    step_s, _ = _timed_steps(model, opt, batches[1:], True, clock)
    compute_s, compute_cpu_s = _timed_steps(model, opt, batches[1:], False, clock)

    # communication volume of one gradient all-reduce, by the hand-written ring
    flat = torch.cat([p.grad.flatten() for p in model.parameters()])
    expected = flat.clone()
    dist.all_reduce(expected)
    counter = ByteCounter()
    with counted(counter, p2p="ring_all_reduce"):  # the bytes each of its sends carries
        comm.ring_all_reduce(flat)
    grad_bytes = comm.nbytes(flat)
    return ScalingResult(
        world=world, batch_per_rank=a.batch, global_batch=world * a.batch,
        step_ms=step_s * 1e3, compute_ms=compute_s * 1e3, compute_cpu_ms=compute_cpu_s * 1e3,
        samples_per_s=world * a.batch / step_s, clock=clock.name,
        grad_bytes=grad_bytes, ring_bytes=counter.bytes, ring_ratio=counter.bytes / grad_bytes,
        ring_max_abs_diff=(flat - expected).abs().max().item(),
        shard_size=len(sampler), cpu_count=os.cpu_count() or 1, backend=dist.get_backend())


if __name__ == "__main__":
    main()
