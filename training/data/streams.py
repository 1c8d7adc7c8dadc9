"""``data.source`` and ``data.val_source`` -> prepared datasets -> train and validation streams.

The forms of both keys (Megatron's ``--data-path`` forms):

- one entry, or a list of entries: every entry's documents together, each entry weighted by its
  size (its training windows), so each document is as likely as any other;
- a blend ``[0.3, A, 0.7, B]``: weights (normalized to sum 1) before each entry.

An entry is prepared data (a ``launch/prepare_data.py`` output prefix, ``P.manifest.json``; or
any Megatron ``P.bin``/``P.idx`` pair, with or without our manifest) or raw text prepared once
into the cache, on the same path (``stdlib``, the embedded default; ``.txt``/``.jsonl``/
``.parquet`` files or globs; ``hf:<name>[:split]``). Each entry as written is one source in the
metrics' ``tokens_by_source``.

Without ``data.val_source`` each dataset holds out the last ``data.val_fraction`` of every shard's
documents (at least one document in all; stdlib is prepared in a fixed hash order of its files,
so the tail samples the whole library). Nothing here reads a token: streams are ranges of
memory-mapped shards.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data_pipeline.sampling import TokenStream

PREPARED_FORMAT_VERSION = 1          # bump when the trainer's raw-source preparation changes


@dataclass(frozen=True)
class SourceSpec:
    """One entry of ``data.source`` as written, with its blend weight (None: by size)."""

    name: str
    weight: float | None = None


def parse_sources(value, field: str = "data.source") -> tuple[SourceSpec, ...]:
    """The entries of ``data.source`` / ``data.val_source``; ValueError naming ``field``.

    A list holding any number is a blend and must alternate number, entry.
    """
    items = [value] if isinstance(value, str) else list(value)
    if not items:
        raise ValueError(f"{field} is empty: use stdlib, a prepared prefix, files, or a blend "
                         f"[weight, prefix, ...]")
    is_number = [isinstance(v, (int, float)) and not isinstance(v, bool) for v in items]
    if not any(is_number):
        if not all(isinstance(v, str) and v for v in items):
            raise ValueError(f"{field} ({items!r}): every entry must be a non-empty string")
        return tuple(SourceSpec(v) for v in items)
    if len(items) % 2 or not all(is_number[0::2]) or any(is_number[1::2]):
        raise ValueError(f"{field} ({items!r}) mixes entries and numbers: a blend is "
                         f"[weight, prefix, weight, prefix, ...]")
    specs = []
    for weight, name in zip(items[0::2], items[1::2]):
        if not (math.isfinite(weight) and weight > 0):
            raise ValueError(f"{field}: the weight of {name!r} is {weight}; blend weights must be "
                             f"positive numbers")
        if not (isinstance(name, str) and name):
            raise ValueError(f"{field} ({items!r}): every entry must be a non-empty string")
        specs.append(SourceSpec(name, float(weight)))
    return tuple(specs)


def is_prepared(entry: str) -> bool:
    """A prepare_data.py output prefix, or a Megatron .bin/.idx pair."""
    return Path(f"{entry}.manifest.json").is_file() or (
        Path(f"{entry}.idx").is_file() and Path(f"{entry}.bin").is_file())


def raw_entries(specs) -> list[str]:
    return [s.name for s in specs if not is_prepared(s.name)]


def cache_prefix(cache_dir: Path, entry: str, tokenizer_fingerprint: str, json_key: str,
                 max_bytes: int | None) -> Path:
    """Where the trainer prepares a raw entry: one folder per (entry, tokenizer, key, cap)."""
    where = entry if entry == "stdlib" or entry.startswith("hf:") else str(Path(entry).absolute())
    key = hashlib.sha256(f"v{PREPARED_FORMAT_VERSION}|{where}|{tokenizer_fingerprint}|{json_key}|"
                         f"{max_bytes}".encode()).hexdigest()[:16]
    return cache_dir / "prepared" / key / "data"


@dataclass(frozen=True)
class Source:
    """One entry, opened: its dataset's train and validation streams."""

    name: str
    weight: float | None
    train: TokenStream
    val: TokenStream | None
    num_documents: int


def split_documents(dataset, val_fraction: float | None) -> tuple[TokenStream, TokenStream | None]:
    """Train and validation streams of a prepared dataset: the last ``val_fraction`` of each
    shard's documents held out (None: nothing held out)."""
    train, val, held = [], [], []
    for shard in dataset.shards:
        n = shard.num_documents
        held.append(0 if val_fraction is None or n < 2 else int(n * val_fraction))
    if val_fraction is not None and not any(held):        # at least one document in all
        biggest = max(range(len(dataset.shards)), key=lambda i: dataset.shards[i].num_documents)
        if dataset.shards[biggest].num_documents < 2:
            raise ValueError(f"data.source entry {str(dataset.prefix)!r} has too few documents to "
                             f"hold any out for validation; fix: set data.val_source")
        held[biggest] = 1
    for shard, n_val in zip(dataset.shards, held):
        first_val = shard.num_documents - n_val
        cut = int(shard.document_bounds(first_val)[0]) if n_val else shard.num_tokens
        if cut:
            train.append((shard.tokens, 0, cut))
        if n_val:
            val.append((shard.tokens, cut, shard.num_tokens))
    return TokenStream(tuple(train)), (TokenStream(tuple(val)) if val_fraction is not None else None)


def check_dataset(dataset, name: str, vocab_size: int, tokenizer_fingerprint: str | None,
                  field: str = "data.source") -> None:
    """The tokenizer it was prepared with, and token ids below the model's vocabulary (the
    manifest's maximum, or for a Megatron dataset without one a scan of its tokens)."""
    fp = dataset.tokenizer_fingerprint
    if fp is not None and tokenizer_fingerprint is not None and fp != tokenizer_fingerprint:
        made_with = (dataset.manifest or {}).get("tokenizer", {}).get("path", "?")
        raise ValueError(f"{field} entry {name!r} was prepared with another tokenizer ({made_with}, "
                         f"fingerprint {fp[:12]}, this run's is {tokenizer_fingerprint[:12]}); fix: "
                         f"set tokenizer.path to the one it was prepared with, or prepare it again "
                         f"with this run's tokenizer")
    top = dataset.max_token_id
    if top is None:
        top = max((_max_token(s.tokens) for s in dataset.shards), default=-1)
    if top >= vocab_size:
        raise ValueError(f"{field} entry {name!r} holds token id {top}, not below model.vocab_size "
                         f"({vocab_size}); fix: set model.vocab_size above {top}, or use the "
                         f"tokenizer it was prepared with")


def _max_token(tokens: np.ndarray, chunk: int = 1 << 26) -> int:
    """The largest id of a memory-mapped token array, a chunk at a time (bounded memory)."""
    top = -1
    for start in range(0, len(tokens), chunk):
        top = max(top, int(np.max(tokens[start:start + chunk])))
    return top


# ----------------------------------------------------------------------------------------------
# Building the run's sources (called by training/data/build.py on every rank).

def check_entries(data_cfg, vocab_size: int, tokenizer=None) -> None:
    """Every entry names prepared data that opens (with, when it has a manifest, token ids below
    ``vocab_size`` and the fingerprint of ``tokenizer``, the run's when ``tokenizer.path`` names
    it), or raw text that exists: one line otherwise, before anything is written. A Megatron
    dataset without a manifest has its ids checked once its tokens are mapped
    (``open_sources``)."""
    from data_pipeline import indexed, readers, sources
    from data_pipeline.tokenizer import tokenizer_fingerprint
    fp = tokenizer_fingerprint(tokenizer) if tokenizer is not None else None
    train, val = data_cfg.train_specs, data_cfg.val_specs
    for field, specs in (("data.source", train), ("data.val_source", val or ())):
        for spec in specs:
            if is_prepared(spec.name):
                try:
                    dataset = indexed.open_prepared(spec.name)
                except ValueError as err:
                    raise ValueError(f"{field} entry {spec.name!r}: {err}") from None
                if dataset.manifest is not None:
                    check_dataset(dataset, spec.name, vocab_size, fp, field)
                continue
            try:
                fields = sources.Fields(input=field, json_key="data.text_field")
                readers.check_fields(sources.plan_shards([spec.name], data_cfg.text_field,
                                                         data_cfg.max_bytes, fields),
                                     data_cfg.text_field, fields)
            except ValueError as err:
                raise ValueError(f"{err}, or the prefix of prepared data "
                                 f"({spec.name}.bin/.idx)") from None


def prepared_tokenizer_path(specs) -> str | None:
    """The tokenizer folder the prepared entries' manifests name, when they agree and it exists."""
    from data_pipeline import indexed
    paths = {(indexed.open_prepared(s.name).manifest or {}).get("tokenizer", {}).get("path") for s in specs}
    paths.discard(None)
    if len(paths) == 1 and Path(next(iter(paths))).is_dir():
        return next(iter(paths))
    return None


def training_sample(data_cfg, max_bytes: int) -> list[str]:
    """About ``max_bytes`` of the raw entries' text, spread over them, to train a tokenizer."""
    from data_pipeline import readers
    raw = raw_entries(data_cfg.train_specs)
    if not raw:
        raise ValueError("data.source is prepared data only, so there is no text to train a "
                         "tokenizer on; fix: set tokenizer.path to the tokenizer it was prepared with")
    return readers.sample_texts(raw, data_cfg.text_field, max_bytes)


def blend_weights(sources: list[Source]) -> list[float] | None:
    """The blend's weights, or None (by size) for a list without them."""
    return None if any(s.weight is None for s in sources) else [s.weight for s in sources]


def prepare_raw(data_cfg, tokenizer, cache_dir: Path, workers: int, progress: bool = True) -> dict[str, str]:
    """Prepares (or finds prepared) every raw entry into the cache; entry -> dataset prefix."""
    from data_pipeline.prepare import prepare_dataset
    from data_pipeline.sources import Fields
    from data_pipeline.tokenizer import tokenizer_fingerprint
    fp = tokenizer_fingerprint(tokenizer)
    out = {}
    for spec in (*data_cfg.train_specs, *(data_cfg.val_specs or ())):
        if spec.name in out or is_prepared(spec.name):
            continue
        prefix = cache_prefix(cache_dir, spec.name, fp, data_cfg.text_field, data_cfg.max_bytes)
        out[spec.name] = str(prepare_dataset(
            [spec.name], prefix, tokenizer.name_or_path, json_key=data_cfg.text_field,
            workers=workers, append_eod=True, max_bytes=data_cfg.max_bytes, progress=progress,
            fields=Fields(input="data.source", json_key="data.text_field", tokenizer="tokenizer.path")))
    return out


def open_sources(data_cfg, prepared: dict[str, str], vocab_size: int,
                 tokenizer_fingerprint: str) -> tuple[list[Source], list[Source] | None]:
    """Every entry opened (memory-mapped) and checked, with its streams."""
    from data_pipeline import indexed
    train_specs, val_specs = data_cfg.train_specs, data_cfg.val_specs
    opened = {}

    def dataset(spec, field):
        if spec.name not in opened:
            prefix = prepared.get(spec.name, spec.name)
            ds = indexed.open_prepared(prefix)
            check_dataset(ds, spec.name, vocab_size, tokenizer_fingerprint, field)
            opened[spec.name] = ds
        return opened[spec.name]

    held_out = None if val_specs is not None else data_cfg.val_fraction
    train = []
    for spec in train_specs:
        ds = dataset(spec, "data.source")
        tr, va = split_documents(ds, held_out)
        train.append(Source(spec.name, spec.weight, tr, va, sum(s.num_documents for s in ds.shards)))
    if val_specs is None:
        return train, None
    val = []
    for spec in val_specs:
        ds = dataset(spec, "data.val_source")
        stream, _ = split_documents(ds, None)
        val.append(Source(spec.name, spec.weight, stream, None, sum(s.num_documents for s in ds.shards)))
    return train, val
