"""Gradient-compression study: loss against steps for the data-parallel exchange uncompressed,
in bf16, and PowerSGD at ranks 1, 4 and 16, at rank 4 without error feedback and at rank 4 after
50 uncompressed steps instead of 10; tiny dense and
tiny Mixtral, two seeds each; the bytes each rank hands to the all-reduces per step (the
trainer's ``grad_exchange_bytes``, or the parameters' fp32/bf16 size for DeepSpeed's exchange)
and the step time.

    OMP_NUM_THREADS=1 python -m benchmarks.studies.grad_compression_study --out DIR [--steps 300]
                                                  [--config ds_configs/zero0_fp32.json]

2 ranks (torchrun, gloo on CPU), dp2, fp32 ZeRO-0 (``ds_configs/zero0_fp32.json``) or the JSON
``--config`` names (``ds_configs/zero0.json`` or ``zero1.json``: bf16), micro-batch 4 x 64 tokens per rank, the recipes' widths halved (hidden 64, 2 layers)
so that the 28 runs fit in about 7 minutes on 2 cores; PowerSGD starts after 10 uncompressed
steps (the recipe default). The runs and ``DIR/results.json`` (one row per run: final loss =
mean of the last 20 steps, bytes, step time) go to ``DIR``; ``grad_compression.json`` (per
setting: mean and spread over the seeds, the gap to the uncompressed run) to ``--results``
(default ``benchmarks/studies/results/``) and ``grad_compression_loss.png`` to ``--figures``
(default ``docs/studies/img/``); with another ``--config`` both names carry it
(``grad_compression_zero1.json``, ``grad_compression_zero1_loss.png``).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import add_output_args, output_dirs

REPO = Path(__file__).resolve().parents[2]
SIZES = ["model.hidden_size=64", "model.num_layers=2", "model.ffn_hidden_size=128",
         "model.max_seq_len=64", "data.seq_len=64", "data.max_bytes=4000000",
         "tokenizer.train_bytes=1500000", "tokenizer.vocab_size=2048", "model.vocab_size=2048"]
SETTINGS = [("none", []), ("bf16", ["parallel.grad_compression=bf16"]),
            ("powersgd-r1", ["parallel.grad_compression=powersgd", "parallel.powersgd_rank=1"]),
            ("powersgd-r4", ["parallel.grad_compression=powersgd", "parallel.powersgd_rank=4"]),
            ("powersgd-r16", ["parallel.grad_compression=powersgd", "parallel.powersgd_rank=16"]),
            ("powersgd-r4-no-ef", ["parallel.grad_compression=powersgd", "parallel.powersgd_rank=4",
                                   "parallel.powersgd_error_feedback=false"]),
            ("powersgd-r4-start50", ["parallel.grad_compression=powersgd", "parallel.powersgd_rank=4",
                                     "parallel.powersgd_start_steps=50"])]
MODELS = {"dense": ("recipes/tiny_dense.yaml", []),
          "mixtral": ("recipes/tiny_mixtral.yaml", [])}
SEEDS = (1234, 1235)
TAIL = 20             # steps averaged for the final loss


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(out: Path, name: str) -> Path:
    cfg = json.loads((REPO / "ds_configs" / f"{name}.json").read_text())
    cfg["train_micro_batch_size_per_gpu"] = 4
    path = out / f"{name}_micro4.json"
    path.write_text(json.dumps(cfg, indent=1))
    return path


def _run(model: str, setting: str, sets: list[str], seed: int, steps: int, out: Path, config: Path) -> dict:
    recipe, model_sets = MODELS[model]
    name = f"{model}-{setting}-s{seed}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(_port()), "launch/train.py", "--config", str(config), "--recipe", recipe,
           "--run-dir", str(out / name), "--steps", str(steps), "--set", *SIZES, *model_sets, *sets,
           f"train.seed={seed}", "eval.every=0", f"train.save_every={steps * 10}",
           f"train.log_every={steps}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline", TOKENIZERS_PARALLELISM="false")
    t0 = time.time()
    with open(out / f"{name}.log", "w") as log:
        subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
    rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    times = [r["step_time_s"] for r in rows[TAIL:]]
    return {"model": model, "setting": setting, "seed": seed, "steps": steps,
            "loss": [r["loss"] for r in rows],
            "final_loss": statistics.fmean(r["loss"] for r in rows[-TAIL:]),
            "exchange_bytes": rows[-1].get("grad_exchange_bytes"),
            "start_bytes": rows[0].get("grad_exchange_bytes"),     # PowerSGD's uncompressed start
            "step_time_s": statistics.median(times), "wall_s": round(time.time() - t0, 1)}


def _fill_deepspeed_bytes(results: list[dict]) -> None:
    """DeepSpeed's exchange (none, bf16) hands every gradient once: the bytes of PowerSGD's
    uncompressed start (fp32), halved in bf16 (tests/training/step/test_grad_compression_run.py
    counts both)."""
    for r in results:
        if r["exchange_bytes"] is None:
            full = next((o["start_bytes"] for o in results if o["model"] == r["model"] and o["start_bytes"]), None)
            if full is not None:            # known from a PowerSGD run of the same model
                r["exchange_bytes"] = full // 2 if r["setting"] == "bf16" else full


def _summary(results: list[dict]) -> dict:
    out = {}
    for model in dict.fromkeys(r["model"] for r in results):
        base = [r["final_loss"] for r in results if r["model"] == model and r["setting"] == "none"]
        base_mean = statistics.fmean(base)
        for setting in dict.fromkeys(r["setting"] for r in results):
            runs = [r for r in results if r["model"] == model and r["setting"] == setting]
            losses = [r["final_loss"] for r in runs]
            out[f"{model}/{setting}"] = {
                "final_loss_mean": round(statistics.fmean(losses), 4),
                "seed_spread": round(max(losses) - min(losses), 4),
            "final_losses": [round(v, 4) for v in losses],
                "gap_to_none_pct": round(100 * (statistics.fmean(losses) - base_mean) / base_mean, 2),
                "exchange_bytes": runs[0]["exchange_bytes"],
                "step_time_s": round(statistics.fmean(r["step_time_s"] for r in runs), 4)}
    return out


def _plot(results: list[dict], out: Path, config: str, stem: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in results))
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), sharey=True, squeeze=False)
    axes = axes[0]
    colors = dict(zip([s for s, _ in SETTINGS], plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    for ax, model in zip(axes, models):
        for r in results:
            if r["model"] != model:
                continue
            window = 10
            smooth = [statistics.fmean(r["loss"][max(0, i - window + 1):i + 1]) for i in range(len(r["loss"]))]
            ax.plot(range(1, len(smooth) + 1), smooth, color=colors[r["setting"]],
                    linestyle="-" if r["seed"] == SEEDS[0] else "--",
                    label=r["setting"] if r["seed"] == SEEDS[0] else None, linewidth=1)
        ax.set_title(f"tiny {model}, dp2 {config} (dashed: second seed)")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("training loss (10-step mean)")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(out / f"{stem}_loss.png", dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path, help="the study's folder: its runs")
    add_output_args(p, "studies")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--models", default=",".join(MODELS), help="a subset of " + ",".join(MODELS))
    p.add_argument("--settings", default=",".join(s for s, _ in SETTINGS),
                   help="a subset of the settings (none must be among them)")
    p.add_argument("--seeds", type=int, default=len(SEEDS), choices=range(1, len(SEEDS) + 1))
    p.add_argument("--config", default="ds_configs/zero0_fp32.json", type=Path,
                   help="the DeepSpeed JSON: ds_configs/zero0_fp32.json, zero1_fp32.json, zero0.json or zero1.json (bf16)")
    args = p.parse_args(argv)
    if args.config.stem not in ("zero0_fp32", "zero1_fp32", "zero0", "zero1"):
        p.error(f"--config {args.config}: use ds_configs/zero0_fp32.json, zero1_fp32.json, zero0.json or zero1.json")
    args.config = args.config.stem
    models, settings = args.models.split(","), args.settings.split(",")
    unknown = sorted(set(models) - set(MODELS)) + sorted(set(settings) - {s for s, _ in SETTINGS})
    if unknown or "none" not in settings or args.steps <= TAIL:
        p.error(f"unknown models/settings {unknown}, or no 'none' setting, or --steps <= {TAIL}")
    args.out.mkdir(parents=True, exist_ok=True)
    results_folder, figures = output_dirs(args, "studies")
    config = _config(args.out, args.config)
    stem = "grad_compression" + ("" if args.config == "zero0_fp32" else f"_{args.config}")
    plan = [(m, s, sets, seed) for m in models for s, sets in SETTINGS if s in settings
            for seed in SEEDS[:args.seeds]]
    results, started = [], time.time()
    for i, (model, setting, sets, seed) in enumerate(plan, 1):
        row = _run(model, setting, sets, seed, args.steps, args.out, config)
        results.append(row)
        done = time.time() - started
        sent = f"{row['exchange_bytes']:,} B/step" if row["exchange_bytes"] else "DeepSpeed's exchange"
        print(f"[{i}/{len(plan)}] {model} {setting} seed {seed}: final loss {row['final_loss']:.4f}, "
              f"{sent}, {row['step_time_s'] * 1000:.1f} ms/step; "
              f"ETA {done / i * (len(plan) - i) / 60:.1f} min", flush=True)
        (args.out / "results.json").write_text(json.dumps(results, indent=1))
    _fill_deepspeed_bytes(results)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    summary = _summary(results)
    (results_folder / f"{stem}.json").write_text(json.dumps(summary, indent=1))
    _plot(results, figures, args.config, stem)
    print(f"wrote {results_folder / f'{stem}.json'} and {figures / f'{stem}_loss.png'}", file=sys.stderr)
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
