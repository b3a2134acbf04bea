"""Distributed training (chapters 06-08).

- ``launch``: run worker modules under torchrun from a notebook or a test; the worker's init/report/shutdown.
- ``comm``: collectives that count the bytes they send; a hand-written ring all-reduce.
- ``ddp``: ``NaiveDDP`` and ``BucketedDDP``, the teaching versions of ``DistributedDataParallel`` (chapter 06).
- ``pipeline``: pipeline schedules as data and their simulator; ``pipeline_exec``: a multi-process executor (chapter 07).
- ``zero``: ZeRO-1/2 by hand (``ZeroOptimizer``) and FSDP2's traffic and memory measured (chapter 08).

Worker entry points live in ``course_lib.workers``.
"""
