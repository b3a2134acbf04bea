"""Data parallelism (chapter 07): every rank holds the whole model and averages its gradients with the others.

- ``ddp``: ``NaiveDDP`` (one all-reduce per gradient after backward, the plain loop) and ``BucketedDDP``
  (each ``.grad`` a view into a flat bucket, every bucket all-reduced from a hook while backward still runs),
  the teaching versions of ``DistributedDataParallel``; ``Bucket`` is the bucket and its all-reduce.
- ``ddp_dynamic``: ``DynamicBucketedDDP``, the opt-in layer for parameters that accumulate twice in a backward,
  or that some ranks use and others do not (0/1 flags in each bucket, late buckets re-sent).
- ``sync_batchnorm``: SyncBatchNorm by hand, batch statistics over every rank.
"""
