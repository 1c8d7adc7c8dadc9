"""A training run: the checks before anything starts (``preflight``), process groups
(``distributed``), what a run writes beside its checkpoints (``outputs``), and the run object
itself (``trainer.Run``: preflight -> setup -> loop).

Imports: every other part of ``training/``; nothing in ``training/`` imports it.
"""
