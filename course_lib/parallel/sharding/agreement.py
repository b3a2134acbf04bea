"""What keeps ZeroOptimizer's ranks in step: what they agree on, and the checks that stop misuse (chapter 09).

A collective returns only when every rank of the group has called it: a rank
that calls one its peers never call waits, on NCCL for ever (or for the process
group's timeout). Stage 2 starts its reduce-scatters from gradient hooks, so
which collectives a rank calls depends on what its own backward did. Three
things keep every rank's sequence the same:

- ``Flags``: small all-reduces of integer flags. Every backward starts with one
  ("I am in a backward") and ends with one (the ranks that saw an error, the
  buckets that got a gradient anywhere); ``step`` asks once more whether some
  rank ran a backward that this one skipped, and joins it with zeros, as
  torch's ``Join`` does for DDP. An error is raised on every rank together.
- ``global_norm``: clipping needs the norm of the whole averaged gradient, of
  which each rank holds only its slices: one all-reduce of one number.
- ``GradVersion``: stage 1's check that nobody changed the gradients in place
  after the backward or after ``step``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib.parallel import collectives as comm

MISUSE = ("(clip_grad_norm_ on the model?). Under ZeRO each rank holds its own, unaveraged gradient until step() "
          "reduces it, and afterwards the mean only in its own slice: clip (or read the norm) with "
          "ZeroOptimizer.clip_grad_norm_(max_norm) between the backward and step(); scale the loss to scale it")


def flag_group() -> dist.ProcessGroup | None:
    """The group ``ZeroOptimizer``'s flags travel on, as CPU tensors: the default one where it has gloo (gloo, or
    launch's ``cpu:gloo,cuda:nccl``), else a gloo group of the same ranks, made for them (collectively: every rank
    builds its optimizer together, as the broadcast of the weights needs anyway).

    The flags are read on the host as soon as they are summed. Summed on an NCCL
    group, on the GPU, reading them would make the host wait for everything the
    device has queued: in the first gradient hook, in the middle of the backward,
    and again at its end. Through gloo it costs a round trip between the hosts.
    """
    if "gloo" in str(dist.get_backend()).lower():
        return None
    return dist.new_group(backend="gloo")


class Flags:
    """Integer flags summed over the ranks, blocking; ``calls`` counts the all-reduces (a few bytes each).

    Stage 2 spends two per backward (``backward_starts``, ``backward_ends``) and
    one per ``step`` or ``clip_grad_norm_`` (``others_in_backward``), plus two
    for each backward of another rank that it joins (the question, and the end).
    """

    def __init__(self) -> None:
        self.group = flag_group()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.calls = 0

    def sum(self, flags: list[int], at: int | None = None) -> list[int]:
        """Sum ``flags`` over the ranks (``at``: set flag ``at`` to 1 on this rank first)."""
        t = torch.tensor(flags, dtype=torch.int32)  # host: read back at once, see flag_group
        if at is not None:
            t[at] = 1
        dist.all_reduce(t, group=self.group)
        self.calls += 1
        return t.tolist()

    def backward_starts(self) -> None:
        """Say that this rank is in a backward; ranks that skipped theirs answer from ``step``."""
        self.sum([1])

    def others_in_backward(self) -> bool:
        """In ``step`` (and ``clip_grad_norm_``): is some rank in a backward this one skipped? (This one says no.)"""
        return self.sum([0])[0] > 0

    def backward_ends(self, used: list[bool], failed: bool) -> tuple[list[int], list[int]]:
        """At a backward's end: per rank, whether it failed; per bucket, how many ranks got a gradient for it."""
        summed = self.sum([0] * self.world + [int(u) for u in used], at=self.rank if failed else None)
        return summed[:self.world], summed[self.world:]


def raise_together(failed: list[int], mine: str | None) -> None:
    """Raise on every rank if ``failed`` (from ``backward_ends``) names any rank; ``mine``: this rank's error."""
    if any(failed):
        ranks = [r for r, e in enumerate(failed) if e]
        raise RuntimeError(f"ZeroOptimizer: the backward failed on rank(s) {ranks}; every rank raises this "
                           f"error together" + (f": {mine}" if mine else ""))


@torch.no_grad()
def global_norm(grads: list[torch.Tensor], counter: comm.ByteCounter, like: torch.Tensor) -> torch.Tensor:
    """The L2 norm of the gradient whose slices the ranks hold (``grads``: this rank's), in ``like``'s dtype.

    Every element lives in exactly one rank's slice (the padding is zero), so
    the squared norm is the sum over ranks of the slices' squared norms: one
    all-reduce of one float64 number, counted in ``counter``. Returns a
    one-element tensor on ``like``'s device, the same on every rank.
    """
    sq = torch.zeros(1, dtype=torch.float64, device=like.device)
    for g in grads:
        sq += g.double().pow(2).sum()
    comm.all_reduce(sq, counter=counter)  # the sum of every rank's slices
    return sq.sqrt().to(like.dtype)


class GradVersion:
    """Stage 1: notice a gradient buffer changed in place since ``note`` (a clip of the model's gradients).

    Each rank checks on its own, with no flag: the misuse it is for runs the
    same code on every rank, so every rank raises before any collective (a
    change on one rank alone would leave the others waiting in the
    reduce-scatter). It costs a comparison of two integers, a tensor's version
    counter against the one noted.
    """

    def __init__(self) -> None:
        self.noted: int | None = None

    def note(self, grads: torch.Tensor) -> None:
        self.noted = grads._version  # views share their base's version counter

    def forget(self) -> None:
        self.noted = None

    def check(self, grads: torch.Tensor, since: str) -> None:
        """Raise if ``grads`` changed since ``note`` (``since``: "after the backward", "after step()")."""
        if self.noted is not None and grads._version != self.noted:
            self.noted = None  # said once
            raise RuntimeError(f"the gradients were changed in place {since} {MISUSE}")
