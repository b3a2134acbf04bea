"""The experiments that measure what ``course_lib.parallel`` teaches. You need not read this to learn a chapter.

It launches ranks, times and pads their steps, gathers their results and checks each method against one
process; the notebooks call it, and nothing in ``course_lib.parallel`` imports it.

- ``launch``: run worker modules under torchrun from a notebook or a test; a worker's init, report, shutdown.
- ``results``: the dataclasses workers report, rebuilt on the parent's side.
- ``clock``: timing on the CPU or the GPU, with padding to a fixed duration.
- ``run_config``: the run chapters 09-12 compare their methods on (sizes, model, batches, one-process reference).
- ``dp_methods``: one step of DDP, ZeRO-1/2, ZeroRedundancyOptimizer or FSDP2, measured.
- ``ddp_checks``, ``zero_checks``, ``tp_checks``, ``cp_checks``, ``ep_checks``: each method against one process.
- ``pipeline_model``, ``pipeline_steps``: the model cut into stages, and one measured pipeline step.
- ``pipeline_meter``: the pipeline's instruments (op times, padding, memory, messages, op counts), plugged into its executor.
- ``pipedream_runs``, ``pipeline_freeze``: PipeDream's and freeze training's runs on ``p`` ranks.
- ``step_traces``: one profiled step of DDP or ZeRO per rank.
- ``tp_meters``: what DTensor sends and autograd saves in chapter 10's runs, and a split module's whole gradients.
- ``counting``: the bytes a rank sends by the ring formulas, counted around ``torch.distributed`` (``counted``).
- ``comm_spies``: what ``torch.distributed`` was really handed (calls, bytes), beside the counters' formulas.
- ``zero_meters``: bytes held, collectives issued and bytes sent by the sharded methods; when ZeRO's buckets leave.
- ``moe_runs``: chapter 12's training run of the one-process mixture of experts (its load, with and without
  the auxiliary loss).
- ``checkpoint_runs``: chapter 09's sharded checkpoints put to the test: a crash during a save, a resume, a reshard.
- ``workers/``: the entry points ``torchrun`` starts.
"""
