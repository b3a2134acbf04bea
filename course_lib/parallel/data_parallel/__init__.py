"""Data parallelism (chapter 07): every rank holds the whole model and averages its gradients with the others.

- ``ddp``: ``NaiveDDP`` (one all-reduce per parameter after backward) and ``BucketedDDP`` (buckets all-reduced
  while backward still runs), the teaching versions of ``DistributedDataParallel``.
- ``ddp_dynamic``: ``DynamicBucketedDDP``, the opt-in layer for parameters that a step leaves unused.
- ``sync_batchnorm``: SyncBatchNorm by hand, batch statistics over every rank.
"""
