"""Plan a training configuration for a memory budget (chapter 13, the capstone): measure, predict, search.

For every combination of precision (chapters 05 and 06), micro-batch with gradient accumulation (chapters 02-03),
activation checkpointing (chapter 05), ZeRO stage (chapter 09), tensor-parallel size (chapter 10), pipeline
stages and their interleaving (chapter 08), context-parallel size (chapter 12), and chapter 11's fused attention,
chunked loss and activation offload, predict the peak bytes per device and the step time;
keep the fastest that fits. The package reads in that order:

- ``config``: ``Config``, one way to run a step, the planner's answer;
- ``step``: ``train_step`` runs a ``Config`` for real, ``measure_peak`` measures its peak (to verify a plan);
- ``measure``: ``calibrate`` measures a model once, into ``Measurements``;
- ``predict``: ``predict_peak``, ``comm_bytes``, ``predict_step_time``: arithmetic on the measurements;
- ``search``: ``plan`` weighs every candidate and keeps the fastest that fits;
- ``explain``: ``Plan``, the answer, with why it won and the table of every candidate;
- ``experts``: ``predict_experts``, ``plan_experts``: a mixture of experts' bytes per rank over ``e x d`` ranks
  (chapter 12).

Every public name is here too: ``planner.plan``, ``planner.Config``, ``planner.predict_peak``, ...
"""

from course_lib.planner.config import Config, pass_key
from course_lib.planner.measure import (BatchFn, Layers, LmHead, Measurements, calibrate, default_batch, lm_head,
                                        tp_sizes, transformer_layers)
from course_lib.planner.predict import (DEFAULT_BANDWIDTH, DEFAULT_HOST_BANDWIDTH, DEFAULT_TP_BANDWIDTH,
                                        FORWARD_SHARE, block_saves, comm_bytes, offload_bytes, pipeline_terms,
                                        predict_peak, predict_step_time, step_time_parts, tp_comm_bytes,
                                        tp_shares)
from course_lib.planner.explain import MiB, Candidate, Plan, data_parallel_ranks, layout
from course_lib.planner.search import (DEFAULT_HEADROOM, MIN_CHUNK_TOKENS, TIMING_MAX_MICRO, cp_sizes, plan,
                                       segment_options)
from course_lib.planner.experts import ExpertLayout, plan_experts, predict_experts
from course_lib.planner.predict import cp_comm_bytes, cp_in_flight_bytes
from course_lib.planner.step import (PRECISIONS, LossFn, attention_kernel, autocast, checkpointing, fp8_matmuls,
                                     measure_peak, offloading, precision, train_step)

__all__ = [
    "Config", "pass_key",
    "PRECISIONS", "LossFn", "attention_kernel", "autocast", "checkpointing", "fp8_matmuls", "measure_peak",
    "offloading", "precision", "train_step",
    "BatchFn", "Layers", "LmHead", "Measurements", "calibrate", "default_batch", "lm_head", "tp_sizes",
    "transformer_layers",
    "DEFAULT_BANDWIDTH", "DEFAULT_HOST_BANDWIDTH", "DEFAULT_TP_BANDWIDTH", "FORWARD_SHARE", "block_saves",
    "comm_bytes", "offload_bytes", "pipeline_terms", "predict_peak", "predict_step_time", "step_time_parts",
    "tp_comm_bytes", "tp_shares",
    "DEFAULT_HEADROOM", "MIN_CHUNK_TOKENS", "TIMING_MAX_MICRO", "Candidate", "MiB", "Plan", "plan",
    "segment_options", "cp_sizes", "data_parallel_ranks", "layout",
    "ExpertLayout", "plan_experts", "predict_experts", "cp_comm_bytes", "cp_in_flight_bytes",
]
