"""Writing small files so that no reader ever sees half of one, and what is published stays so."""

from __future__ import annotations

import os
import time
from pathlib import Path

from data_pipeline.indexed import sync_directory, sync_file

__all__ = ["CACHE_DIR", "REPO", "atomic_write", "record_exit_code", "record_saved", "sync_directory", "sync_file",
           "sync_path", "wait_for_file"]

REPO = Path(__file__).resolve().parents[1]
CACHE_DIR = REPO / ".cache"         # the tokenizer, prepared raw sources, start-up markers


def atomic_write(path: Path, text: str, durable: bool = True) -> None:
    """Write ``text`` to ``path`` through a temporary file beside it and a rename (atomic on one
    filesystem): a reader, or a run killed mid-write, sees the old content or the new, never a mix.
    ``durable``: the file on the disk before the rename and the directory's entry after it, so
    that a power or node crash cannot leave the name on lost bytes (the checkpoint manifests,
    ``latest``); off for files that are rewritten every few seconds and worthless after a crash
    (heartbeats)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        if durable:
            sync_file(f)
    os.replace(tmp, path)
    if durable:
        sync_directory(path.parent)


def sync_path(path: Path) -> None:
    """Flush a file another writer has closed (DeepSpeed's ``torch.save``) to the disk: fsync
    through any descriptor flushes the file's data."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def wait_for_file(path: Path, what: str, timeout_s: float, poll_s: float = 0.5,
                  log_every_s: float = 60.0, max_poll_s: float = 5.0) -> None:
    """Block until ``path`` exists, printing a line every ``log_every_s`` seconds; after
    ``timeout_s`` one ValueError line naming what was waited for and the likely causes.

    Ranks wait this way, not in a collective barrier, while one rank does long single-rank work
    (training the tokenizer, preparing raw text): a barrier would hit the process-group timeout
    on a large corpus, and a wait on a file costs no collective. The check backs off from
    ``poll_s`` to ``max_poll_s`` (1,023 waiting ranks: about 200 stats a second on the shared
    filesystem once backed off, not 2,000).
    """
    path = Path(path)
    start = last = time.monotonic()
    while not path.exists():
        time.sleep(poll_s)
        poll_s = min(2 * poll_s, max_poll_s)
        now = time.monotonic()
        if now - start >= timeout_s:
            raise ValueError(f"waited {now - start:.0f} s for {what} (marker {path}): rank 0 failed "
                             f"or is still at it, or the ranks do not share the filesystem of "
                             f"{path.parent}; fix: see rank 0's output, or prepare the data with "
                             f"launch/prepare_data.py onto storage every node reads")
        if now - last >= log_every_s:
            print(f"waiting for {what} ({now - start:.0f} s of at most {timeout_s:.0f} s)", flush=True)
            last = now


EXIT_CODE_FILE = "TRAIN_EXIT_CODE_FILE"


def _append_code_line(words: list[str]) -> None:
    path = os.environ.get(EXIT_CODE_FILE)
    if not path:
        return
    try:
        with open(path, "a") as f:       # one short write per rank: appends do not interleave
            f.write(" ".join(words) + "\n")
    except OSError:
        pass


def record_saved(code: int, checkpoint) -> None:
    """Append ``<code> <rank> saved=<checkpoint>`` to ``$TRAIN_EXIT_CODE_FILE`` (if set) as soon
    as a preempted run's checkpoint has verified, before the rank's teardown: the requeue
    message names it (``launch/common.sh``, ``_saved_line``) even if the launcher kills this
    rank on its way out (torchrun terminates the others once the first rank has exited 75)."""
    _append_code_line([str(code), os.environ.get("RANK", "0"), f"saved={checkpoint}"])


def record_exit_code(code: int) -> None:
    """Append ``<code> <rank>`` to the file ``$TRAIN_EXIT_CODE_FILE`` names, if set, for a
    non-zero code: the launch scripts' restart loop reads it, since torchrun and DeepSpeed's
    launcher report their own exit code, not the trainer's (``launch/common.sh``)."""
    if code != 0:
        _append_code_line([str(code), os.environ.get("RANK", "0")])
