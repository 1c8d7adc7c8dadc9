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

import contextlib
import gzip
import hashlib
import io
import json
from collections.abc import Iterator
from pathlib import Path

from data_pipeline.sources import Fields, ShardPlan

_HASH_CHUNK = 8 << 20


def _missing(json_key: str, names, where: str, fields: Fields) -> ValueError:
    return ValueError(
        f"{fields.json_key} ({json_key!r}) is missing from {where} (has: {sorted(names)}); fix: set "
        f"{fields.json_key} to the key/column holding each document's text")


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
                raise _missing(json_key, row if isinstance(row, dict) else {}, f"{path}:{lineno}", fields)
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
            raise _missing(json_key, names, str(path), fields)
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


@contextlib.contextmanager
def _hub_offline():
    """HF Hub offline for one call: an uncached name fails at once instead of retrying the network.
    datasets and huggingface_hub read ``HF_HUB_OFFLINE`` into module constants at import, so the
    environment variable cannot switch it later."""
    import datasets
    import huggingface_hub.constants

    modules = (datasets.config, huggingface_hub.constants)
    saved = [m.HF_HUB_OFFLINE for m in modules]
    for m in modules:
        m.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        for m, value in zip(modules, saved):
            m.HF_HUB_OFFLINE = value


def _name_split(entry: str) -> tuple[str, str]:
    name, _, split = entry.split(":", 1)[1].partition(":")
    return name, split or "train"


def _hf_error(entry: str, e: Exception, fields: Fields, how: str) -> ValueError:
    first = (str(e).splitlines() or [""])[0][:200]
    fix = ("cache it beforehand with datasets.load_dataset (or save_to_disk it)" if how == "offline"
           else "check the name, split and network")
    return ValueError(f"{fields.input} entry {entry!r}: cannot open the HF dataset {how} "
                      f"({type(e).__name__}: {first}); fix: {fix}, or point at local files")


def arrow_files(entry: str, json_key: str, fields: Fields = Fields()) -> list[Path]:
    """The Arrow files of ``hf:NAME[:SPLIT]``: a ``save_to_disk`` folder, or a dataset in the local
    HF cache (opened offline: nothing is downloaded)."""
    import datasets

    name, split = _name_split(entry)
    try:
        with _hub_offline():
            if Path(name, "state.json").is_file() or Path(name, "dataset_dict.json").is_file():
                ds = datasets.load_from_disk(name)
                ds = ds[split] if isinstance(ds, datasets.DatasetDict) else ds
            else:
                ds = datasets.load_dataset(name, split=split)
    except Exception as e:  # datasets raises many types; the user needs one clear line
        raise _hf_error(entry, e, fields, "offline") from None
    if json_key not in ds.column_names:
        raise _missing(json_key, ds.column_names, repr(entry), fields)
    if ds._indices is not None or not ds.cache_files:
        raise ValueError(f"{fields.input} entry {entry!r} is a view (selected, shuffled or in memory), "
                         "not Arrow files; fix: save it with ds.flatten_indices().save_to_disk(DIR) "
                         "and name hf:DIR")
    return [Path(f["filename"]) for f in ds.cache_files]


def _load_stream(name: str, split: str):
    import datasets

    return datasets.load_dataset(name, split=split, streaming=True)


def open_stream(entry: str, json_key: str, fields: Fields = Fields()) -> tuple[tuple[str, str], int]:
    """``hf-stream:NAME[:SPLIT]``: its (name, split) and number of shards, the text field checked
    on the first row."""
    name, split = _name_split(entry)
    try:
        ds = _load_stream(name, split)
        first = next(iter(ds.take(1)), None)
    except Exception as e:  # as above: one line
        raise _hf_error(entry, e, fields, "streaming") from None
    if first is not None and json_key not in first:
        raise _missing(json_key, first, repr(entry), fields)
    return (name, split), max(1, ds.num_shards)


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
        ds = _load_stream(name, split)
        ds = ds.shard(num_shards=num, index=index) if num > 1 else ds
        for i, row in enumerate(ds):
            if self.json_key not in row:
                raise _missing(self.json_key, row, f"{self.plan.source} row {i}", self.fields)
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
