"""Checkpoints: where they are (``layout``), writing them in the background and publishing them
(``saving``), every file's size and CRC-32 (``manifest``), resuming from the newest that
verifies (``resume``), weights-only reads (``safe_load``), how each shard was cut for layout
changes (``shard_maps``), and what the trainer carries besides the engine's files (``state``).

Imports: ``model/`` (the collectives of ``model.parallel.comm``) and ``training.files``.
"""
