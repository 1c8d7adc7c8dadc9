"""The run's data: ``data.source`` entries opened as streams (``streams``), the deterministic,
resumable sampler and the evaluation batches (``batches``), and the tokenizer and data built at
start-up (``build``). The storage format, preparation and sampling maths are ``data_pipeline/``.

Imports: ``data_pipeline/``, ``model/`` and ``training.files``.
"""
