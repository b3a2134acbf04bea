"""Context parallelism (chapter 12): each rank holds a slice of the sequence.

- ``ring_attention``: attention with the keys and values passed round a ring of ranks.
"""
