"""Worker modules started by ``course_lib.experiments.launch.run`` (or by hand with torchrun).

Each is runnable as ``torchrun --nproc-per-node N -m course_lib.experiments.workers.<name> [args]``,
joins the process group with ``launch.init_distributed`` (``--pg-timeout`` sets its
timeout), and hands rank 0's result back with ``launch.report``: for chapters 07 and 08
a dataclass (``results.WorkerResult``) that the parent rebuilds with ``from_dict``.
"""
