"""Reading one shard's documents as batches of texts, streamed, hashing the source as it goes.

Nothing here holds more than one batch (about 1-4 MB of text) of a shard: ``.txt`` files are read
one at a time, JSON lines line by line (through ``gzip`` or ``zstandard`` when compressed),
Parquet with pyarrow's ``iter_batches``, Arrow files (HF datasets' cache and ``save_to_disk``
layout) as memory-mapped record batches, streamed HF datasets with ``datasets``' own iterator.
The source's sha256 is computed while reading where the format is read in file order (text and
JSON lines); Parquet and Arrow are read out of order by pyarrow, so their file is hashed in one
sequential pass first (disk speed, far faster than tokenizing). Empty documents are left out.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
from collections.abc import Iterator
from pathlib import Path

from data_pipeline.sources import Fields, ShardPlan, load_stream, missing_field, plan_shards

_HASH_CHUNK = 8 << 20


class _Hashing(io.RawIOBase):
    """A read-only file that hashes and counts the bytes read through it."""

    def __init__(self, raw):
        self.raw, self.sha, self.count = raw, hashlib.sha256(), 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        n = self.raw.readinto(buffer)
        self.sha.update(memoryview(buffer)[:n])
        self.count += n
        return n

    def drain(self) -> None:
        """Reads the rest of the file (a capped shard stops early), so the hash covers it all."""
        while chunk := self.raw.read(_HASH_CHUNK):
            self.sha.update(chunk)
            self.count += len(chunk)


def _open_lines(path: Path, hashing: _Hashing):
    """Binary lines of a JSON-lines file, decompressed as its name says."""
    name = path.name.lower()
    if name.endswith(".gz"):
        return gzip.GzipFile(fileobj=io.BufferedReader(hashing))
    if name.endswith(".zst"):
        try:
            import zstandard
        except ImportError:
            raise ValueError(f"{path} is zstandard-compressed and the zstandard module is missing; "
                             "fix: pip install zstandard, or decompress the file") from None
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(hashing))
    return io.BufferedReader(hashing, 1 << 20)


def _jsonl_rows(path: Path, json_key: str, fields: Fields, hashing: _Hashing) -> Iterator[str]:
    with _open_lines(path, hashing) as lines:
        for lineno, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path}:{lineno} is not a JSON object on one line ({e}); fix: write one "
                                 "JSON object per line (JSON lines), or fix that line") from None
            if not isinstance(row, dict) or json_key not in row:
                raise missing_field(json_key, row if isinstance(row, dict) else {}, f"{path}:{lineno}", fields)
            yield _text(row[json_key], f"{path}:{lineno}", json_key, fields)


def _text(value, where: str, json_key: str, fields: Fields) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{fields.json_key} ({json_key!r}) in {where} is {type(value).__name__}, not "
                         f"a string; fix: point {fields.json_key} at a text field")
    return value


def check_field(plan: ShardPlan, json_key: str, fields: Fields = Fields()) -> None:
    """Checks the text field on a row file's schema (Parquet) or first row (JSON lines), so that a
    wrong field fails before anything is written; other kinds were checked when planned."""
    kind, path = plan.kind, plan.paths[0] if plan.paths else None
    if kind not in ("jsonl", "parquet"):
        return
    if kind == "parquet":
        import pyarrow.parquet as pq

        try:
            names = pq.read_schema(path).names
        except Exception as e:  # pyarrow's errors vary by fault; one line is what the user needs
            raise ValueError(f"{path} is not a Parquet file ({type(e).__name__}: {e}); fix: "
                             "replace or remove it") from None
        if json_key not in names:
            raise missing_field(json_key, names, str(path), fields)
        return
    with open(path, "rb") as raw:
        for _ in _jsonl_rows(path, json_key, fields, _Hashing(raw)):
            return


def _file_sha256(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            sha.update(chunk)
    return sha.hexdigest()


class ShardReader:
    """The documents of one shard, as batches of texts in the shard's order.

    After :meth:`batches` is exhausted, ``sha256`` is the source's hash (a "files" shard hashes
    each file's key, size and bytes in order; a stream hashes the texts read) and ``progress``
    the source bytes consumed, which the progress bar follows while reading.
    """

    def __init__(self, plan: ShardPlan, json_key: str, fields: Fields = Fields()):
        self.plan, self.json_key, self.fields = plan, json_key, fields
        self.progress, self.sha256 = 0, None

    def _texts(self) -> Iterator[str]:
        plan, sha = self.plan, hashlib.sha256()
        try:
            if plan.kind == "files":
                for path, key in zip(plan.paths, plan.keys):
                    data = path.read_bytes()
                    sha.update(f"{key}|{len(data)}|".encode())
                    sha.update(data)
                    self.progress += len(data)
                    # errors="replace": a few stdlib tests are Latin-1; the tokenizer sees U+FFFD.
                    yield data.decode("utf-8", errors="replace")
            elif plan.kind == "jsonl":
                yield from self._jsonl()
            elif plan.kind in ("parquet", "arrow"):
                self.sha256 = _file_sha256(plan.paths[0])
                yield from self._columnar()
            else:
                yield from self._stream(sha)
        finally:
            # A capped shard stops early: its hash covers the part read.
            self.sha256 = self.sha256 or sha.hexdigest()

    def _jsonl(self) -> Iterator[str]:
        path = self.plan.paths[0]
        with open(path, "rb") as raw:
            hashing = _Hashing(raw)
            try:
                for text in _jsonl_rows(path, self.json_key, self.fields, hashing):
                    self.progress = hashing.count
                    yield text
                hashing.drain()
            finally:
                self.progress, self.sha256 = hashing.count, hashing.sha.hexdigest()

    def _columnar(self) -> Iterator[str]:
        import pyarrow as pa
        import pyarrow.parquet as pq

        path, size = self.plan.paths[0], self.plan.bytes
        if self.plan.kind == "parquet":
            pf = pq.ParquetFile(path)
            rows, batches = pf.metadata.num_rows, pf.iter_batches(batch_size=1024, columns=[self.json_key])
        else:
            # HF datasets' cache and save_to_disk files are Arrow IPC streams; mapped, not loaded.
            rows, batches = None, pa.ipc.open_stream(pa.memory_map(str(path)))
        done = 0
        for batch in batches:
            column = batch.column(batch.schema.get_field_index(self.json_key))
            for i, value in enumerate(column.to_pylist()):
                yield _text(value, f"{path} row {done + i}", self.json_key, self.fields)
            done += batch.num_rows
            # Parquet knows its row count up front; an Arrow stream is counted by batch bytes.
            self.progress = (size * done // rows if rows else min(size, self.progress + batch.nbytes))
        self.progress = size

    def _stream(self, sha) -> Iterator[str]:
        name, split, num, index = self.plan.stream
        ds = load_stream(name, split)
        ds = ds.shard(num_shards=num, index=index) if num > 1 else ds
        for i, row in enumerate(ds):
            if self.json_key not in row:
                raise missing_field(self.json_key, row, f"{self.plan.source} row {i}", self.fields)
            text = _text(row[self.json_key], f"{self.plan.source} row {i}", self.json_key, self.fields)
            data = text.encode()
            sha.update(len(data).to_bytes(8, "little"))
            sha.update(data)
            self.progress += len(data)
            yield text

    def batches(self, batch_bytes: int) -> Iterator[list[str]]:
        """Lists of non-empty texts of at most ``batch_bytes`` UTF-8 bytes each (or one longer
        document), stopping at the plan's budget (whole documents: the one that would cross it is left out, unless none is
        kept yet)."""
        batch, size, kept, budget = [], 0, 0, self.plan.budget
        texts = self._texts()
        try:
            for text in texts:
                if not text:
                    continue
                n = len(text.encode())
                if budget is not None and kept + n > budget and kept:
                    break
                if batch and size + n > batch_bytes:   # a long document waits for the next batch,
                    yield batch                        # so a batch is <= batch_bytes or one document
                    batch, size = [], 0
                batch.append(text)
                size += n
                kept += n
        finally:
            texts.close()           # closes the file now, and sets sha256 of a capped shard
        if batch:
            yield batch


def check_fields(plans: list[ShardPlan], json_key: str, fields: Fields = Fields()) -> list[ShardPlan]:
    """``check_field`` on every shard of ``plans`` (``sources.plan_shards``), so that a wrong text
    field fails before anything is written; returns ``plans``. ``prepare_dataset`` checks only the
    shards it prepares, so K machines share the opening."""
    for plan in plans:
        check_field(plan, json_key, fields)
    return plans


def sample_texts(inputs: list[str], json_key: str, max_bytes: int) -> list[str]:
    """About ``max_bytes`` of documents spread over the whole input, for training a tokenizer.

    The cap of ``sources.plan_shards``: whole ``.txt``/stdlib documents in a fixed hash order of
    their keys over the whole input (not the first files), and the first rows of every row file up
    to its share. Deterministic.
    """
    texts = []
    for plan in plan_shards(inputs, json_key, max_bytes):
        for batch in ShardReader(plan, json_key).batches(4_000_000):
            texts.extend(batch)
    return texts
