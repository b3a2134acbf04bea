"""Context parallelism (chapter 12): each rank holds a slice of the sequence.

- ``ring_attention``: attention with the keys and values passed round a ring of ranks, forward and backward
  (start here: the ring pass and the online-softmax merge are on its first screen).
- ``layout``: which positions each rank holds (plain or zigzag) and the visible tile of each block.
- ``model``: the transformer on one rank's positions, attention over the ring, and its share of the loss.
"""
