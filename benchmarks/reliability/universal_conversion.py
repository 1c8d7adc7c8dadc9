"""Peak memory and time of converting a checkpoint of a few GB to a universal one:
``launch/to_universal.py`` against DeepSpeed's ``ds_to_universal`` on the same checkpoint.

    python -m benchmarks.reliability.universal_conversion                # CPU: ~240M-parameter dense model, 2 ranks, ZeRO-1 fp32
    python -m benchmarks.reliability.universal_conversion --size tiny    # seconds: the benchmark's own check

Trains the model one step on ``--nproc`` gloo ranks with a checkpoint at step 1 (the weights, and
the fp32 master weights with Adam's two moments partitioned over the ranks: about 4 x 4 bytes per
parameter on disk), then converts it twice, each in its own process while this one samples the
process's ``/proc/<pid>/status`` every 20 ms: ``RssAnon`` (memory the converter allocated) and
``RssFile`` (file pages it mapped; the kernel drops them under pressure), and the wall time.
``ds_to_universal`` (DeepSpeed's converter, which loads each shard file whole) runs with one
extract and one merge worker. The bound to compare with: one parameter's full tensors (its fp32
weight and two moments) of the largest parameter. Prints one markdown table and the ratios.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SIZES = {"tiny": [], "few-gb": ["model.hidden_size=1536", "model.num_heads=12", "model.num_kv_heads=12",
                                "model.ffn_hidden_size=4096", "model.num_layers=8"]}
GIB = 1 << 30


def _status(pid: int) -> dict[str, int]:
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return out


def measured(cmd: list[str]) -> dict:
    """Run ``cmd``; its wall time and peak ``RssAnon`` / ``RssFile`` (bytes), sampled."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peak = {"RssAnon": 0, "RssFile": 0}

    def sample():
        while proc.poll() is None:
            for key, value in _status(proc.pid).items():
                if key in peak:
                    peak[key] = max(peak[key], value)
            time.sleep(0.02)
    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    err = proc.communicate()[1]
    watcher.join()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:4])} failed: {(err.strip().splitlines() or [''])[-1]}")
    return {"wall_s": time.perf_counter() - t0, "anon": peak["RssAnon"], "file": peak["RssFile"]}


def train(args, run_dir: Path) -> Path:
    """One step with a checkpoint; returns the checkpoint folder."""
    cfg = json.loads((REPO / "ds_configs" / "zero1_fp32.json").read_text())
    cfg["train_micro_batch_size_per_gpu"] = 1
    config = run_dir.parent / "zero1_micro1.json"
    config.write_text(json.dumps(cfg))
    prefix = ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc)]
              if args.nproc > 1 else [sys.executable])
    cmd = prefix + ["launch/train.py", "--config", str(config), "--recipe", "recipes/tiny_dense.yaml",
                    "--run-dir", str(run_dir), "--steps", "1", "--set", *SIZES[args.size],
                    "data.seq_len=64", "model.max_seq_len=64", "eval.every=0", "train.save_every=1"]
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    return run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="few-gb")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--dir", type=Path, default=None, help="where the run goes (default: a temporary folder)")
    args = p.parse_args(argv)
    root = Path(args.dir or tempfile.mkdtemp(prefix="universal_conversion_"))
    run_dir = root / "run"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    folder = train(args, run_dir)
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    ours = measured([sys.executable, "launch/to_universal.py", "--run-dir", str(run_dir)])
    peer = measured([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(folder),
                     "--output_folder", str(root / "ds_universal"), "--num_extract_workers", "1",
                     "--num_merge_workers", "1"])
    import torch
    largest = max(torch.load(f, weights_only=True)["param"].numel()
                  for f in (folder.parent / "universal").glob("*/zero/*/fp32.pt"))
    bound = 3 * 4 * largest                               # fp32 weight, exp_avg, exp_avg_sq
    print(f"checkpoint {size / GIB:.2f} GiB ({folder}); largest parameter {largest:,} elements "
          f"(its three fp32 tensors {bound / GIB:.3f} GiB)")
    print("| converter | wall s | peak RssAnon GiB | peak RssFile GiB |\n|---|---|---|---|")
    for name, m in (("launch/to_universal.py", ours), ("ds_to_universal (1 worker)", peer)):
        print(f"| {name} | {m['wall_s']:.1f} | {m['anon'] / GIB:.2f} | {m['file'] / GIB:.2f} |")
    print(f"ratios ours / ds_to_universal: wall {ours['wall_s'] / peer['wall_s']:.2f}, "
          f"peak RssAnon {ours['anon'] / max(peer['anon'], 1):.2f}")
    print(json.dumps({"checkpoint_bytes": size, "largest_param": largest, "ours": ours, "ds_to_universal": peer}))
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
