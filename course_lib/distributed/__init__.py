"""Distributed training (chapters 07-10 and 12; chapters 11 and 13 launch its workers too).

- ``launch``: run worker modules under torchrun from a notebook or a test; the worker's init/report/shutdown.
- ``results``: the dataclasses workers report, rebuilt on the parent's side with ``from_dict``.
- ``clock``: timing on the CPU (``perf_counter``) or the GPU (CUDA events), with padding to a fixed duration.
- ``comm``: collectives that count the bytes they send, batched point-to-point messages, a ring all-reduce by hand.
- ``ddp``: ``NaiveDDP`` and ``BucketedDDP``, the teaching versions of ``DistributedDataParallel`` (chapter 07);
  ``ddp_dynamic``: ``DynamicBucketedDDP``, for hook counts, unused parameters and re-sends; ``sync_batchnorm``:
  SyncBatchNorm by hand; ``ddp_checks``: the wrappers against one process, counted and timed; ``step_traces``:
  one profiled step of DDP or ZeRO per rank.
- ``pipeline``: pipeline schedules as data and a simulator that plays them (chapter 08); ``pipeline_messages``:
  who sends what to whom, and when; ``pipeline_split``: the backward split into B and W (zero bubble);
  ``pipeline_exec``: one rank running its stage's schedule; ``pipeline_model``: the model cut into stages;
  ``pipeline_steps``: one step on ``p`` ranks against the sequential model; ``pipedream``: asynchronous 1F1B
  with weight stashing; ``pipeline_freeze``: freeze training on a pipeline.
- ``experiment``: the run chapters 09-12 compare their methods on (sizes, model, batches, single-process reference);
  ``dp_methods``: one step of DDP, ZeRO-1/2, ZeroRedundancyOptimizer or FSDP2 on it, measured.
- ``zero``: ZeRO-1/2 by hand (``ZeroOptimizer``) and FSDP2's traffic and memory measured (chapter 09).
  Its pieces: ``zero_buckets`` (the flat layout), ``zero_stage1`` and ``zero_stage2`` (each stage's gradients),
  ``zero_agreement`` (what the ranks agree on so that none is left waiting); ``zero_checks``: those cases
  against single-process Adam.
- ``sharded_checkpoint``: an FSDP2 model's checkpoint saved shard by shard, atomically, and loaded at any world size;
  a run that crashes while saving, resumes, and loads at another world size.
- ``tensor_parallel``: Megatron's column- and row-parallel layers, f and g, sequence parallelism (chapter 10);
  ``tp_costs``: their bytes, activations and traffic in formulas (chapter 10, and the capstone's planner).
  ``tp_api``: the same with torch's API; ``tp_checks``: a split block and a (dp, tp) mesh against one process.
- ``context_parallel``: ring attention over ranks that each hold a slice of the sequence (chapter 12);
  ``cp_checks``: it and torch's ``context_parallel`` against one process. ``expert_parallel``: a mixture of
  experts spread over ranks (chapter 12); ``ep_checks``: it against one process.

Worker entry points live in ``course_lib.workers``.
"""
