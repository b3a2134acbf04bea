"""Typed results: the dataclasses a worker reports and its parent reads back (chapters 07-08).

A worker fills a dataclass that derives from ``WorkerResult`` and hands it to
``launch.report``, which writes ``dataclasses.asdict`` of it as JSON; the
notebook, test or benchmark that started the worker rebuilds the same
dataclass, nested ones included, with ``Result.from_dict(launch.run(...))``.
Both sides then share one definition of what a run measured.

The collectives below gather what a result reports from every rank. They are
not counted: a report is not training traffic.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, TypeVar

import torch
import torch.distributed as dist

R = TypeVar("R", bound="WorkerResult")


class WorkerResult:
    """Base of the dataclasses a worker fills: ``report(result)`` sends ``dataclasses.asdict(result)``,
    and the parent rebuilds the same dataclass with ``Result.from_dict(launch.run(...))``."""

    @classmethod
    def from_dict(cls: type[R], data: dict) -> R:
        return _build(cls, data)


def _build(tp: Any, value: Any) -> Any:
    """``value`` (plain JSON) as type ``tp``: dataclasses, lists, tuples, dicts and ``X | None``, recursively."""
    if value is None:
        return None
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        names = {f.name for f in dataclasses.fields(tp)}
        unknown = set(value) - names
        if unknown:
            raise ValueError(f"{tp.__name__} has no field(s) {sorted(unknown)}: the worker and the parent disagree "
                             "about the result (a stale worker module?)")
        return tp(**{k: _build(hints[k], v) for k, v in value.items()})
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):  # X | None
        return _build(next(a for a in args if a is not type(None)), value)
    if origin is list:
        return [_build(args[0], v) for v in value]
    if origin is tuple:
        items = args[:1] * len(value) if len(args) == 2 and args[1] is Ellipsis else args
        return tuple(_build(a, v) for a, v in zip(items, value))
    if origin is dict:
        return {k: _build(args[1], v) for k, v in value.items()}
    return value


def gather_per_rank(obj: object) -> list:
    """Every rank's ``obj`` (a small picklable value), in rank order, on every rank."""
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def gather_on_first(obj: object) -> list | None:
    """Every rank's ``obj`` in rank order on rank 0 (the one that reports); ``None`` on the others."""
    out: list | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def _reduce(value: float, op: dist.ReduceOp, device: torch.device | str) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return t.item()


def mean_over_ranks(value: float, device: torch.device | str = "cpu") -> float:
    """The mean of a scalar over all ranks. ``device``: where the backend can reduce (NCCL only reduces CUDA tensors)."""
    return _reduce(value, dist.ReduceOp.SUM, device) / dist.get_world_size()


def max_over_ranks(value: float, device: torch.device | str = "cpu") -> float:
    """The largest of a scalar over all ranks."""
    return _reduce(value, dist.ReduceOp.MAX, device)


def max_abs_diff(a: torch.Tensor | list[torch.Tensor], b: torch.Tensor | list[torch.Tensor]) -> float:
    """The largest ``|a - b|`` in float64 on the host, over one tensor pair or over lists of them."""
    if torch.is_tensor(a):
        return (a.detach().double().cpu() - b.detach().double().cpu()).abs().max().item()
    return max(max_abs_diff(x, y) for x, y in zip(a, b))
