"""Tensor and sequence parallelism (chapter 10): each matmul of a block split over the ranks.

- ``layers``: Megatron's column- and row-parallel layers, f and g, a split block, sequence parallelism.
- ``costs``: their bytes, activations and traffic as formulas (chapter 10, and the capstone's planner).
- ``torch_api``: the same split with ``torch.distributed.tensor.parallel``.
"""
