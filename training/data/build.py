"""The run's tokenizer and data, built on every rank before the model.

The tokenizer is ``tokenizer.path``, the ``--init-from`` dir's, the one prepared data names, or a
byte-level BPE trained once on a sample of the raw sources by rank 0 (the other ranks load the
folder it names). Raw sources are prepared into the cache by rank 0 with worker processes, the other ranks waiting on a marker file
that hands them the prepared prefixes (no re-planning: at 1,024 ranks that is a stat and a read
of every input per rank); prepared data is only opened, memory-mapped. The run's
``data.source`` and ``data.val_source`` arrive parsed (``DataConfig.train_specs``/``val_specs``).
"""

from __future__ import annotations

import os
from pathlib import Path

from data_pipeline.tokenizer import load_local_tokenizer, load_tokenizer, tokenizer_fingerprint
from training.data import batches, streams
from training.files import CACHE_DIR

def build_tokenizer(recipe, init_from: Path | None, ctx):
    """The run's tokenizer: ``tokenizer.path``; else the init dir's; else, when ``data.source``
    is prepared data only, the one its manifests name; else a byte-level BPE trained once on a
    sample of the raw sources (rank 0 first; the other ranks then read the cache). ``ctx``: the
    run's ``training.run.distributed.DistContext``. The trainer saves it into the run directory
    after the checkpoint load, with config.json."""
    path = recipe.tokenizer.path
    if init_from is not None and path is None and (init_from / "tokenizer").is_dir():
        path = str(init_from / "tokenizer")
    if path is None and not streams.raw_entries(recipe.data.train_specs):
        path = streams.prepared_tokenizer_path(recipe.data.train_specs)
    if path is not None:
        tokenizer = load_local_tokenizer(path)
    else:
        budget = recipe.tokenizer.train_bytes
        with ctx.rank0_first("tokenizer") as handoff:     # the others load the folder rank 0 names
            if handoff.value is None:
                tokenizer = load_tokenizer(None, streams.training_sample(recipe.data, budget),
                                           recipe.tokenizer_vocab_size, CACHE_DIR, max_train_bytes=budget)
                handoff.value = tokenizer.name_or_path
            else:
                tokenizer = load_local_tokenizer(handoff.value)
    if len(tokenizer) > recipe.model.vocab_size:
        raise ValueError(f"model.vocab_size ({recipe.model.vocab_size}) is smaller than the "
                         f"tokenizer ({len(tokenizer)} tokens): raise model.vocab_size")
    return tokenizer


def build_data(recipe, ds: dict, tokenizer, dp_size: int, ctx):
    """The training sampler for this rank and its validation batches. Raw sources are prepared
    into the cache first (rank 0 with worker processes; the other ranks find them prepared);
    prepared data is only opened, memory-mapped."""
    small = recipe.data.max_bytes is not None and recipe.data.max_bytes <= 16_000_000
    workers = 1 if small else max(1, min(8, os.cpu_count() or 1))    # a worker's start costs seconds
    with ctx.rank0_first("prepare data") as handoff:  # the others open what rank 0 prepared
        if handoff.value is None:
            handoff.value = streams.prepare_raw(recipe.data, tokenizer, CACHE_DIR, workers,
                                                progress=ctx.rank == 0)
    prepared = handoff.value
    ctx.end_startup()
    train, val = streams.open_sources(recipe.data, prepared, recipe.model.vocab_size,
                                          tokenizer_fingerprint(tokenizer))
    seq_len, micro = recipe.seq_len, ds["train_micro_batch_size_per_gpu"]
    layout = batches.BatchLayout(ds["train_batch_size"], micro, dp_size, ctx.groups.dp_rank)
    sampler = batches.BlendedSampler([s.train for s in train], [s.name for s in train],
                                      streams.blend_weights(train), seq_len, layout, recipe.train.seed)
    held = val if val is not None else train
    windows = batches.blended_validation_windows(
        [s.train if val is not None else s.val for s in held], streams.blend_weights(held),
        seq_len, recipe.eval.batches * micro * dp_size)
    return sampler, batches.validation_batches(windows, layout)
