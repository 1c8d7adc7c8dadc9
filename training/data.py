"""Data pipeline: documents -> deterministic split -> cached token stream -> packed, sharded batches.

Nothing here downloads, imports DeepSpeed or calls torch.distributed: ranks and sizes come in as
ints, and every choice (split, caps, sample order) hashes stable keys or uses seeded PCG64.

Sources (`data.source`): "stdlib" (the default corpus: this Python's standard library sources),
local files or globs (`.txt`: one document per file; `.jsonl` / `.parquet`: one per row, text in
`data.text_field`), and `hf:<name>[:split]` (a dataset already in the local HF cache, or a local
dataset folder).

Cache layout (under `cache_dir`)::

    tokens/{digest16}.npy    # uint16/uint32 token stream, EOS after every document; memory-mapped
    tokens/{digest16}.json   # what it holds (documents, tokens, timing), for people
    # digest: sha256 of DATA_FORMAT_VERSION, tokenizer fingerprint, every document's key+fingerprint

Packing: the stream is cut into windows of `seq_len + 1` tokens that overlap by one token, so
window i is tokens[i*seq_len : (i+1)*seq_len + 1], inputs = window[:-1], labels = window[1:], and
every token but the first is a label exactly once per epoch.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import shutil
import sysconfig
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import PreTrainedTokenizerFast

from training.tokenization import read_text_file, tokenizer_fingerprint

logger = logging.getLogger(__name__)

# Bump when tokenized-stream layout or packing changes, so stale caches are not reused.
DATA_FORMAT_VERSION = 1
DEFAULT_VAL_FRACTION = 0.02
STDLIB_SOURCE = "stdlib"
# Label value the loss must ignore (torch's and HF's cross-entropy default): padding in eval.
IGNORE_INDEX = -100
_GLOB_CHARS = set("*?[")


@dataclass(frozen=True)
class Document:
    """One document: a file read lazily, or a text already in memory.

    Attributes:
        key: Stable identity (relative path, or `file#row`); the split and the caps hash it.
        num_bytes: Size in bytes (file size, or UTF-8 length of `text`).
        fingerprint: Changes whenever the content may have changed; feeds cache keys.
        path: The file holding the whole document, if any.
        text: The document's text when it is not a whole file.
    """

    key: str
    num_bytes: int
    fingerprint: str
    path: Path | None = None
    text: str | None = None

    def read(self) -> str:
        """Returns the document's text."""
        return self.text if self.path is None else read_text_file(self.path)

    def corpus_item(self) -> Path | str:
        """The form `training.tokenization.load_tokenizer` takes: a path, or the text itself."""
        return self.text if self.path is None else self.path


@dataclass(frozen=True)
class CorpusSplits:
    """Train and validation documents, both non-empty, each in corpus order."""

    train: list[Document]
    val: list[Document]


def _file_document(path: Path, key: str) -> Document:
    st = path.stat()
    return Document(key, st.st_size, f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}", path=path)


def stdlib_corpus_files() -> list[Path]:
    """The Python standard library's `.py` sources, sorted by relative path.

    Third-party packages (`site-packages`, `dist-packages`) are left out so the corpus depends only
    on the Python version. The stdlib's own `test/` packages are kept: they are ordinary idiomatic
    Python and about 60% of the 31 MB on 3.11, and the design's corpus size counts them.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__")]
        files.extend(Path(dirpath, f) for f in filenames if f.endswith(".py"))
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def stdlib_documents() -> list[Document]:
    """The stdlib corpus as documents keyed by relative path (`asyncio/tasks.py`).

    Empty files (many `__init__.py`) are left out: they would only add a stray EOS.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = [_file_document(p, p.relative_to(root).as_posix()) for p in stdlib_corpus_files()]
    return [d for d in docs if d.num_bytes > 0]


def _hf_documents(entry: str, text_field: str) -> list[Document]:
    from unittest import mock

    import datasets
    import huggingface_hub.constants

    name, _, split = entry[len("hf:") :].partition(":")
    split = split or "train"
    # Offline for this call only: an uncached name fails at once instead of retrying the network
    # for ~25 s, and nothing is ever downloaded at run time.
    modules = (datasets.config, huggingface_hub.constants)
    offline = [mock.patch.object(m, "HF_HUB_OFFLINE", True) for m in modules]
    try:
        with offline[0], offline[1]:
            ds = datasets.load_dataset(name, split=split)
    except Exception as e:  # datasets raises many types; the user needs one clear line
        first = (str(e).splitlines() or [""])[0]
        raise ValueError(
            f"data.source entry {entry!r}: cannot load HF dataset {name!r} split {split!r} offline "
            f"({type(e).__name__}: {first}); fix: cache it beforehand with datasets.load_dataset on a "
            "machine with network, or point data.source at local files"
        ) from None
    _check_field(text_field, ds.column_names, repr(entry))
    base = f"hf:{name}:{split}"
    # datasets' own content fingerprint (stable across loads of the same cached data) keys our cache.
    return _row_documents(base, f"{base}:{ds._fingerprint}", ds[text_field], entry, text_field)


def _check_field(text_field: str, names, where: str) -> None:
    if text_field not in names:
        raise ValueError(
            f"data.text_field ({text_field!r}) is missing from {where} (has: {sorted(names)}); "
            "fix: set data.text_field to the key/column holding each document's text"
        )


def _row_documents(base_key: str, base_fp: str, texts, where: str, text_field: str) -> list[Document]:
    docs = []
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise ValueError(
                f"data.text_field ({text_field!r}) in {where} row {i} is {type(text).__name__}, not a "
                "string; fix: point data.text_field at a text column"
            )
        if text:  # empty rows would only add a stray EOS
            docs.append(Document(f"{base_key}#{i}", len(text.encode()), f"{base_fp}#{i}", text=text))
    return docs


def _jsonl_texts(path: Path, text_field: str) -> list[str]:
    texts = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"data.source: {path}:{lineno} is not JSON ({e}); fix that line") from None
            _check_field(text_field, row if isinstance(row, dict) else {}, f"{path}:{lineno}")
            texts.append(row[text_field])
    return texts


def _parquet_texts(path: Path, text_field: str) -> list:
    import pyarrow.parquet as pq

    _check_field(text_field, pq.read_schema(path).names, str(path))
    return pq.read_table(path, columns=[text_field]).column(text_field).to_pylist()


def _expand(entry: str) -> list[tuple[Path, str]]:
    """Files matched by a path or glob, each with a key relative to the pattern's fixed prefix,
    so keys (and hence the split) do not depend on where the data set lives."""
    parts = Path(entry).parts
    fixed = next((i for i, p in enumerate(parts) if _GLOB_CHARS & set(p)), None)
    if fixed is None:
        path = Path(entry)
        return [(path, path.name)] if path.is_file() else []
    base = Path(*parts[:fixed]) if fixed else Path(".")
    matches = sorted(Path(m) for m in glob.glob(entry, recursive=True) if Path(m).is_file())
    return [(m, m.relative_to(base).as_posix()) for m in matches]


def _file_documents(entry: str, text_field: str) -> list[Document]:
    matched = _expand(entry)
    if not matched:
        raise ValueError(
            f"data.source entry {entry!r} matches no files (relative to {os.getcwd()}); fix: give an "
            f"existing .txt/.jsonl/.parquet file or glob, 'hf:<name>[:split]', or '{STDLIB_SOURCE}'"
        )
    docs = []
    for path, key in matched:
        suffix = path.suffix.lower()
        if suffix == ".txt":
            doc = _file_document(path, key)
            if doc.num_bytes > 0:  # as with empty rows: nothing but a stray EOS
                docs.append(doc)
            continue
        if suffix not in (".jsonl", ".parquet"):
            raise ValueError(
                f"data.source entry {entry!r} matched {path}, which is not .txt, .jsonl or .parquet; "
                "fix: narrow the glob or convert the file"
            )
        texts = _jsonl_texts(path, text_field) if suffix == ".jsonl" else _parquet_texts(path, text_field)
        fp = _file_document(path, key).fingerprint
        docs.extend(_row_documents(key, fp, texts, str(path), text_field))
    return docs


def load_documents(source: str | Sequence[str], text_field: str = "text") -> list[Document]:
    """Resolves `data.source` into documents, in a deterministic order.

    Args:
        source: "stdlib", or a list of entries each being "stdlib", a local file or glob, or
            "hf:<name>[:split]" (split defaults to "train").
        text_field: Key/column holding the text in .jsonl, .parquet and HF rows.

    Raises:
        ValueError: naming `data.source` or `data.text_field`: missing files, unsupported formats,
            missing fields, HF datasets not available offline.
    """
    entries = [source] if isinstance(source, str) else list(source)
    if not entries:
        raise ValueError(f"data.source is empty; fix: set it to '{STDLIB_SOURCE}' or a list of files")
    docs, seen = [], set()
    for entry in entries:
        if entry == STDLIB_SOURCE:
            new = stdlib_documents()
        elif entry.startswith("hf:"):
            new = _hf_documents(entry, text_field)
        else:
            new = _file_documents(entry, text_field)
        for doc in new:
            # A file matched by two globs counts once; rows are told apart by their fingerprints.
            if doc.fingerprint not in seen:
                seen.add(doc.fingerprint)
                docs.append(doc)
    if not docs:
        raise ValueError(f"data.source ({source!r}) yields no non-empty documents; fix: check the files")
    return docs


def _unit_hash(key: str, salt: str) -> float:
    """A stable value in [0, 1) per key (unlike Python's salted hash())."""
    digest = hashlib.blake2b(f"{salt}|{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0**64


def cap_documents(docs: Sequence[Document], max_bytes: int | None) -> list[Document]:
    """Keeps whole documents up to `max_bytes`, visiting them in a fixed hash order of their keys.

    The hash order spreads the cap over the whole corpus instead of its alphabetically first
    files. Documents that would overflow the remaining budget are skipped (so the cap is filled
    closely), and at least one document is always kept.
    """
    if max_bytes is None or sum(d.num_bytes for d in docs) <= max_bytes:
        return list(docs)
    keep, budget = set(), max_bytes
    for i in sorted(range(len(docs)), key=lambda i: _unit_hash(docs[i].key, "cap")):
        if docs[i].num_bytes <= budget:
            keep.add(i)
            budget -= docs[i].num_bytes
    if not keep:
        keep.add(min(range(len(docs)), key=lambda i: docs[i].num_bytes))
    return [d for i, d in enumerate(docs) if i in keep]


def split_documents(docs: Sequence[Document], val_fraction: float = DEFAULT_VAL_FRACTION) -> CorpusSplits:
    """Splits by a stable hash of each document's key: the same key always lands on the same side.

    Raises:
        ValueError: if `val_fraction` is outside (0, 1) or there are fewer than two documents.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"data.val_fraction ({val_fraction}) must be in (0, 1); fix: use e.g. 0.02")
    if len(docs) < 2:
        raise ValueError(
            f"data.source has {len(docs)} document(s), too few for a train/validation split; fix: add "
            "files, or use .jsonl with one document per line"
        )
    u = [_unit_hash(d.key, "split") for d in docs]
    is_val = [x < val_fraction for x in u]
    # Never leave a side empty: move the document nearest the threshold.
    if not any(is_val):
        is_val[min(range(len(docs)), key=u.__getitem__)] = True
    if all(is_val):
        is_val[max(range(len(docs)), key=u.__getitem__)] = False
    return CorpusSplits(
        train=[d for d, v in zip(docs, is_val) if not v], val=[d for d, v in zip(docs, is_val) if v]
    )


def load_corpus(
    source: str | Sequence[str] = STDLIB_SOURCE,
    text_field: str = "text",
    val_fraction: float = DEFAULT_VAL_FRACTION,
    max_bytes: int | None = None,
) -> CorpusSplits:
    """`load_documents`, capped to `max_bytes` (whole corpus, before splitting), then split."""
    return split_documents(cap_documents(load_documents(source, text_field), max_bytes), val_fraction)


def _token_dtype(tokenizer: PreTrainedTokenizerFast) -> np.dtype:
    return np.dtype(np.uint16 if len(tokenizer) <= 2**16 else np.uint32)


def _encode_batches(
    texts: Iterator[tuple[int, str]], tokenizer: PreTrainedTokenizerFast, batch_bytes: int
) -> Iterator[tuple[int, int, np.ndarray]]:
    """Yields (documents, bytes, tokens) per batch, EOS appended after every document."""
    backend = tokenizer.backend_tokenizer
    encode = getattr(backend, "encode_batch_fast", backend.encode_batch)  # no offsets: faster
    eos, dtype = tokenizer.eos_token_id, _token_dtype(tokenizer)
    if eos is None:
        raise ValueError("the tokenizer has no eos_token, which separates packed documents; fix: set one")

    def flush(batch: list[str], size: int) -> tuple[int, int, np.ndarray]:
        ids = [np.asarray(e.ids + [eos], dtype=dtype) for e in encode(batch, add_special_tokens=False)]
        return len(batch), size, np.concatenate(ids)

    batch, size = [], 0
    for nbytes, text in texts:
        batch.append(text)
        size += nbytes
        if size >= batch_bytes:  # big batches keep the Rust thread pool busy
            yield flush(batch, size)
            batch, size = [], 0
    if batch:
        yield flush(batch, size)


def encode_texts(texts: Sequence[str], tokenizer: PreTrainedTokenizerFast) -> np.ndarray:
    """Tokenizes texts in memory (no cache), EOS after each; e.g. for evaluating a text file."""
    chunks = [t for _, _, t in _encode_batches(((len(x), x) for x in texts), tokenizer, 4_000_000)]
    return np.concatenate(chunks) if chunks else np.zeros(0, _token_dtype(tokenizer))


def _write_stream(docs: Sequence[Document], tokenizer, npy_path: Path, log_every: int, batch_bytes: int):
    """Tokenizes `docs` into a .npy file with bounded memory; returns what it wrote."""
    dtype, start = _token_dtype(tokenizer), time.perf_counter()
    stats, logged = {"documents": 0, "bytes": 0, "tokens": 0}, 0
    raw_path = npy_path.with_suffix(".raw")
    with raw_path.open("w+b") as raw:
        texts = ((d.num_bytes, d.read()) for d in docs)
        for n_docs, n_bytes, tokens in _encode_batches(texts, tokenizer, batch_bytes):
            raw.write(tokens.tobytes())
            stats["documents"] += n_docs
            stats["bytes"] += n_bytes
            stats["tokens"] += len(tokens)
            if stats["documents"] // log_every > logged or stats["documents"] == len(docs):
                logged, secs = stats["documents"] // log_every, time.perf_counter() - start
                logger.info(
                    "tokenized %d/%d documents, %.1f MB, %d tokens (%.0f docs/s, %.2f MB/s)",
                    stats["documents"], len(docs), stats["bytes"] / 1e6, stats["tokens"],
                    stats["documents"] / secs, stats["bytes"] / 1e6 / secs,
                )
        # The .npy header holds the length, known only now: write it, then copy the tokens after it.
        raw.seek(0)
        with npy_path.open("wb") as npy:
            header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False}
            np.lib.format.write_array_header_1_0(npy, {**header, "shape": (stats["tokens"],)})
            shutil.copyfileobj(raw, npy)
    raw_path.unlink()
    return {**stats, "dtype": dtype.name, "seconds": round(time.perf_counter() - start, 3)}


def tokenize_documents(
    docs: Sequence[Document],
    tokenizer: PreTrainedTokenizerFast,
    cache_dir: str | os.PathLike,
    log_every: int = 200,
    batch_bytes: int = 4_000_000,
) -> np.ndarray:
    """Returns the documents' token stream (EOS after each), memory-mapped from `cache_dir/tokens/`.

    The first call tokenizes with the fast tokenizer's batch encoder (about `batch_bytes` per call,
    a progress line every `log_every` documents) and publishes the file atomically (temporary
    file, then rename), so concurrent ranks never read a partial one. Later calls only map it.

    Returns:
        A read-only 1-D uint16 (vocab <= 65536) or uint32 array.
    """
    if not docs:
        raise ValueError("no documents to tokenize; fix: check data.source")
    fingerprint = tokenizer_fingerprint(tokenizer)
    h = hashlib.sha256(f"tokens|v{DATA_FORMAT_VERSION}|{fingerprint}".encode())
    for d in docs:
        h.update(f"\n{d.key}\t{d.fingerprint}".encode())
    root = Path(cache_dir) / "tokens"
    final = root / f"{h.hexdigest()[:16]}.npy"
    if not final.is_file():
        root.mkdir(parents=True, exist_ok=True)
        # A private directory beside the target: the renames below stay on one filesystem (atomic),
        # and a crash leaves only a dot-directory that is never read.
        with tempfile.TemporaryDirectory(prefix=f".{final.stem}.", dir=root) as tmp:
            tmp_npy = Path(tmp) / final.name
            meta = {"format_version": DATA_FORMAT_VERSION, "tokenizer_fingerprint": fingerprint}
            meta.update(_write_stream(docs, tokenizer, tmp_npy, log_every, batch_bytes))
            tmp_npy.with_suffix(".json").write_text(json.dumps(meta, indent=2) + "\n")
            os.replace(tmp_npy.with_suffix(".json"), final.with_suffix(".json"))
            os.replace(tmp_npy, final)  # last: the .npy's presence means the entry is complete
    return np.load(final, mmap_mode="r")


@dataclass(frozen=True)
class BatchLayout:
    """How one optimizer step's samples are divided.

    Attributes:
        global_batch_size: Samples per optimizer step over all data-parallel ranks (DeepSpeed's
            `train_batch_size`).
        micro_batch_size: Samples per forward/backward on one rank (`train_micro_batch_size_per_gpu`).
        dp_size: Data-parallel ranks; tensor/expert/pipeline peers share a `dp_rank` and its data.
        dp_rank: This rank's data-parallel index.
    """

    global_batch_size: int
    micro_batch_size: int
    dp_size: int = 1
    dp_rank: int = 0

    def __post_init__(self) -> None:
        g, m, d = self.global_batch_size, self.micro_batch_size, self.dp_size
        if min(g, m, d) < 1:
            raise ValueError(f"batch sizes and dp_size must be >= 1 (got {g}, {m}, {d})")
        if g % (d * m):
            raise ValueError(
                f"train_batch_size ({g}) is not divisible by data-parallel size ({d}) x "
                f"train_micro_batch_size_per_gpu ({m}) = {d * m}; fix: make it a multiple of {d * m}"
            )
        if not 0 <= self.dp_rank < d:
            raise ValueError(f"dp_rank ({self.dp_rank}) must be in [0, {d})")

    @property
    def grad_accum_steps(self) -> int:
        """Micro-batches per optimizer step on each rank."""
        return self.global_batch_size // (self.dp_size * self.micro_batch_size)


def _to_batch(windows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.from_numpy(windows.astype(np.int64))  # (micro, seq_len + 1)
    return w[:, :-1].contiguous(), w[:, 1:].contiguous()


class PackedSampler:
    """Deterministic, resumable batches of packed windows for one data-parallel rank.

    Global sample position p (counted from the start of training) maps to epoch p // N and to
    window perm_epoch[p % N], where N is the number of windows and perm_epoch is a PCG64
    permutation seeded by (seed, epoch). Optimizer step s consumes positions [s*G, (s+1)*G);
    rank r takes the contiguous slice [r*G/D, (r+1)*G/D) and splits it into micro-batches. So
    a step's tokens do not depend on micro-batch size, accumulation or DP size.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, layout: BatchLayout, seed: int) -> None:
        """Args:
        tokens: The training token stream (from `tokenize_documents`).
        seq_len: Model sequence length; windows hold `seq_len + 1` tokens.
        layout: Batch sizes and this rank's place.
        seed: Sample-order seed (`train.seed`).
        """
        if seq_len < 1:
            raise ValueError(f"seq_len ({seq_len}) must be >= 1")
        self.tokens, self.seq_len, self.layout, self.seed = tokens, seq_len, layout, seed
        self.num_samples = (len(tokens) - 1) // seq_len
        if self.num_samples < 1:
            raise ValueError(
                f"the training split has {len(tokens)} tokens, fewer than seq_len + 1 = {seq_len + 1}; "
                "fix: raise data.max_bytes or lower the model's max_seq_len"
            )
        self.step = 0  # next step `next_batches` returns; the only state that advances
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) >= 2:  # steps move forward: keep only the two newest epochs
                self._perms.pop(min(self._perms))
            # Argsort of raw PCG64 output: numpy keeps SeedSequence and bit-generator streams stable
            # across versions (Generator.permutation carries no such promise).
            raw = np.random.PCG64(np.random.SeedSequence([self.seed, epoch])).random_raw(self.num_samples)
            self._perms[epoch] = np.argsort(raw, kind="stable")
        return self._perms[epoch]

    def global_samples(self, step: int) -> np.ndarray:
        """Window indices the whole step consumes, in order (all ranks together)."""
        g, n = self.layout.global_batch_size, self.num_samples
        positions = np.arange(step * g, (step + 1) * g)
        out = np.empty(g, dtype=np.int64)
        for epoch in np.unique(positions // n).tolist():  # one epoch, or two at a boundary
            sel = positions // n == epoch
            out[sel] = self._perm(epoch)[positions[sel] % n]
        return out

    def batches_for_step(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's micro-batches for optimizer `step`.

        Returns:
            `grad_accum_steps` pairs (input_ids, labels), each LongTensor (micro, seq_len).
        """
        lay = self.layout
        per_rank = lay.global_batch_size // lay.dp_size
        mine = self.global_samples(step)[lay.dp_rank * per_rank : (lay.dp_rank + 1) * per_rank]
        offsets = mine[:, None] * self.seq_len + np.arange(self.seq_len + 1)  # (per_rank, seq_len + 1)
        windows = self.tokens[offsets.ravel()].reshape(offsets.shape)
        m = lay.micro_batch_size
        return [_to_batch(windows[i : i + m]) for i in range(0, per_rank, m)]

    def next_batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`batches_for_step(self.step)`, then advances to the next step."""
        batches = self.batches_for_step(self.step)
        self.step += 1
        return batches

    @property
    def epoch(self) -> int:
        """Epoch of the next step's first sample."""
        return self.step * self.layout.global_batch_size // self.num_samples

    def state_dict(self) -> dict:
        """Position and what must match on resume (for the checkpoint's client_state)."""
        return {"version": DATA_FORMAT_VERSION, "step": self.step, "epoch": self.epoch, "seed": self.seed,
                "num_samples": self.num_samples, "seq_len": self.seq_len,
                "global_batch_size": self.layout.global_batch_size}

    def load_state_dict(self, state: dict) -> None:
        """Resumes at `state["step"]`; refuses state from different data or batch settings, which
        would silently change the sample order."""
        mine = self.state_dict()
        for name in ("seed", "num_samples", "seq_len", "global_batch_size"):
            if state[name] != mine[name]:
                raise ValueError(
                    f"cannot resume the data order: checkpoint has {name}={state[name]}, this run has "
                    f"{mine[name]}; fix: resume with the same data, seed, sequence length and batch size"
                )
        self.step = int(state["step"])


def validation_batches(
    tokens: np.ndarray, seq_len: int, layout: BatchLayout, num_windows: int | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's share of the first `num_windows` validation windows, in stream order.

    Windows are laid out as in training; the last may be short, its missing labels set to
    `IGNORE_INDEX`. The window set does not depend on micro-batch or DP size, so neither does the
    eval loss (sum of token losses / count of non-ignored labels, both summed over DP ranks).
    Rank r takes the r-th contiguous share; every rank gets the same number of batches (ZeRO-3
    needs all ranks in every forward), padded with rows of ignored labels.

    Args:
        tokens: Validation token stream.
        seq_len: Model sequence length.
        layout: Its `micro_batch_size` (windows per batch), `dp_size` and `dp_rank` are used.
        num_windows: How many windows to evaluate (None: all).

    Returns:
        (input_ids, labels) pairs, LongTensor (micro_batch_size, seq_len) each.
    """
    if len(tokens) < 2:
        raise ValueError(
            f"the validation split has {len(tokens)} tokens; fix: raise data.val_fraction or data.max_bytes"
        )
    micro_batch_size, dp_rank, dp_size = layout.micro_batch_size, layout.dp_rank, layout.dp_size
    total = -(-(len(tokens) - 1) // seq_len)  # ceil: the short tail window counts too
    n = total if num_windows is None else min(num_windows, total)
    per_rank = -(-n // dp_size)
    rows = -(-per_rank // micro_batch_size) * micro_batch_size
    windows = np.zeros((rows, seq_len + 1), dtype=np.int64)
    valid = np.zeros((rows, seq_len + 1), dtype=bool)
    first = dp_rank * per_rank
    for row, w in enumerate(range(first, min(first + per_rank, n))):
        chunk = np.asarray(tokens[w * seq_len : (w + 1) * seq_len + 1], dtype=np.int64)
        windows[row, : len(chunk)], valid[row, : len(chunk)] = chunk, True
    inputs, labels = _to_batch(windows)  # (rows, seq_len) each
    labels[~torch.from_numpy(valid[:, 1:])] = IGNORE_INDEX
    return list(zip(inputs.split(micro_batch_size), labels.split(micro_batch_size)))
