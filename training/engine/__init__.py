"""The model at this rank's layout and the DeepSpeed engine around it (``build``): the pipeline
form (``pipeline``), the ZeRO-3 build that never holds the whole model (``sharded_build``),
per-block ``torch.compile`` (``compile``).

Imports: ``model/``, ``training.optim``, ``training.checkpoint`` (shard maps).
"""
