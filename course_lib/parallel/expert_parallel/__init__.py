"""Expert parallelism (chapter 12): a mixture of experts with its experts spread over ranks.

- ``moe_layer``: tokens sent to their experts' ranks with an all-to-all, and back.
"""
