"""Checkpoint manifests: every file of a checkpoint tag with its size and CRC-32, written last.

``<ckpt>/<tag>/manifest.json``::

    {"format": 1, "step": 50,
     "layout": {"world_size": 2, "dp_world_size": 2, "mp_world_size": 1},
     "files": {"mp_rank_00_model_states.pt": {"bytes": 1234, "crc32": "0a1b2c3d"}, ...}}

The ranks share the hashing: of the tag's files, largest first (``_order``), rank r takes every
world-th one starting at r, both when a save writes the manifest (``write_share`` on every rank,
then ``merge`` on rank 0) and when a resume checks it (``verify``). Sorted by name instead, the
ZeRO files of 2 ranks (model states 0, optimizer states 0, model states 1, optimizer states 1)
would give rank 1 both optimizer files, nearly all the bytes. CRC-32 (``zlib.crc32``) detects
truncated, zeroed or bit-flipped files, not deliberate tampering. Measured on one core of the
2-core CPU test machine (Python 3.11, zlib 1.2.13): 3.9 GiB/s on 64 MiB in memory, against
1.8 GiB/s for SHA-1, 1.7 GiB/s for SHA-256 and 0.7 GiB/s for MD5; ``checksum`` on a 256 MiB
file in the page cache, 2.5-3.2 GiB/s
(``python -m pytest -q -s -kthroughput tests/training/checkpoint/test_manifest.py``).
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import torch

from model.parallel import comm
from training.files import atomic_write

MANIFEST = "manifest.json"
_CHUNK = 16 << 20
# Why a candidate does not verify, by the code ``verify`` all-reduces (0: it verifies).
_REASONS = ("", "is missing", "has no manifest.json", "has an unreadable manifest.json",
            "is missing {}", "has {} of the wrong size", "has {} with the wrong checksum")
_FOLDER_MISSING, _NO_MANIFEST, _BAD_MANIFEST, _FILE_MISSING, _WRONG_SIZE, _WRONG_CRC = range(1, 7)


def _ours(name: str) -> bool:
    """The manifest, its per-rank shares and their temporary files (``atomic_write``)."""
    return name.startswith(("manifest.", ".manifest."))


def list_files(folder: Path) -> list[str]:
    """Every file under ``folder`` (relative POSIX paths, sorted), the manifest's own left out."""
    folder = Path(folder)
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")
                  if p.is_file() and not (p.parent == folder and _ours(p.name)))


def _order(sizes: dict[str, int]) -> list[str]:
    """The files (name -> bytes) as the ranks deal them: largest first, then by name. Rank r
    takes indices r, r + world, ..., so the bytes split evenly."""
    return sorted(sizes, key=lambda n: (-sizes[n], n))


def checksum(path: Path, progress=None) -> tuple[int, str]:
    """(bytes read, CRC-32 as 8 hex digits) of the file at ``path``, read in 16 MiB chunks;
    ``progress()`` after each (the watchdog: hashing a large file is progress)."""
    crc, size, buf = 0, 0, bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc, size = zlib.crc32(view[:n], crc), size + n
            if progress is not None:
                progress()
    return size, f"{crc:08x}"


def _share_path(folder: Path, rank: int) -> Path:
    return Path(folder) / f"manifest.rank{rank}.json"


def write_share(folder: Path, rank: int, world: int, progress=None) -> None:
    """Hash this rank's share of the files of ``folder`` (every rank has finished writing) into
    ``manifest.rank<rank>.json``; ``progress()`` after each chunk hashed."""
    entries = {}
    sizes = {n: (Path(folder) / n).stat().st_size for n in list_files(folder)}
    for name in _order(sizes)[rank::world]:
        size, crc = checksum(Path(folder) / name, progress)
        entries[name] = {"bytes": size, "crc32": crc}
    atomic_write(_share_path(folder, rank), json.dumps(entries))


def write_entries(folder: Path, rank: int, entries: dict) -> None:
    """This rank's share as given (name -> ``{"bytes", "crc32"}``): the files it wrote itself,
    hashed from memory by a background save (``training/checkpoint/saving.py``)."""
    atomic_write(_share_path(folder, rank), json.dumps(entries))


def merge(folder: Path, step: int, layout: dict, world: int, hash_the_rest: bool = False,
          progress=None) -> None:
    """Rank 0, after every rank's share: check that the shares cover every file at the size each
    has now, write ``manifest.json`` (atomic) and delete the shares. ValueError (one line) when a
    file is not as hashed. ``hash_the_rest``: the files no share names (those DeepSpeed writes
    itself, e.g. rank 0's ``zero_to_fp32.py``, beside the shares of ``write_entries``) are
    hashed here."""
    folder = Path(folder)
    files = {}
    for rank in range(world):
        files.update(json.loads(_share_path(folder, rank).read_text()))
    names = list_files(folder)
    for name in (n for n in names if hash_the_rest and n not in files):
        size, crc = checksum(folder / name, progress)
        files[name] = {"bytes": size, "crc32": crc}
    unhashed = sorted(set(names) ^ set(files))
    wrong = [n for n in names if n in files and (folder / n).stat().st_size != files[n]["bytes"]]
    if unhashed or wrong:
        raise ValueError(f"checkpoint {folder}: {(unhashed + wrong)[0]} changed while the ranks "
                         f"hashed it (the ranks do not see the same files): save to a filesystem "
                         f"every rank shares")
    atomic_write(folder / MANIFEST, json.dumps({"format": 1, "step": step, "layout": layout,
                                                "files": files}, indent=1, sort_keys=True) + "\n")
    for rank in range(world):
        _share_path(folder, rank).unlink()


def read(folder: Path) -> dict:
    """``folder``'s manifest; FileNotFoundError when it has none, ValueError when unreadable."""
    manifest = json.loads((Path(folder) / MANIFEST).read_text())
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not (isinstance(files, dict) and all(
            isinstance(e, dict) and isinstance(e.get("bytes"), int) and isinstance(e.get("crc32"), str)
            for e in files.values())):
        raise ValueError(f"{Path(folder) / MANIFEST}: not a checkpoint manifest")
    return manifest


def _check_share(folder: Path, rank: int, world: int) -> tuple[int, int]:
    """(reason code, index of the file in ``_order``) for this rank's share of ``folder``;
    (0, 0) when it verifies. Sizes are checked before anything is hashed."""
    folder = Path(folder)
    if not folder.is_dir():
        return _FOLDER_MISSING, 0
    try:
        files = read(folder)["files"]
    except FileNotFoundError:
        return _NO_MANIFEST, 0
    except (OSError, ValueError):                     # bad JSON or UTF-8, wrong shapes
        return _BAD_MANIFEST, 0
    order = _order({n: e["bytes"] for n, e in files.items()})
    mine = [(i, order[i]) for i in range(rank, len(order), world)]
    for i, name in mine:
        path = folder / name
        if not path.is_file():
            return _FILE_MISSING, i
        if path.stat().st_size != files[name]["bytes"]:
            return _WRONG_SIZE, i
    for i, name in mine:
        if checksum(folder / name) != (files[name]["bytes"], files[name]["crc32"]):
            return _WRONG_CRC, i
    return 0, 0


def verify(folder: Path, rank: int, world: int, device: torch.device) -> str | None:
    """None when every file the manifest of ``folder`` lists exists with its size and checksum,
    else why not (e.g. "has zero_pp_rank_1_mp_rank_00_optim_states.pt of the wrong size").

    Every rank checks its share; one all-reduce (``comm.job_sum``) of a (world, 2) int64 tensor
    on ``device`` collects the verdicts, so every rank returns the same decision.
    """
    verdicts = torch.zeros((world, 2), dtype=torch.int64, device=device)
    verdicts[rank] = torch.tensor(_check_share(folder, rank, world), device=device)
    comm.job_sum(verdicts)
    failed = [(code, index) for code, index in verdicts.tolist() if code]
    if not failed:
        return None
    code, index = failed[0]
    if code < _FILE_MISSING:
        return _REASONS[code]
    try:
        name = _order({n: e["bytes"] for n, e in read(folder)["files"].items()})[index]
    except (OSError, ValueError):            # unreadable on this rank, readable on another
        name = f"file {index} of its manifest"
    return _REASONS[code].format(name)
