"""Tensor and sequence parallelism (chapter 10): each matmul of a block split over the ranks.

- ``layers``: Megatron's column- and row-parallel layers, the operators f and g (and sequence parallelism's
  all-gather and reduce-scatter pair), a split transformer block.
- ``sequence_parallel``: why the LayerNorm regions split on the sequence, and Megatron's regathering linear.
- ``vocab_parallel``: the embedding, the LM head and its cross-entropy split over the vocabulary.
- ``costs``: their bytes, activations and traffic as formulas (chapter 10, and the capstone's planner).
- ``torch_api``: the same split with ``torch.distributed.tensor.parallel``, and a 2-D (dp, tp) mesh.
"""
