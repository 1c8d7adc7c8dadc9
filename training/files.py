"""Writing small files so that no reader ever sees half of one."""

from __future__ import annotations

import os
from pathlib import Path


def atomic_write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file beside it and a rename (atomic on one
    filesystem): a reader, or a run killed mid-write, sees the old content or the new, never a mix.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
