"""Inputs -> shards: what ``launch/prepare_data.py --input`` names, planned as a list of shards.

A shard is the unit of work and of output (one ``.bin``/``.idx``/``.json`` each): one ``.jsonl``
(also ``.json``, ``.jsonl.gz``, ``.jsonl.zst``) or ``.parquet`` file; one Arrow file of an HF
dataset (``hf:NAME[:SPLIT]``, local cache or a ``save_to_disk`` folder); one shard of a streamed HF
dataset (``hf-stream:NAME[:SPLIT]``); or a group of about 256 MB of ``.txt`` files (one document
per file) in sorted path order. ``stdlib`` is this Python's standard library ``.py`` sources as
``.txt`` documents (empty files and site-packages left out).

The documents of a ``.txt`` group are written in a fixed hash order of their keys (the path
relative to the glob's fixed part, or to the stdlib root), so any contiguous range of a shard's
documents (the trainer's validation split takes the last few percent) samples the whole group.
A byte cap (``max_bytes``) is spread over the inputs in proportion to their size: whole ``.txt``
documents picked in that hash order, and the first rows of each row file up to its share.

Planning only lists and stats files (and opens HF datasets to list their Arrow files or stream
shards: ``arrow_files``, ``open_stream``); reading, and checking the text field on a row file's
first row, is ``readers.py``, which imports this module (never the other way). The same
arguments give the same plan on every machine.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import hashlib
import os
import sysconfig
from dataclasses import dataclass, field, replace
from pathlib import Path

STDLIB = "stdlib"
TXT_SHARD_BYTES = 256_000_000
_GLOB_CHARS = set("*?[")
ROW_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".jsonl.zst", ".json.zst", ".parquet")


@dataclass(frozen=True)
class Fields:
    """The caller's names for the settings, for error messages (the trainer passes its own)."""

    input: str = "--input"
    json_key: str = "--json-keys"
    tokenizer: str = "--tokenizer"


@dataclass(frozen=True)
class ShardPlan:
    """One shard to prepare.

    Attributes:
        kind: "files" (one document per file), "jsonl", "parquet", "arrow" or "stream".
        source: What the shard reads, as a user would name it (a path, ``stdlib``, ``hf:...``).
        paths: The files, in the order their documents are written (one file for row formats).
        keys: Stable per-file keys of a "files" shard (relative paths); empty otherwise.
        bytes: Input bytes on disk (None for a stream).
        mtime_ns: Newest modification time of the files (None for a stream).
        stat_key: Changes when any file's path, size or mtime does; a rerun compares it.
        budget: Text bytes to keep of a row shard (its share of ``max_bytes``); None: all.
        stream: ``(name, split, num_shards, index)`` of a streamed HF dataset.
    """

    kind: str
    source: str
    paths: tuple = ()
    keys: tuple = ()
    bytes: int | None = None
    mtime_ns: int | None = None
    stat_key: str = ""
    budget: int | None = None
    stream: tuple | None = None

    def describe(self) -> dict:
        """The shard's source as recorded in its ``.json`` and in the manifest."""
        return {"path": self.source, "files": len(self.paths), "bytes": self.bytes,
                "mtime_ns": self.mtime_ns, "stat_key": self.stat_key, "budget": self.budget}


@dataclass
class _Entry:
    """One --input entry's matched files (or HF shards) before the cap and grouping."""

    txt: list = field(default_factory=list)        # (path, key, size, mtime_ns), sorted by key
    rows: list = field(default_factory=list)       # ShardPlan per row file, sorted by path
    known_size: bool = True


def unit_hash(key: str, salt: str) -> float:
    """A stable value in [0, 1) per key (unlike Python's salted ``hash()``)."""
    digest = hashlib.blake2b(f"{salt}|{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0**64


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


@functools.lru_cache(maxsize=1)
def stdlib_files() -> tuple[tuple[Path, str], ...]:
    """The standard library's ``.py`` files as (path, key relative to the stdlib root), by key.

    Third-party packages (site-packages, dist-packages) are left out so the corpus depends only on
    the Python version; the stdlib's own ``test/`` packages are kept (ordinary idiomatic Python).
    """
    root, files = stdlib_root(), []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__")]
        files.extend(Path(dirpath, f) for f in filenames if f.endswith(".py"))
    keyed = [(p, p.relative_to(root).as_posix()) for p in files]
    return tuple(sorted(keyed, key=lambda pk: pk[1]))   # cached: one walk per process


def _expand(entry: str) -> list[tuple[Path, str]]:
    """Files matched by a path, directory or glob, each with a key relative to the pattern's fixed
    part, so keys (and the hash order) do not depend on where the data set lives."""
    path = Path(entry)
    if path.is_dir():
        entry = str(path / "**" / "*")
    parts = Path(entry).parts
    fixed = next((i for i, p in enumerate(parts) if _GLOB_CHARS & set(p)), None)
    if fixed is None:
        return [(path, path.name)] if path.is_file() else []
    base = Path(*parts[:fixed]) if fixed else Path(".")
    matches = sorted(Path(m) for m in glob.glob(entry, recursive=True) if Path(m).is_file())
    return [(m, m.relative_to(base).as_posix()) for m in matches]


def _row_kind(path: Path) -> str | None:
    name = path.name.lower()
    if name.endswith(".parquet"):
        return "parquet"
    return "jsonl" if name.endswith(ROW_SUFFIXES) else None


def _file_entry(entry: str, fields: Fields, seen: set) -> _Entry:
    matched = _expand(entry)
    if not matched:
        raise ValueError(
            f"{fields.input} entry {entry!r} matches no files (relative to {os.getcwd()}); fix: give "
            f"an existing .txt/.jsonl/.parquet file, directory or glob, 'hf:NAME[:SPLIT]', "
            f"'hf-stream:NAME[:SPLIT]' or '{STDLIB}'")
    out = _Entry()
    for path, key in matched:
        real = path.resolve()
        if real in seen:                       # a file matched by two entries counts once
            continue
        seen.add(real)
        st = path.stat()
        if path.suffix.lower() == ".txt":
            if st.st_size > 0:                 # an empty file would add only a stray EOD
                out.txt.append((path, key, st.st_size, st.st_mtime_ns))
            continue
        kind = _row_kind(path)
        if kind is None:
            raise ValueError(
                f"{fields.input} entry {entry!r} matched {path}, which is not .txt, .jsonl(.gz/.zst), "
                ".json or .parquet; fix: narrow the glob or convert the file")
        out.rows.append(ShardPlan(kind, str(path), (path,), bytes=st.st_size,
                                  mtime_ns=st.st_mtime_ns, stat_key=f"{st.st_size}:{st.st_mtime_ns}"))
    return out


@functools.lru_cache(maxsize=1)
def _stdlib_stats() -> tuple[tuple[Path, str, int, int, Path], ...]:
    """(path, key, size, mtime, real path) of every non-empty stdlib file, once per process (the
    trainer plans the stdlib three times at start-up: check, tokenizer sample, preparation)."""
    out = []
    for path, key in stdlib_files():
        st = path.stat()
        if st.st_size > 0:
            out.append((path, key, st.st_size, st.st_mtime_ns, Path(os.path.realpath(path))))
    return tuple(out)


def _stdlib_entry(seen: set) -> _Entry:
    out = _Entry()
    for path, key, size, mtime_ns, real in _stdlib_stats():
        if real not in seen:
            seen.add(real)
            out.txt.append((path, key, size, mtime_ns))
    return out


def missing_field(json_key: str, names, where: str, fields: Fields) -> ValueError:
    return ValueError(
        f"{fields.json_key} ({json_key!r}) is missing from {where} (has: {sorted(names)}); fix: set "
        f"{fields.json_key} to the key/column holding each document's text")


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
        raise missing_field(json_key, ds.column_names, repr(entry), fields)
    if ds._indices is not None or not ds.cache_files:
        raise ValueError(f"{fields.input} entry {entry!r} is a view (selected, shuffled or in memory), "
                         "not Arrow files; fix: save it with ds.flatten_indices().save_to_disk(DIR) "
                         "and name hf:DIR")
    return [Path(f["filename"]) for f in ds.cache_files]


def load_stream(name: str, split: str):
    import datasets

    return datasets.load_dataset(name, split=split, streaming=True)


def open_stream(entry: str, json_key: str, fields: Fields = Fields()) -> tuple[tuple[str, str], int]:
    """``hf-stream:NAME[:SPLIT]``: its (name, split) and number of shards, the text field checked
    on the first row."""
    name, split = _name_split(entry)
    try:
        ds = load_stream(name, split)
        first = next(iter(ds.take(1)), None)
    except Exception as e:  # as above: one line
        raise _hf_error(entry, e, fields, "streaming") from None
    if first is not None and json_key not in first:
        raise missing_field(json_key, first, repr(entry), fields)
    return (name, split), max(1, ds.num_shards)


def _hf_entry(entry: str, json_key: str, fields: Fields) -> _Entry:
    if entry.startswith("hf-stream:"):
        name, num = open_stream(entry, json_key, fields)
        plans = [ShardPlan("stream", f"{entry}#{i}", stat_key=f"{entry}#{i}/{num}",
                           stream=(name[0], name[1], num, i)) for i in range(num)]
        return _Entry(rows=plans, known_size=False)
    out = _Entry()
    for path in arrow_files(entry, json_key, fields):
        st = path.stat()
        out.rows.append(ShardPlan("arrow", str(path), (path,), bytes=st.st_size,
                                  mtime_ns=st.st_mtime_ns, stat_key=f"{st.st_size}:{st.st_mtime_ns}"))
    return out


def _entry_bytes(e: _Entry) -> int:
    return sum(t[2] for t in e.txt) + sum(r.bytes or 0 for r in e.rows)


def _capped(e: _Entry, budget: float | None) -> _Entry:
    """Keeps about ``budget`` bytes of an entry: whole .txt documents greedily in hash order (at
    least one), the first rows of each row shard up to its share; None keeps everything."""
    total = _entry_bytes(e)
    if budget is None or (e.known_size and total <= budget):
        return e
    if e.known_size:
        txt_budget = budget * sum(t[2] for t in e.txt) / max(total, 1)
        rows = [_with_budget(r, int(budget * r.bytes / max(total, 1))) for r in e.rows]
    else:
        txt_budget, rows = 0, [_with_budget(r, int(budget / len(e.rows))) for r in e.rows]
    keep, left = set(), txt_budget
    for t in sorted(e.txt, key=lambda t: unit_hash(t[1], "cap")):
        if t[2] <= left:
            keep.add(t[1])
            left -= t[2]
    if e.txt and not keep and not rows:
        keep.add(min(e.txt, key=lambda t: t[2])[1])
    return _Entry([t for t in e.txt if t[1] in keep], rows, e.known_size)


def _with_budget(plan: ShardPlan, budget: int) -> ShardPlan:
    return replace(plan, budget=max(budget, 1))


def _txt_groups(txt: list, source: str) -> list[ShardPlan]:
    """Consecutive runs of about TXT_SHARD_BYTES in sorted key order; inside a group the documents
    are in hash order of their keys."""
    groups, current, size = [], [], 0
    for t in txt:
        if current and size + t[2] > TXT_SHARD_BYTES:
            groups.append(current)
            current, size = [], 0
        current.append(t)
        size += t[2]
    if current:
        groups.append(current)
    plans = []
    for group in groups:
        group = sorted(group, key=lambda t: unit_hash(t[1], "cap"))
        stat = hashlib.sha256()
        for _, key, size, mtime in group:
            stat.update(f"{key}|{size}|{mtime}\n".encode())
        name = source if len(groups) == 1 else f"{source} ({group[0][1]} ...)"
        plans.append(ShardPlan("files", name, tuple(t[0] for t in group), tuple(t[1] for t in group),
                               sum(t[2] for t in group), max(t[3] for t in group), stat.hexdigest()))
    return plans


def plan_shards(inputs: list[str], json_key: str = "text", max_bytes: int | None = None,
                fields: Fields = Fields()) -> list[ShardPlan]:
    """The shards of ``inputs``, in input order; the same on every machine for the same arguments.

    Raises:
        ValueError: one line naming ``fields.input`` (or ``fields.json_key``) for an entry that
            matches nothing, an unsupported file, a row file without the text field, an HF dataset
            that cannot be opened, or inputs without any document.
    """
    if isinstance(inputs, str) or not inputs:
        raise ValueError(f"{fields.input} ({inputs!r}) must be a non-empty list of inputs; fix: name "
                         f"files, globs, 'hf:NAME' or '{STDLIB}'")
    seen, entries = set(), []
    for entry in inputs:
        if entry == STDLIB:
            entries.append((entry, _stdlib_entry(seen)))
        elif entry.startswith(("hf:", "hf-stream:")):
            entries.append((entry, _hf_entry(entry, json_key, fields)))
        else:
            entries.append((entry, _file_entry(entry, fields, seen)))
    if max_bytes is not None:
        sizes = [_entry_bytes(e) for _, e in entries]
        known = all(e.known_size for _, e in entries) and sum(sizes) > 0
        budgets = [max_bytes * s / sum(sizes) if known else max_bytes / len(entries) for s in sizes]
        entries = [(name, _capped(e, b)) for (name, e), b in zip(entries, budgets)]
    plans = []
    for name, e in entries:
        plans.extend(_txt_groups(e.txt, name))
        plans.extend(e.rows)
    if not plans:
        raise ValueError(f"{fields.input} ({inputs!r}) holds no non-empty documents; fix: check the files")
    return plans
