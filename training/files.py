"""Writing small files so that no reader ever sees half of one."""

from __future__ import annotations

import os
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CACHE_DIR = REPO / ".cache"         # the tokenizer, prepared raw sources, start-up markers


def atomic_write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file beside it and a rename (atomic on one
    filesystem): a reader, or a run killed mid-write, sees the old content or the new, never a mix.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def wait_for_file(path: Path, what: str, timeout_s: float, poll_s: float = 0.5,
                  log_every_s: float = 60.0) -> None:
    """Block until ``path`` exists, printing a line every ``log_every_s`` seconds; after
    ``timeout_s`` one ValueError line naming what was waited for and the likely causes.

    Ranks wait this way, not in a collective barrier, while one rank does long single-rank work
    (training the tokenizer, preparing raw text): a barrier would hit the process-group timeout
    on a large corpus, and a wait on a file costs no collective.
    """
    path = Path(path)
    start = last = time.monotonic()
    while not path.exists():
        time.sleep(poll_s)
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


def record_exit_code(code: int) -> None:
    """Append ``<code> <rank>`` to the file ``$TRAIN_EXIT_CODE_FILE`` names, if set, for a
    non-zero code: the launch scripts' restart loop reads it, since torchrun and DeepSpeed's
    launcher report their own exit code, not the trainer's (``launch/common.sh``)."""
    path = os.environ.get(EXIT_CODE_FILE)
    if not path or code == 0:
        return
    try:
        with open(path, "a") as f:       # one short write per rank: appends do not interleave
            f.write(f"{code} {os.environ.get('RANK', '0')}\n")
    except OSError:
        pass
