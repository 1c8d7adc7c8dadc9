"""The token store: megatron-core's indexed dataset (a ``.bin`` + ``.idx`` pair), and prepared sets.

The storage layer of the data pipeline, below the sampling (``sampling.py``), as Megatron-Core
splits ``indexed_dataset`` / ``gpt_dataset`` / ``blended_dataset``. The format is megatron-core's,
version 1, so datasets made by Megatron-LM's ``tools/preprocess_data.py`` read here unchanged and
what ``launch/prepare_data.py`` writes reads in megatron-core::

    <prefix>.bin   the tokens of every sequence, concatenated, in the .idx's dtype
    <prefix>.idx   b"MMIDIDX\\x00\\x00"          magic (9 bytes)
                   <Q  version                  always 1
                   <B  dtype code               1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
                                                6 float64, 7 float32, 8 uint16
                   <Q  sequence_count           n
                   <Q  document_count           d = documents + 1 (entries of document_indices)
                   int32 sequence_lengths[n]    tokens per sequence
                   int64 sequence_pointers[n]   byte offset of each sequence in the .bin
                   int64 document_indices[d]    sequence index where each document starts; 0 ... n
                   (int8 modes[n])              multimodal datasets only; ignored here

We write one sequence per document (preprocess_data.py without sentence splitting). Written by
hand rather than imported: megatron-core pulls in torch and its whole package at import (about
9 s) and checks a bad file with ``assert``; here both sides are a few numpy calls, every check
raises :class:`DataFormatError` with one line, and the tests hold us to megatron-core's reader
and writer byte for byte.

A *prepared dataset* is what ``launch/prepare_data.py`` writes: shards
``{prefix}-{i:05d}-of-{N:05d}.bin/.idx/.json`` and ``{prefix}.manifest.json`` (``prepare.py``).
"""

from __future__ import annotations

import errno
import json
import os
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
               7: np.float32, 8: np.uint16}
_CODE_OF = {np.dtype(t): code for code, t in DTYPE_CODES.items()}
_HEADER = struct.Struct("<9sQBQQ")          # magic, version, dtype code, sequences, documents + 1
_CHECK_CHUNK = 1 << 20                      # sequences per step of the pointer check (8 MB)


class DataFormatError(ValueError):
    """A data file that is not what it claims to be; the message is one line: file, fault, fix."""


def optimal_dtype(vocab_size: int) -> np.dtype:
    """The token dtype for a vocabulary: uint16 below 65,500 ids (Megatron's rule), else int32."""
    return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_FILE_MODE = 0o666 & ~_umask()     # what open() would give; mkstemp's 0600 would hide shards from others


def temp_file(target: Path, tag: str) -> tuple[int, Path]:
    """A temporary file beside ``target`` (same filesystem, so a rename publishes it atomically),
    with the mode an ordinary ``open`` would give."""
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.{tag}.", dir=target.parent)
    os.fchmod(fd, _FILE_MODE)
    return fd, Path(name)


def pair_sizes(documents: int, tokens: int, dtype) -> tuple[int, int]:
    """The bytes of the ``.bin`` and ``.idx`` that ``IndexedWriter`` writes for ``documents``
    documents of ``tokens`` tokens in all: a check of a published shard that reads no token."""
    n = documents
    return tokens * np.dtype(dtype).itemsize, _HEADER.size + 4 * n + 8 * n + 8 * (n + 1)


def sync_file(f) -> None:
    """Flush the open file ``f`` (a file object) to the disk: what a rename publishes must be
    on the disk first, or a power or node crash can leave the published name on garbage."""
    f.flush()
    os.fsync(f.fileno())


def sync_directory(path: str | os.PathLike) -> None:
    """Flush a directory's entries (the names renamed or created in it) to the disk. A
    filesystem that cannot fsync a directory (EINVAL: some network filesystems) keeps its own
    ordering, and is left to it."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as err:
        if err.errno != errno.EINVAL:
            raise
    finally:
        os.close(fd)


def with_suffix(prefix: str | os.PathLike, suffix: str) -> Path:
    """``prefix`` + ``suffix`` (``Path.with_suffix`` would replace a dot in the prefix's name)."""
    prefix = Path(prefix)
    return prefix.with_name(prefix.name + suffix)


def _bad(path: Path, what: str) -> DataFormatError:
    return DataFormatError(
        f"{path}: {what}; fix: rewrite the pair with launch/prepare_data.py (or Megatron's "
        "tools/preprocess_data.py), or point at another prefix")


class IndexedDataset:
    """A ``.bin``/``.idx`` pair, memory-mapped and validated on open.

    Checked on open: the magic, version and dtype code; the .idx's size against its counts; the
    sequence pointers against the lengths (contiguous from 0) and the .bin's size; the document
    indices from 0 to the sequence count, non-decreasing. Nothing is read from the .bin.

    Attributes:
        prefix: The path prefix (without ``.bin``/``.idx``).
        dtype: Token dtype.
        sequence_lengths: int32 tokens per sequence (a view into the mapped .idx).
        sequence_pointers: int64 byte offset of each sequence in the .bin.
        document_indices: int64 first sequence of each document, then the sequence count.
        num_documents: Documents (``len(document_indices) - 1``).
        num_tokens: Tokens in the .bin.
        tokens: The whole .bin as one read-only 1-D ``np.memmap`` of ``dtype``.
    """

    def __init__(self, prefix: str | os.PathLike):
        self.prefix = Path(prefix)
        idx_path, bin_path = with_suffix(self.prefix, ".idx"), with_suffix(self.prefix, ".bin")
        for path in (idx_path, bin_path):
            if not path.is_file():
                raise DataFormatError(
                    f"{path} does not exist; fix: point at the prefix of an existing .bin/.idx pair "
                    "(without the suffix), or prepare one with launch/prepare_data.py")
        idx_size = idx_path.stat().st_size
        with idx_path.open("rb") as f:
            head = f.read(_HEADER.size)
        if len(head) < _HEADER.size or not head.startswith(MAGIC):
            raise _bad(idx_path, "not an indexed-dataset index (no MMIDIDX header)")
        _, version, code, n, d = _HEADER.unpack(head)
        if version != VERSION:
            raise _bad(idx_path, f"index version {version}, only version {VERSION} is read")
        if code not in DTYPE_CODES:
            raise _bad(idx_path, f"unknown dtype code {code} (known: {sorted(DTYPE_CODES)})")
        self.dtype = np.dtype(DTYPE_CODES[code])
        expected = _HEADER.size + 12 * n + 8 * d
        if d < 1 or idx_size not in (expected, expected + n):   # + n: multimodal modes
            raise _bad(idx_path, f"{idx_size} bytes, but its counts ({n} sequences, {d - 1} "
                                 f"documents) need {expected}: truncated or not an index")
        index = np.memmap(idx_path, dtype=np.uint8, mode="r")
        self.sequence_lengths = np.frombuffer(index, np.int32, n, _HEADER.size)
        self.sequence_pointers = np.frombuffer(index, np.int64, n, _HEADER.size + 4 * n)
        self.document_indices = np.frombuffer(index, np.int64, d, _HEADER.size + 12 * n)
        self.num_documents = d - 1
        self.num_tokens = self._check_pointers(idx_path)
        self._check_documents(idx_path)
        bin_size = bin_path.stat().st_size
        if bin_size != self.num_tokens * self.dtype.itemsize:
            raise _bad(bin_path, f"{bin_size} bytes, but its .idx describes {self.num_tokens} "
                                 f"{self.dtype.name} tokens ({self.num_tokens * self.dtype.itemsize}"
                                 " bytes): truncated, or the pair does not belong together")
        # np.memmap cannot map an empty file; an empty dataset gets an empty array instead.
        self.tokens = (np.memmap(bin_path, dtype=self.dtype, mode="r") if self.num_tokens
                       else np.zeros(0, self.dtype))

    def _check_pointers(self, idx_path: Path) -> int:
        """Every sequence starts where the one before ends; returns the total tokens. In chunks, so
        a shard of a hundred million documents needs no more than a few MB for the check."""
        total, item = 0, self.dtype.itemsize
        for lo in range(0, len(self.sequence_lengths), _CHECK_CHUNK):
            lengths = self.sequence_lengths[lo:lo + _CHECK_CHUNK].astype(np.int64)
            if (lengths < 0).any():
                raise _bad(idx_path, "a negative sequence length")
            starts = total + np.concatenate(([0], np.cumsum(lengths[:-1])))
            if not np.array_equal(self.sequence_pointers[lo:lo + _CHECK_CHUNK], starts * item):
                raise _bad(idx_path, "sequence pointers do not follow the sequence lengths")
            total += int(lengths.sum())
        return total

    def _check_documents(self, idx_path: Path) -> None:
        docs, n = self.document_indices, len(self.sequence_lengths)
        if docs[0] != 0 or docs[-1] != n:
            raise _bad(idx_path, f"document indices run from {docs[0]} to {docs[-1]}, not 0 to the "
                                 f"sequence count {n}")
        for lo in range(0, len(docs), _CHECK_CHUNK):
            if (np.diff(docs[lo:lo + _CHECK_CHUNK + 1]) < 0).any():
                raise _bad(idx_path, "document indices decrease")

    def document_bounds(self, doc: int | np.ndarray) -> tuple:
        """Token ``[start, end)`` of documents in :attr:`tokens` (ints, or int64 arrays)."""
        doc = np.asarray(doc, dtype=np.int64)
        first, stop = self.document_indices[doc], self.document_indices[doc + 1]
        start, end = self._sequence_start(first), self._sequence_start(stop)
        return (int(start), int(end)) if doc.ndim == 0 else (start, end)

    def _sequence_start(self, seq: np.ndarray) -> np.ndarray:
        """Token offset of sequence ``seq``; the sequence count maps to the end of the tokens."""
        n = len(self.sequence_pointers)
        inside = np.minimum(seq, max(n - 1, 0))
        pointers = self.sequence_pointers[inside] // self.dtype.itemsize if n else np.zeros_like(seq)
        return np.where(seq < n, pointers, self.num_tokens)

    def __len__(self) -> int:
        return self.num_documents

    def __getitem__(self, doc: int) -> np.ndarray:
        """The tokens of document ``doc`` (a view into the mapped .bin)."""
        start, end = self.document_bounds(int(doc))
        return self.tokens[start:end]


class IndexedWriter:
    """Writes a ``.bin``/``.idx`` pair, one sequence per document, and publishes it atomically.

    Used as a context manager. Both files are written under temporary names beside the target; a
    clean exit renames the .bin and then the .idx into place (a reader needs the .idx, so it never
    sees half a pair); an exception removes the temporaries and leaves the target untouched.
    Memory: 4 bytes per document (the lengths); pointers are written in chunks at the end.
    """

    def __init__(self, prefix: str | os.PathLike, dtype):
        self.prefix, self.dtype = Path(prefix), np.dtype(dtype)
        if self.dtype not in _CODE_OF:
            raise ValueError(f"IndexedWriter: dtype {self.dtype} has no indexed-dataset code")
        self._lengths: list[np.ndarray] = []
        self._bin = self._tmp_bin = None

    def __enter__(self) -> "IndexedWriter":
        self.prefix.parent.mkdir(parents=True, exist_ok=True)
        fd, self._tmp_bin = temp_file(self.prefix, "bin")
        self._bin = os.fdopen(fd, "wb")
        return self

    def add_document(self, tokens: np.ndarray) -> None:
        """Appends one document (one sequence)."""
        tokens = np.asarray(tokens)
        self.add_documents(tokens, np.array([len(tokens)], dtype=np.int32))

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Appends ``len(lengths)`` documents whose tokens are concatenated in ``tokens``."""
        lengths = np.asarray(lengths, dtype=np.int32)
        if int(lengths.sum()) != len(tokens):
            raise ValueError(f"IndexedWriter: lengths sum to {lengths.sum()}, not {len(tokens)}")
        self._bin.write(np.ascontiguousarray(tokens, dtype=self.dtype).tobytes())
        self._lengths.append(lengths)

    def __exit__(self, exc_type, exc, tb) -> None:
        tmp_idx = None
        try:
            if exc_type is None:
                sync_file(self._bin)             # on the disk before any name points at it
            self._bin.close()
            if exc_type is None:
                tmp_idx = self._write_index()
                bin_path, idx_path = with_suffix(self.prefix, ".bin"), with_suffix(self.prefix, ".idx")
                # An old .idx goes first, so no reader pairs it with the new .bin.
                idx_path.unlink(missing_ok=True)
                os.replace(self._tmp_bin, bin_path)
                os.replace(tmp_idx, idx_path)
                sync_directory(self.prefix.parent)
        finally:
            for tmp in (self._tmp_bin, tmp_idx):
                if tmp is not None:
                    tmp.unlink(missing_ok=True)

    def _write_index(self) -> Path:
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int32)
        n = len(lengths)
        fd, name = temp_file(self.prefix, "idx")
        with os.fdopen(fd, "wb") as f:
            # Header: magic, version 1, dtype code, sequence count, document_indices entries.
            f.write(_HEADER.pack(MAGIC, VERSION, _CODE_OF[self.dtype], n, n + 1))
            # Tokens per sequence.
            f.write(lengths.tobytes())
            # Byte offset of each sequence in the .bin: an exclusive running sum, in chunks.
            done = 0
            for lo in range(0, n, _CHECK_CHUNK):
                chunk = lengths[lo:lo + _CHECK_CHUNK].astype(np.int64)
                starts = done + np.concatenate(([0], np.cumsum(chunk[:-1])))
                f.write((starts * self.dtype.itemsize).tobytes())
                done += int(chunk.sum())
            # Document boundaries as sequence indices: one sequence per document, so 0, 1, ..., n.
            for lo in range(0, n + 1, _CHECK_CHUNK):
                f.write(np.arange(lo, min(lo + _CHECK_CHUNK, n + 1), dtype=np.int64).tobytes())
            sync_file(f)
        return name


@dataclass(frozen=True)
class PreparedDataset:
    """One dataset in the token store: a prepared set of shards, or a bare Megatron pair.

    Attributes:
        prefix: The prefix as resolved.
        shards: The shards, in input order.
        manifest: The ``{prefix}.manifest.json`` contents; None for a bare Megatron pair.
        tokenizer_fingerprint: From the manifest; None without one.
        max_token_id: The largest token id over the shards' ``.json``; None without a manifest.
    """

    prefix: Path
    shards: list
    manifest: dict | None
    tokenizer_fingerprint: str | None
    max_token_id: int | None


def manifest_path(prefix: str | os.PathLike) -> Path:
    """``{prefix}.manifest.json``."""
    return with_suffix(prefix, ".manifest.json")


def shard_prefix(prefix: str | os.PathLike, index: int, count: int) -> Path:
    """``{prefix}-{index:05d}-of-{count:05d}``: shard ``index`` of ``count``."""
    prefix = Path(prefix)
    return prefix.with_name(f"{prefix.name}-{index:05d}-of-{count:05d}")


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DataFormatError(f"{path}: not readable JSON ({e}); fix: delete it and rerun "
                              "launch/prepare_data.py with the same arguments") from None


def open_prepared(prefix: str | os.PathLike) -> PreparedDataset:
    """Opens the dataset at ``prefix``: our manifest and its shards, or a bare Megatron pair.

    Raises:
        DataFormatError: no dataset there, shards missing or unfinished, or a shard that is not
            an indexed dataset or does not match its manifest.
    """
    prefix = Path(prefix).resolve()
    mpath = manifest_path(prefix)
    if not mpath.is_file():
        if with_suffix(prefix, ".bin").is_file() and with_suffix(prefix, ".idx").is_file():
            return PreparedDataset(prefix, [IndexedDataset(prefix)], None, None, None)
        near = sorted(p.name[:-len(".manifest.json")] for p in prefix.parent.glob(f"{prefix.name}_*_document.manifest.json"))
        hint = f" (did you mean {prefix.parent / near[0]}?)" if near else ""
        raise DataFormatError(
            f"no prepared dataset at {prefix}{hint} (expected {mpath.name} from "
            f"launch/prepare_data.py, or a Megatron {prefix.name}.bin/{prefix.name}.idx pair)")
    manifest = _read_json(mpath)
    entries, fingerprint = manifest["shards"], manifest["tokenizer"]["fingerprint"]
    missing = [i for i, s in enumerate(entries) if not (prefix.parent / f"{s['prefix']}.json").is_file()]
    if missing:
        shown = ", ".join(str(i) for i in missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise DataFormatError(
            f"{prefix}: {len(missing)} of {len(entries)} shards are not prepared (shard {shown}); "
            f"fix: finish them with `{manifest.get('command', 'launch/prepare_data.py')}` (it skips "
            "finished shards; add --shard i/K to split the rest over K machines)")
    shards, max_id = [], -1
    for entry in entries:
        shard_path = prefix.parent / entry["prefix"]
        meta = _read_json(with_suffix(shard_path, ".json"))
        shard = IndexedDataset(shard_path)
        if meta["tokenizer_fingerprint"] != fingerprint:
            raise DataFormatError(
                f"{shard_path}: prepared with another tokenizer than {mpath.name} names; fix: rerun "
                f"`{manifest.get('command', 'launch/prepare_data.py')}`")
        if (meta["documents"], meta["tokens"]) != (shard.num_documents, shard.num_tokens):
            raise _bad(with_suffix(shard_path, ".idx"),
                       f"{shard.num_documents} documents / {shard.num_tokens} tokens, but its .json "
                       f"says {meta['documents']} / {meta['tokens']}")
        shards.append(shard)
        if meta["max_token_id"] is not None:        # None: a shard without documents
            max_id = max(max_id, meta["max_token_id"])
    return PreparedDataset(prefix, shards, manifest, fingerprint, max_id if max_id >= 0 else None)
