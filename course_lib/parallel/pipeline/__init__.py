"""Pipeline parallelism (chapter 08): the model cut into stages, one per rank, micro-batches flowing through.

- ``gpipe_1f1b``: GPipe and 1F1B as straight-line steps on one rank (warm-up, steady, cool-down): read it first.
- ``schedules``: schedules as data (GPipe, 1F1B, interleaved, zero bubble) and a simulator that plays them.
- ``split_backward``: the backward split into B (input gradients) and W (weight gradients), for zero bubble.
- ``executor``: one rank running any schedule of its stage, and who sends what to whom, and when.
- ``pipedream``: asynchronous 1F1B with weight stashing.
- ``freeze``: freeze training on a pipeline, frozen stages skip their backward.
"""
