"""The library of the course "Training neural networks that do not fit": what the chapters teach.

Each teaching module is explained by one chapter (its docstring says which), and imports only the modules
listed above it:

- ``timing``: warm-up, repeats, the fastest and the median (chapter 02; used everywhere);
- ``kernels``: each low-precision kernel (bf16, FP8, torchao) timed on this CPU before it is trusted, its verdict
  (native, slow, broken) and the emulated twins the chapters run where it is not native (chapters 00, 05, 06);
- ``env``: device, seeds, profiles and their size tables, the CPU's bf16 speed (chapter 00);
- ``data``: the offline ``shapes`` dataset, CIFAR-10, token sequences, loaders (chapter 00);
- ``models``: the small CNNs and MLPs with a pluggable norm, and the tiny transformer (used from chapter 01 on);
- ``memory``: bytes counted exactly (parameters, gradients, optimizer state, saved activations), ZeRO's formula,
  peaks and the curve of allocated bytes over a step (chapters 01, 05, 09, 11);
- ``estimator``: the same bytes predicted from the model and the batch shape alone (chapters 01, 11);
- ``lora``: freezing and LoRA, fine-tuning with fewer trainable bytes (chapter 01);
- ``parallel_runs``: independent training runs in a few processes at once (chapters 02 and 04);
- ``resume``: the data order as a function of (seed, step), and the checkpoint a run resumes from exactly;
  ``train``: one training loop, ``fit``, and the bare accumulation step (chapters 02-05);
- ``groupnorm``, ``mabn`` and ``fold``: GroupNorm by hand, MABN with its weight-centralised convolution,
  BatchNorm folded into a convolution; ``norms``: the norm factory over them; ``agc``: adaptive gradient
  clipping (chapter 04);
- ``checkpointing``: segment plans, checkpointed forwards, selective checkpointing (chapter 05);
- ``fp8`` and ``fp8_linear``: FP8 formats and their scaling, and a linear layer whose matmuls run in FP8
  (chapter 06);
- ``parallel/``: one folder per parallelism: data parallel (chapter 07), pipeline (08), sharding, ZeRO and
  FSDP2 (09), tensor and sequence parallel (10), context and expert parallel (12), and their collectives;
- ``trace``: profiler traces, read back and drawn (chapters 07, 09, 11);
- ``offload``, ``chunked_loss`` and ``memory_profile``: memory beyond splitting, and the profiler's view of it
  (chapter 11);
- ``moe``: a mixture-of-experts layer in one process (chapter 12);
- ``planner/``: the capstone, measure, predict and search a configuration for a memory budget (chapter 13);
- ``experiments/``: not taught, and not needed to learn a chapter: the harness that launches ranks, times them,
  checks each parallel method against one process, and the ``torchrun`` entry points (chapters 07-13).

``tools/`` is not taught: it runs the course (``course run``), records and reports the claims, draws the plots,
runs the benchmarks, builds the site and grades the exercises.
"""

__version__ = "0.1.0"
