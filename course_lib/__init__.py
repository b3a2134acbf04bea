"""Helper library of the course "Training neural networks that do not fit".

One concept per module; a module imports only modules listed above it in
DESIGN order (env, data, models, memory, train, norms, checkpointing,
distributed, plots, report, grading, cli).
"""

__version__ = "0.1.0"
