"""Offline preparation: inputs -> tokenized, sharded ``.bin``/``.idx`` pairs and a manifest.

What ``launch/prepare_data.py`` runs (and the trainer, for raw files named in ``data.source``).
For json key K the dataset prefix is ``{output_prefix}_{K}_document`` (Megatron's naming)::

    {prefix}-{i:05d}-of-{N:05d}.bin/.idx   shard i: one per input shard (sources.py), in input order
    {prefix}-{i:05d}-of-{N:05d}.json       written last: documents, tokens, max_token_id, the
                                           tokenizer fingerprint, the source (path, bytes,
                                           mtime_ns, sha256 computed while reading), seconds
    {prefix}.manifest.json                 the tokenizer, the options, every shard's source

Work splits over machines without coordination: ``shard=(i, K)`` prepares the shards j with
j % K == i, and every process writes the same manifest (atomically, by rename). A shard is
published by renames (``IndexedWriter``), each file on the disk before its name and its ``.json``
last, so a killed run (or a crashed node) leaves no visible partial shard, and a rerun skips every
shard whose ``.json`` matches the source's size, mtime and the tokenizer fingerprint and whose
``.bin`` and ``.idx`` have the sizes it records (a damaged one is prepared again).
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import time
from pathlib import Path

from data_pipeline.encoder import Encoder
from data_pipeline.indexed import (IndexedWriter, manifest_path, optimal_dtype, pair_sizes, shard_prefix,
                                  sync_directory, sync_file, temp_file, with_suffix)
from data_pipeline.readers import ShardReader, check_field
from data_pipeline.sources import Fields, ShardPlan, plan_shards

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
BATCH_BYTES = 1_000_000          # text per encode call: ~0.5 s of work, small enough to balance


def dataset_prefix(output_prefix: str | os.PathLike, json_key: str) -> Path:
    """``{output_prefix}_{json_key}_document``: Megatron's name for one key's dataset."""
    return Path(f"{output_prefix}_{json_key}_document")


def _write_json(path: Path, content: dict) -> None:
    """Writes JSON atomically and durably: a temporary file beside it, on the disk, then a
    rename, then the directory's entry on the disk."""
    fd, tmp = temp_file(path, "tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(content, indent=1) + "\n")
            sync_file(f)
        os.replace(tmp, path)
        sync_directory(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def _command(inputs, output_prefix, tokenizer_dir, json_key, append_eod, max_bytes) -> str:
    """The preparation command that finishes this dataset (named in errors about missing shards)."""
    argv = ["python", "launch/prepare_data.py", "--input", *inputs, "--output-prefix",
            str(output_prefix), "--tokenizer", str(tokenizer_dir), "--json-keys", json_key]
    argv += (["--append-eod"] if append_eod else []) + ([f"--max-bytes={max_bytes}"] if max_bytes else [])
    return shlex.join(argv)


def _up_to_date(meta_path: Path, plan: ShardPlan, fingerprint: str, options: dict) -> bool:
    """Whether the shard published at ``meta_path`` (its ``.json``) is this plan's, finished and
    whole: the same source, tokenizer and options, and a ``.bin``/``.idx`` pair of the sizes its
    ``.json`` records (a truncated or lost file, a crash or a copy cut short, is redone)."""
    try:
        meta = json.loads(meta_path.read_text())
        want = pair_sizes(meta["documents"], meta["tokens"], meta["dtype"])
    except (OSError, ValueError, KeyError, TypeError):
        return False
    recorded, now = meta.get("source", {}), plan.describe()
    same_source = all(recorded.get(k) == now[k] for k in ("bytes", "mtime_ns", "stat_key", "budget"))
    prefix = meta_path.with_suffix("")
    try:
        have = (with_suffix(prefix, ".bin").stat().st_size, with_suffix(prefix, ".idx").stat().st_size)
    except OSError:
        return False
    return (same_source and have == want and meta.get("tokenizer_fingerprint") == fingerprint
            and meta.get("options") == options)


def _prepare_shard(plan: ShardPlan, prefix: Path, encoder: Encoder, setup: dict, bar) -> dict:
    """Tokenizes one shard into ``prefix``.bin/.idx, then writes its ``.json``; returns that."""
    start, stats = time.perf_counter(), {"documents": 0, "tokens": 0, "max_token_id": -1}
    reader = ShardReader(plan, setup["options"]["json_key"], setup["fields"])
    done = 0
    with IndexedWriter(prefix, setup["dtype"]) as writer:
        for tokens, lengths, max_id in encoder.map(reader.batches(BATCH_BYTES), f" (shard {prefix.name})"):
            writer.add_documents(tokens, lengths)
            stats["documents"] += len(lengths)
            stats["tokens"] += len(tokens)
            stats["max_token_id"] = max(stats["max_token_id"], max_id)
            bar.update(reader.progress - done)
            done = reader.progress
        if stats["max_token_id"] >= setup["vocab_size"]:     # raised inside: nothing is published
            raise ValueError(f"{prefix}: token id {stats['max_token_id']} >= the tokenizer's "
                             f"vocabulary ({setup['vocab_size']}); fix: check the tokenizer folder")
    meta = {"format": FORMAT_VERSION, **stats, "dtype": setup["dtype"].name,
            "max_token_id": stats["max_token_id"] if stats["documents"] else None,
            "tokenizer_fingerprint": setup["fingerprint"], "options": setup["options"],
            "source": {**plan.describe(), "sha256": reader.sha256},
            "seconds": round(time.perf_counter() - start, 3)}
    _write_json(with_suffix(prefix, ".json"), meta)
    return meta


def prepare_dataset(inputs: list[str], output_prefix: str | os.PathLike, tokenizer_dir: str | os.PathLike,
                    *, json_key: str = "text", workers: int = 1, append_eod: bool = True,
                    shard: tuple[int, int] = (0, 1), progress: bool = True,
                    max_bytes: int | None = None, fields: Fields = Fields()) -> Path:
    """Prepares (or skips, when already prepared) and returns the dataset prefix.

    Args:
        inputs: Files, directories, globs, ``hf:NAME[:SPLIT]``, ``hf-stream:NAME[:SPLIT]`` or
            ``stdlib`` (``sources.py``).
        output_prefix: Where to write; the dataset is ``{output_prefix}_{json_key}_document``.
        tokenizer_dir: An HF tokenizer folder.
        json_key: The text field of JSON lines / Parquet / HF rows.
        workers: Tokenizer processes (``encoder.py``).
        append_eod: Append the tokenizer's EOS id after each document.
        shard: ``(i, K)``: prepare only the shards j with j % K == i.
        progress: Show a progress bar (bytes, MB/s, ETA).
        max_bytes: Keep only about this many bytes of input text (``sources.plan_shards``).
        fields: The caller's names for the settings, for error messages.

    Returns:
        ``{output_prefix}_{json_key}_document``.

    Raises:
        ValueError: one line naming the setting, before anything is written for a bad input or
            tokenizer (a row without the field deep in a file fails that shard, leaving no part
            of it visible).
    """
    from data_pipeline.tokenizer import load_local_tokenizer, tokenizer_fingerprint
    from tqdm import tqdm

    index, count = shard
    if not (isinstance(index, int) and isinstance(count, int) and 0 <= index < count):
        raise ValueError(f"--shard ({index}/{count}) must be i/K with 0 <= i < K; fix: e.g. --shard 0/4")
    tokenizer = load_local_tokenizer(tokenizer_dir, fields.tokenizer)
    plans = plan_shards(list(inputs), json_key, max_bytes, fields)
    prefix = dataset_prefix(output_prefix, json_key)
    vocab_size, eos = len(tokenizer), tokenizer.eos_token_id
    fingerprint = tokenizer_fingerprint(tokenizer)
    options = {"json_key": json_key, "append_eod": append_eod}
    setup = {"dtype": optimal_dtype(vocab_size), "vocab_size": vocab_size, "fingerprint": fingerprint,
             "options": options, "fields": fields}
    shard_prefixes = [shard_prefix(prefix, i, len(plans)) for i in range(len(plans))]
    manifest = {
        "format": FORMAT_VERSION,
        "tokenizer": {"fingerprint": fingerprint, "vocab_size": vocab_size, "eos_token_id": eos,
                      "path": str(tokenizer_dir)},
        **options, "max_bytes": max_bytes, "dtype": setup["dtype"].name, "inputs": list(inputs),
        "command": _command(inputs, output_prefix, tokenizer_dir, json_key, append_eod, max_bytes),
        "shards": [{"prefix": p.name, "source": plan.source, "bytes": plan.bytes}
                   for p, plan in zip(shard_prefixes, plans)],
    }
    mine = [j for j in range(len(plans)) if j % count == index]
    todo = [j for j in mine if not _up_to_date(with_suffix(shard_prefixes[j], ".json"), plans[j],
                                              fingerprint, options)]
    for j in todo:               # this process's shards only: K machines share the opening of files
        check_field(plans[j], json_key, fields)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    mpath = manifest_path(prefix)
    if not mpath.is_file() or json.loads(mpath.read_text()) != manifest:    # a rerun rewrites nothing
        _write_json(mpath, manifest)
    logger.info("%s: %d shards, %d for shard %d/%d, %d already prepared", prefix, len(plans), len(mine),
                index, count, len(mine) - len(todo))
    if not todo:
        return prefix
    sizes = [plans[j].bytes for j in todo]
    total = None if None in sizes else sum(sizes)
    eod = eos if append_eod else None
    backend = tokenizer.backend_tokenizer.to_str()
    with Encoder(backend, eod, setup["dtype"], workers) as encoder, \
            tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1000, desc=prefix.name,
                 disable=not progress or not todo, mininterval=2.0) as bar:
        for j in todo:
            start = time.perf_counter()
            # A stale .json goes first: from here until the new one lands, the shard is unfinished.
            with_suffix(shard_prefixes[j], ".json").unlink(missing_ok=True)
            meta = _prepare_shard(plans[j], shard_prefixes[j], encoder, setup, bar)
            secs = time.perf_counter() - start
            logger.info("shard %d/%d (%s): %d documents, %d tokens, %.1f MB in %.1f s (%.2f MB/s)",
                        j, len(plans), plans[j].source, meta["documents"], meta["tokens"],
                        (plans[j].bytes or 0) / 1e6, secs, (plans[j].bytes or 0) / 1e6 / max(secs, 1e-9))
    return prefix
