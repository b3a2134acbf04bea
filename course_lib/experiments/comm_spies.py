"""Spies on ``torch.distributed``: what the process group was really handed, beside the counters' formulas.

``calls_to`` records something of every call to a ``torch.distributed`` function inside a block;
``handed_bytes`` records the bytes of every tensor handed to it (e.g. the buckets torch DDP sends).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Iterator

import torch.distributed as dist

from course_lib.parallel.collectives import nbytes


@contextlib.contextmanager
def calls_to(name: str, record: Callable[[object], object]) -> Iterator[list]:
    """Inside the block, record ``record(first argument)`` of every call to ``torch.distributed.<name>``."""
    original, seen = getattr(dist, name), []

    @functools.wraps(original)  # its signature stays torch's, for the spies of blocks inside this one
    def spy(first, *args, **kwargs):
        seen.append(record(first))
        return original(first, *args, **kwargs)

    setattr(dist, name, spy)
    try:
        yield seen
    finally:
        setattr(dist, name, original)


def handed_bytes(name: str) -> contextlib.AbstractContextManager[list[int]]:
    """Inside the block, record the bytes of every tensor handed to ``torch.distributed.<name>``.

    A meter independent of ``ByteCounter``: what the process group was really
    given (e.g. the buckets torch DDP sends), not what a formula says.
    """
    return calls_to(name, nbytes)
