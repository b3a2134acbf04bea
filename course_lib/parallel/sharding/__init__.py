"""Sharded training (chapter 09): optimizer state, gradients and parameters split over the ranks.

- ``zero``: ZeRO-1 and ZeRO-2 by hand (``ZeroOptimizer``), and FSDP2's traffic and memory.
- ``zero_buckets``: the flat layout the shards are cut from.
- ``zero_stage1``, ``zero_stage2``: each stage's gradients: all-reduce then keep a shard, or reduce-scatter.
- ``agreement``: the opt-in layer that lets ranks agree on a fault so that none is left waiting.
- ``sharded_checkpoint``: an FSDP2 model saved shard by shard, atomically, and loaded at any world size.
"""
