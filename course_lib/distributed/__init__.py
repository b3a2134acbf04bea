"""Distributed training (chapters 06-08).

- ``launch``: run worker modules under torchrun from a notebook or a test; the worker's init/report/shutdown.
- ``comm``: collectives that count the bytes they send; a hand-written ring all-reduce.
- ``ddp``: ``NaiveDDP`` and ``BucketedDDP``, the teaching versions of ``DistributedDataParallel`` (chapter 06).

Worker entry points live in ``course_lib.workers``.
"""
