"""Parallel training, one folder per way of splitting the work (chapters 07-10 and 12).

Read these to learn a chapter; each file fits one sitting and starts with the idea.

- ``collectives``: the collectives every folder uses, counting the bytes they send; a ring all-reduce by hand.
- ``data_parallel/``: every rank a whole model, gradients averaged: NaiveDDP, BucketedDDP (chapter 07).
- ``pipeline/``: the model cut into stages, micro-batches flowing through them: GPipe, 1F1B (chapter 08).
- ``sharding/``: optimizer state, gradients and parameters split over ranks: ZeRO, FSDP2 (chapter 09).
- ``tensor_parallel/``: each matmul split over ranks, Megatron style, sequence parallelism, the vocabulary split (chapter 10).
- ``context_parallel/``: the sequence split over ranks, attention passed round a ring (chapter 12).
- ``expert_parallel/``: a mixture of experts with its experts spread over ranks (chapter 12).

The code that launches ranks and measures them lives apart, in ``course_lib.experiments``.
"""
