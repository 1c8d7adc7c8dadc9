"""The corpus: ``data.source`` -> documents -> a deterministic byte cap and train/validation split.

Nothing here downloads, imports DeepSpeed or calls torch.distributed; every choice (split, caps)
hashes stable keys, so the same source gives the same documents on every rank and every run.

Sources (`data.source`): "stdlib" (the default corpus: this Python's standard library sources),
local files or globs (`.txt`: one document per file; `.jsonl` / `.parquet`: one per row, text in
`data.text_field`), and `hf:<name>[:split]` (a dataset already in the local HF cache, or a local
dataset folder). Tokenizing and packing the documents is ``training/data.py``.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from training.tokenization import read_text_file

DEFAULT_VAL_FRACTION = 0.02
STDLIB_SOURCE = "stdlib"
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


@contextlib.contextmanager
def _hub_offline():
    """HF Hub offline mode for one call. datasets and huggingface_hub read ``HF_HUB_OFFLINE``
    into module constants when imported, so the environment variable cannot switch it later."""
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


def _hf_documents(entry: str, text_field: str) -> list[Document]:
    import datasets

    name, _, split = entry[len("hf:") :].partition(":")
    split = split or "train"
    # Offline: an uncached name fails at once instead of retrying the network for ~25 s, and
    # nothing is ever downloaded at run time.
    try:
        with _hub_offline():
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
