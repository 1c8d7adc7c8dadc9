"""A training run: the checks before anything starts (``preflight``), process groups
(``distributed``), the host's CPU and CUDA checks (``host``), what a run writes beside its
checkpoints (``outputs``), and the run object itself (``trainer.Run``: preflight -> setup ->
loop); ``spawn`` starts ranks on one host for the tests and benchmarks.

Imports: every other part of ``training/``; nothing in ``training/`` imports it.
"""
