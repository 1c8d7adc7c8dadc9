"""Convert a run's newest checkpoint into DeepSpeed's universal format, to resume at another layout.

    python launch/to_universal.py --run-dir DIR [--workers N]

Wraps ``python -m deepspeed.checkpoint.ds_to_universal`` for the newest checkpoint
(``DIR/checkpoints/<tag>``, the tag ``checkpoints/latest`` names) and writes
``DIR/checkpoints/universal/<tag>/`` plus ``DIR/checkpoints/universal/latest_universal``; older
conversions there are removed. Then resume with the same command at the new layout, its DeepSpeed
JSON carrying ``"checkpoint": {"load_universal": true}`` and the same global batch (micro x
accumulation x data-parallel size) so the data order continues. README "Changing the layout of a
checkpoint" lists which changes work. A bad input or a failed conversion is one line on stderr,
exit code 2.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from training import checkpoint  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run-dir", required=True, help="run directory written by launch/train.py")
    p.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1),
                   help="processes that extract ZeRO shards (default: min(4, CPUs))")
    return p.parse_args(argv)


def check(run_dir: Path) -> tuple[Path, str, bool]:
    """The newest checkpoint's folder and tag, and whether ds_to_universal must inject the
    (empty) universal_checkpoint_info; ValueError (one line) if it cannot be converted."""
    ckpt_dir = run_dir / "checkpoints"
    checkpoint.read_run_config(run_dir)
    tag = checkpoint.latest_tag(ckpt_dir)
    if tag is None:
        raise ValueError(f"--run-dir {run_dir}: no complete checkpoint under {ckpt_dir} "
                         f"(train with train.save_every, or let the run finish)")
    folder = ckpt_dir / tag
    names = [f.name for f in folder.iterdir()]
    if any(n.startswith("layer_") for n in names):
        raise ValueError(f"{folder}: pipeline-parallel checkpoints cannot be converted yet "
                         f"(resume at the same pipeline layout)")
    if not any(n.endswith("optim_states.pt") for n in names):
        raise ValueError(f"{folder}: a ZeRO-0 checkpoint has no ZeRO optimizer shards for "
                         f"ds_to_universal; ZeRO-0 resumes at another data-parallel size without "
                         f"conversion, other layout changes need a ZeRO 1-3 checkpoint")
    states = checkpoint._model_states_file(folder)
    info = checkpoint.read_states(states) if states else {}
    inject = "universal_checkpoint_info" not in info
    if inject and info.get("mp_world_size", 1) > 1:   # without it, DeepSpeed merges tp x ep wrongly
        raise ValueError(f"{folder}: a tensor/expert-parallel checkpoint saved without "
                         f"universal_checkpoint_info (before training/run_setup.py recorded it): "
                         f"resume it at its layout and convert a later checkpoint")
    return folder, tag, inject    # data-parallel only: the empty info DeepSpeed injects is right


def convert(folder: Path, tag: str, workers: int, inject: bool = False) -> Path:
    """Run ds_to_universal into a scratch folder, then move it into place (a failed conversion
    leaves the previous one intact)."""
    out_root = folder.parent / checkpoint.UNIVERSAL
    scratch = out_root / f".{tag}.tmp"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
           str(folder), "--output_folder", str(scratch / tag), "--num_extract_workers",
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
    target = out_root / tag
    shutil.rmtree(target, ignore_errors=True)
    os.replace(scratch / tag, target)
    shutil.rmtree(scratch, ignore_errors=True)
    checkpoint._atomic_write(out_root / checkpoint.LATEST_UNIVERSAL, tag)
    for old in out_root.iterdir():
        if old.is_dir() and old.name != tag and not old.name.startswith("."):
            shutil.rmtree(old, ignore_errors=True)
    return target


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        folder, tag, inject = check(Path(args.run_dir))
        target = convert(folder, tag, args.workers, inject)
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {target}; resume with \"checkpoint\": {{\"load_universal\": true}} in the "
          f"DeepSpeed JSON")
    return 0


if __name__ == "__main__":
    sys.exit(main())
