"""Conversion of a run's newest checkpoint into DeepSpeed's universal format.

``check`` refuses what cannot be converted (pipeline checkpoints, ZeRO-0, tp/ep checkpoints
without ``universal_checkpoint_info``, a ZeRO-3 Muon run); ``convert`` wraps ``python -m
deepspeed.checkpoint.ds_to_universal`` (for a Muon run on a view of the checkpoint that carries
the momentum, ``interop/muon_universal.py``) and moves the result into place. Used by
``launch/to_universal.py``; docs/checkpoints.md says which layout changes work.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from interop import muon_universal
from training.checkpoint import layout, resume
from training.optim.muon import is_muon_type
from training.files import atomic_write

REPO = Path(__file__).resolve().parents[1]   # on PYTHONPATH of the conversion: it unpickles our classes


def check(run_dir: Path) -> tuple[Path, str, bool]:
    """The newest checkpoint's folder and tag, and whether ds_to_universal must inject the
    (empty) universal_checkpoint_info; ValueError (one line) if it cannot be converted."""
    ckpt_dir = run_dir / "checkpoints"
    moe = layout.read_run_config(run_dir)["recipe"]["model"].get("moe") or {}
    if moe.get("score_function") == "sigmoid" or moe.get("expert_bias_update_rate", 0) > 0:
        raise ValueError(f"--run-dir {run_dir}: the universal format keeps parameters only, and "
                         f"the routers' e_score_correction_bias (a buffer) would restart at zero: "
                         f"resume this run at its layout")
    ds = layout.read_run_config(run_dir).get("ds_config") or {}
    if is_muon_type(ds) and int((ds.get("zero_optimization") or {}).get("stage", 0)) == 3:
        raise ValueError(f"--run-dir {run_dir}: a ZeRO-3 Muon run's momentum does not convert (ZeRO-3 keeps its "
                         f"optimizer state in another structure): resume it at its layout, or train it at "
                         f"ZeRO-1/2 to change layouts")
    tag = layout.latest_tag(ckpt_dir)
    if tag is None:
        raise ValueError(f"--run-dir {run_dir}: no complete checkpoint under {ckpt_dir} "
                         f"(train with train.save_every, or let the run finish)")
    folder = ckpt_dir / tag
    names = [f.name for f in folder.iterdir()]
    if any(n.startswith("layer_") for n in names):
        raise ValueError(f"{folder}: a pipeline-parallel checkpoint has no shard description for "
                         f"ds_to_universal; resume it at the same pipeline layout")
    if not any(n.endswith("optim_states.pt") for n in names):
        raise ValueError(f"{folder}: a ZeRO-0 checkpoint has no ZeRO optimizer shards for "
                         f"ds_to_universal; ZeRO-0 resumes at another data-parallel size without "
                         f"conversion, other layout changes need a ZeRO 1-3 checkpoint")
    states = resume._model_states_file(folder)
    info = resume.read_states(states) if states else {}
    inject = "universal_checkpoint_info" not in info
    if inject and info.get("mp_world_size", 1) > 1:   # without it, DeepSpeed merges tp x ep wrongly
        raise ValueError(f"{folder}: a tensor/expert-parallel checkpoint saved without "
                         f"universal_checkpoint_info (before training/engine/build.py recorded it): "
                         f"resume it at its layout and convert a later checkpoint")
    return folder, tag, inject    # data-parallel only: the empty info DeepSpeed injects is right


def is_muon_run(run_dir: Path) -> bool:
    """Whether the run's resolved DeepSpeed JSON (``config.json``) trains with Muon."""
    return is_muon_type(layout.read_run_config(run_dir).get("ds_config") or {})


def convert(folder: Path, tag: str, workers: int, inject: bool = False, muon: bool = False) -> Path:
    """Run ds_to_universal into a scratch folder, then move it into place (a failed conversion
    leaves the previous one intact). ``muon``: a Muon run, whose momentum goes through
    ``interop/muon_universal.py``."""
    out_root = folder.parent / layout.UNIVERSAL
    scratch = out_root / f".{tag}.tmp"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    source, names = muon_universal.muon_input(folder, scratch / "input") if muon else (folder, [])
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
           str(source), "--output_folder", str(scratch / tag), "--num_extract_workers",
           str(max(1, workers)), "--num_merge_workers", str(max(1, min(2, workers)))]
    if inject:
        cmd.append("--inject_missing_state")
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path)       # the checkpoint may pickle our classes
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        shutil.rmtree(scratch, ignore_errors=True)
        lines = [ln.strip() for ln in proc.stderr.splitlines() if ln.strip()]
        raise ValueError(f"ds_to_universal failed on {folder}: "
                         f"{lines[-1] if lines else f'exit code {proc.returncode}'}")
    if muon:
        muon_universal.muon_output(scratch / tag, names)
    target = out_root / tag
    shutil.rmtree(target, ignore_errors=True)
    os.replace(scratch / tag, target)
    shutil.rmtree(scratch, ignore_errors=True)
    atomic_write(out_root / layout.LATEST_UNIVERSAL, tag)
    for old in out_root.iterdir():
        if old.is_dir() and old.name != tag and not old.name.startswith("."):
            shutil.rmtree(old, ignore_errors=True)
    return target
