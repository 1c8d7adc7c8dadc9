"""Where a run's checkpoints are on disk, and the run directory's ``config.json`` they belong to.

Layout under ``<run-dir>/checkpoints/``::

    step00000050/      DeepSpeed's files for the checkpoint taken after optimizer step 50, the
                       trainer's per-rank state files when it has any (``state.py``), and
                       manifest.json (every file's size and CRC-32), written last
    step00000100/
    latest             the newest verified tag (the offline tools read it)
    universal/         ``launch/to_universal.py``'s conversions, with DeepSpeed's own pointer

Writing is ``saving.py``, resuming ``resume.py``; the offline tools (``interop/``,
``launch/to_universal.py``) read these names too.
"""

from __future__ import annotations

import json
from pathlib import Path

LATEST = "latest"
UNIVERSAL = "universal"                 # <ckpt>/universal/<tag>/: launch/to_universal.py
LATEST_UNIVERSAL = "latest_universal"   # DeepSpeed's pointer in <ckpt>/universal/
PARAM_NAMES = "param_names"   # client_state: each optimizer group's parameter names (ZeRO-0's files lack them)


def tag_for_step(step: int) -> str:
    return f"step{step:08d}"


def latest_tag(ckpt_dir: Path) -> str | None:
    """The tag ``latest`` names (the offline tools read it), or None when there is none;
    ValueError when its folder is missing."""
    pointer = Path(ckpt_dir) / LATEST
    if not pointer.is_file():
        return None
    tag = pointer.read_text().strip()
    if not tag or not (Path(ckpt_dir) / tag).is_dir():
        raise ValueError(f"{pointer}: points to missing checkpoint {tag!r} (delete the file to "
                         f"start over, or restore the checkpoint folder)")
    return tag


def candidates(ckpt_dir: Path) -> list[str]:
    """The tags a resume tries, in order: the one ``latest`` names (even when its folder is
    gone), then every ``step*`` folder, newest first. Empty when there is no checkpoint."""
    pointer = Path(ckpt_dir) / LATEST
    latest = pointer.read_text().strip() if pointer.is_file() else ""
    steps = sorted((p.name for p in Path(ckpt_dir).glob("step*") if p.is_dir()), reverse=True)
    return ([latest] if latest else []) + [t for t in steps if t != latest]


def universal_tag(ckpt_dir: Path) -> str | None:
    """The tag ``launch/to_universal.py`` last converted (``<ckpt>/universal/latest_universal``)."""
    pointer = Path(ckpt_dir) / UNIVERSAL / LATEST_UNIVERSAL
    if not pointer.is_file():
        return None
    tag = pointer.read_text().strip()
    return tag if tag and (pointer.parent / tag).is_dir() else None


def read_run_config(run_dir: Path) -> dict:
    """The run directory's config.json, checked to be the one ``launch/train.py`` writes."""
    config_path = Path(run_dir) / "config.json"
    if not config_path.is_file():
        raise ValueError(f"--run-dir {run_dir}: no config.json (is this a run directory made "
                         f"by launch/train.py?)")
    try:
        resolved = json.loads(config_path.read_text(encoding="utf-8"))
        model, ds = resolved["recipe"]["model"], resolved["ds_config"]
        if not (isinstance(model, dict) and "family" in model and isinstance(ds, dict)):
            raise TypeError("recipe.model (with its family) and ds_config must be objects")
    except KeyError as e:
        problem = f"missing key {e}"
    except (ValueError, TypeError) as e:                # bad JSON or UTF-8, wrong shapes
        problem = str(e)
    else:
        return resolved
    raise ValueError(f"--run-dir {run_dir}: config.json is not one launch/train.py wrote "
                     f"({problem}); restore it or choose another run directory")
