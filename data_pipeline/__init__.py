"""The data pipeline: raw text -> a prepared, memory-mapped token store -> training samples.

Three layers a reader can tell apart, as Megatron-Core's ``datasets`` splits them:

- **Preparation** (offline, ``launch/prepare_data.py``): ``sources.py`` plans the input as shards
  (it lists files and HF datasets, reads none), ``readers.py`` streams each shard's documents, ``tokenizer.py`` trains or loads the tokenizer,
  ``encoder.py`` tokenizes batches in worker processes, ``prepare.py`` writes and publishes.
- **Storage**: ``indexed.py``, megatron-core's ``.bin``/``.idx`` format, memory-mapped, and the
  prepared datasets (shards + manifest) made of it.
- **Sampling**: ``sampling.py``, which packed window each training sample is, and blends.

Nothing here imports torch, DeepSpeed or the trainer (``training/``), so preparing data needs none
of them. Submodules are imported where used: tokenizer worker processes import only
``encoder.py`` (numpy and ``tokenizers``).
"""
