"""Sharded training (chapter 09): optimizer state, gradients and parameters split over the ranks.

- ``zero``: ZeRO stages 1 and 2 by hand (``ZeroOptimizer``: reduce-scatter, sharded update, all-gather), their
  formulas, and ZeRO-3 as FSDP2 (``shard_fsdp2``). Start here.
- ``zero_buckets``: the flat layout the shards are cut from: which parameters share a bucket, each rank's slice.
- ``agreement``: the opt-in layer (``GuardedZeroOptimizer``) that lets ranks skip a backward or fail in one
  without leaving their peers waiting, at the price of a flag all-reduce at each end of every backward.
- ``sharded_checkpoint``: an FSDP2 model saved shard by shard, atomically, and loaded at any world size.
"""
