"""Batch-size study on the embedded corpus: loss vs tokens at three global batches, the lr scaled
from a base by the linear and by the square-root rule, plus LAMB at the largest batch, and the
gradient noise scale the trainer logs (``training/step/noise_scale.py``) over training.

    OMP_NUM_THREADS=1 python -m benchmarks.studies.batch_size_study --out DIR [--tokens N]

Tiny dense recipe, one process (CPU), fp32 ZeRO-1 AdamW (ZeRO-0 for LAMB, bf16 off on CPU);
micro-batch 4 x seq_len 128 = 512 tokens, the batch set by accumulation 2/4/8 (1024/2048/4096
tokens); the same token budget for every setting. The lr is ``zero1_fp32.json``'s 6e-4 at the
base batch (8 sequences), scaled by the JSON's ``lr_scaling`` block; LAMB keeps
``zero0_lamb.json``'s own (2e-3 at 64 sequences, sqrt rule). The runs go to ``DIR``; writes
``batch_size_study.json`` into ``--results`` (default ``benchmarks/studies/results/``) and
``batch_size_loss_vs_tokens.png`` and ``batch_size_noise_scale.png`` into ``--figures`` (default
``docs/studies/img/``); 5 min 13 s on 2 CPU cores (measured).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from benchmarks import add_output_args, output_dirs

REPO = Path(__file__).resolve().parents[2]
MICRO, SEQ, BASE_SEQS = 4, 128, 8
# (name, DeepSpeed JSON, accumulation, lr rule or None for the JSON's own)
SETTINGS = [("B1024", "zero1_fp32", 2, "linear"),
            ("B2048-linear", "zero1_fp32", 4, "linear"), ("B2048-sqrt", "zero1_fp32", 4, "sqrt"),
            ("B4096-linear", "zero1_fp32", 8, "linear"), ("B4096-sqrt", "zero1_fp32", 8, "sqrt"),
            ("B4096-lamb", "zero0_lamb", 8, None)]


def _ds_config(base: str, gas: int, rule: str | None, out: Path) -> Path:
    cfg = json.loads((REPO / "ds_configs" / f"{base}.json").read_text())
    cfg.update(train_micro_batch_size_per_gpu=MICRO, gradient_accumulation_steps=gas)
    cfg["bf16"] = {"enabled": False}          # CPU; and the noise scale needs fp32 gradients
    if rule is not None:
        cfg["lr_scaling"] = {"rule": rule, "base_batch_size": BASE_SEQS}
    path = out / f"ds_{base}_acc{gas}_{rule}.json"
    path.write_text(json.dumps(cfg, indent=1))
    return path


def _run(name: str, base: str, gas: int, rule: str | None, tokens: int, out: Path) -> dict:
    steps = tokens // (MICRO * SEQ * gas)
    run_dir = out / name
    cmd = [sys.executable, "launch/train.py", "--config", str(_ds_config(base, gas, rule, out)),
           "--recipe", "recipes/tiny_dense.yaml", "--run-dir", str(run_dir), "--steps", str(steps),
           "--set", f"data.seq_len={SEQ}", f"eval.every={steps}", "train.save_every=100000",
           "train.log_every=1000"]
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline")
    t0 = time.time()
    with open(out / f"{name}.log", "w") as log:
        subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "loss" in r]
    tail = train[-max(len(train) // 10, 1):]
    gns = [r["gradient_noise_scale"] for r in train[len(train) // 2:]
           if r.get("gradient_noise_scale") is not None]
    return {"name": name, "batch_tokens": MICRO * SEQ * gas, "steps": steps,
            "optimizer": "LAMB" if base == "zero0_lamb" else "AdamW", "lr_rule": rule or "sqrt (LAMB's)",
            "peak_lr": max(r["lr"] for r in train),
            "final_loss": sum(r["loss"] for r in tail) / len(tail),
            "eval_loss": [r["eval_loss"] for r in rows if "eval_loss" in r][-1],
            "noise_scale_second_half": sum(gns) / len(gns) if gns else None,
            "wall_s": time.time() - t0,
            "curve": {"tokens": [r["tokens"] for r in train], "loss": [r["loss"] for r in train],
                      "gns": [r.get("gradient_noise_scale") for r in train]}}


def _plots(results: list[dict], out: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5), constrained_layout=True)
    for r in results:
        ax.plot(r["curve"]["tokens"], r["curve"]["loss"], label=f"{r['name']} (lr {r['peak_lr']:.2g})")
    ax.set(xlabel="tokens", ylabel="training loss", title="Loss vs tokens, tiny dense", ylim=(None, 8.5))
    ax.legend(fontsize="small")
    fig.savefig(out / "batch_size_loss_vs_tokens.png", dpi=100)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(7, 4.5), constrained_layout=True)
    for r in results:
        points = [(t, g) for t, g in zip(r["curve"]["tokens"], r["curve"]["gns"]) if g is not None and g > 0]
        if points:
            ax.plot(*zip(*points), label=f"{r['name']} (batch {r['batch_tokens']})")
    ax.set(xlabel="tokens", ylabel="B_simple (tokens)", yscale="log",
           title="Gradient noise scale (EMA ratio) over training")
    ax.legend(fontsize="small")
    fig.savefig(out / "batch_size_noise_scale.png", dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, type=Path, help="the study's folder: its runs")
    add_output_args(p, "studies")
    p.add_argument("--tokens", type=int, default=262144, help="training tokens per setting")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results_folder, figures = output_dirs(args, "studies")
    results = []
    for name, base, gas, rule in SETTINGS:
        results.append(_run(name, base, gas, rule, args.tokens, args.out))
        r = results[-1]
        print(f"{name:13s} batch {r['batch_tokens']:5d} tok  steps {r['steps']:4d}  lr {r['peak_lr']:.3g}  "
              f"final loss {r['final_loss']:.4f}  eval {r['eval_loss']:.4f}  "
              f"B_simple {r['noise_scale_second_half'] or float('nan'):.0f}  ({r['wall_s']:.0f} s)", flush=True)
    _plots(results, figures)
    (results_folder / "batch_size_study.json").write_text(
        json.dumps({"tokens": args.tokens, "results": results}, indent=1))
    print(f"wrote {results_folder / 'batch_size_study.json'} and {figures}/batch_size_*.png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
