"""Distributed training (chapters 06-08).

- ``launch``: run worker modules under torchrun from a notebook or a test; the worker's init/report/shutdown.
- ``results``: the dataclasses workers report, rebuilt on the parent's side with ``from_dict``.
- ``clock``: timing on the CPU (``perf_counter``) or the GPU (CUDA events), with padding to a fixed duration.
- ``comm``: collectives that count the bytes they send, batched point-to-point messages, a ring all-reduce by hand.
- ``ddp``: ``NaiveDDP`` and ``BucketedDDP``, the teaching versions of ``DistributedDataParallel`` (chapter 06);
  ``ddp_dynamic``: ``DynamicBucketedDDP``, for hook counts, unused parameters and re-sends.
- ``comm``: collectives that count the bytes they send, batched point-to-point messages, a ring all-reduce.
- ``zero``: ZeRO-1/2 by hand (``ZeroOptimizer``) and FSDP2's traffic and memory measured (chapter 08).

Worker entry points live in ``course_lib.workers``.
"""
