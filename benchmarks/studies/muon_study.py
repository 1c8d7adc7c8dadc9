"""Muon against AdamW on the same tokens, each at its own best learning rate, and QK-clip.

Two models, ``recipes/tiny_dense.yaml`` and ``recipes/tiny_mixtral.yaml``, fp32 ZeRO-1
(``ds_configs/zero1_fp32.json`` with the arm's optimizer), micro-batch 8 x 128 tokens, one process
per run. For each model and optimizer a small lr sweep on seed 1 (``--lrs``; Muon with
Moonlight's update RMS matched to AdamW's, ``training/optim/muon.py``, so the same grid fits
both), then the best lr (lowest final eval loss) on every seed. Per run: the final held-out loss
(16 validation batches), the final training loss (mean of the last 20 steps), the tokens at which
its training loss (20-step moving average) first reaches the same seed's AdamW final training
loss, and the median step time. A difference counts as measured only when every seed's paired
difference has the same sign and the mean difference exceeds the larger of the two arms' seed
spreads; otherwise the JSON says ``within noise``.

QK-clip (``--qk``): the tiny dense model with Muon at ``--qk-lr`` (high enough that attention
logits grow), once logging only (``train.qk_clip_tau`` out of reach) and once with tau at half
the largest logit that run reached: the logged maximum logit per step (before each step's clip)
with and without, the final eval loss and the step time of both.

    OMP_NUM_THREADS=1 python -m benchmarks.studies.muon_study --out DIR      # 26 runs x 300 steps

Writes ``muon.json`` into ``--results`` (default ``benchmarks/studies/results/``) and ``muon.png``
into ``--figures`` (default ``docs/studies/img/``); prints a table and a progress line per run with
an ETA. Runs live under ``DIR/runs``; a finished run in ``DIR`` is read, not rerun.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import add_output_args, output_dirs

REPO = Path(__file__).resolve().parents[2]
MODELS = {"dense": "recipes/tiny_dense.yaml", "mixtral": "recipes/tiny_mixtral.yaml"}
BASE_JSON = "ds_configs/zero1_fp32.json"
TAIL = 20
SKIP = 10


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="the study's folder: its runs")
    add_output_args(p, "studies")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--lrs", nargs="+", type=float, default=[3e-4, 1e-3, 3e-3], help="the sweep of both optimizers")
    p.add_argument("--seeds", nargs="+", default=["1", "2", "3"], help="train.seed values (the first sweeps)")
    p.add_argument("--eval-batches", type=int, default=16)
    p.add_argument("--qk", action=argparse.BooleanOptionalAction, default=True, help="the QK-clip runs")
    p.add_argument("--qk-lr", type=float, default=1e-2)
    return p.parse_args(argv)


def _config(out: Path, optimizer: str, lr: float) -> str:
    cfg = json.loads((REPO / BASE_JSON).read_text())
    if optimizer == "muon":
        cfg["optimizer"] = {"type": "Muon", "params": {"lr": lr, "weight_decay": 0.1, "betas": [0.9, 0.95]}}
    else:
        cfg["optimizer"]["params"]["lr"] = lr
    path = out / "configs" / f"{optimizer}-{lr:g}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cfg))
    return str(path)


class Runner:
    """Runs (or reads) one training run at a time, with a progress line and an ETA."""

    def __init__(self, args, total: int):
        self.args, self.total, self.done, self.started, self.wall = args, total, 0, time.time(), 0.0

    def run(self, name: str, model: str, optimizer: str, lr: float, seed: str, extra=()) -> Path:
        run_dir = self.args.out / "runs" / name
        if not (run_dir / "DONE").is_file():
            t0 = time.time()
            cmd = [sys.executable, "launch/train.py", "--recipe", MODELS[model], "--config",
                   _config(self.args.out, optimizer, lr), "--run-dir", str(run_dir), "--steps", str(self.args.steps),
                   "--set", f"train.seed={seed}", "train.save_every=0", "train.log_every=50",
                   f"eval.every={self.args.steps}", f"eval.batches={self.args.eval_batches}", *extra]
            env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), WANDB_MODE="offline")
            proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                sys.exit(f"error: run {name} failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
            (run_dir / "DONE").write_text("")
            self.wall += time.time() - t0
        self.done += 1
        rate = (time.time() - self.started) / self.done
        print(f"[{self.done}/{self.total}] {name}: eta {rate * (self.total - self.done) / 60:.1f} min", flush=True)
        return run_dir


def curves(run_dir: Path) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval_loss" in r]
    smooth, total = [], 0.0
    for i, r in enumerate(train):
        total += r["loss"] - (train[i - TAIL]["loss"] if i >= TAIL else 0.0)
        smooth.append(total / min(i + 1, TAIL))
    return {"tokens": [r["tokens"] for r in train], "smoothed_loss": smooth,
            "max_logit": [max(v for v in r["max_logit"] if v is not None) for r in train if r.get("max_logit")],
            "final_eval_loss": evals[-1]["eval_loss"], "final_loss": statistics.mean(r["loss"] for r in train[-TAIL:]),
            "step_time_s": statistics.median(r["step_time_s"] for r in (train[SKIP:] or train))}


def tokens_to_reach(run: dict, target: float) -> int | None:
    """The first token count at which ``run``'s smoothed training loss is at most ``target``."""
    return next((t for t, v in zip(run["tokens"], run["smoothed_loss"]) if v <= target), None)


def verdict(diffs: list[float], spreads: list[float]) -> str:
    same_sign = all(d > 0 for d in diffs) or all(d < 0 for d in diffs)
    if len(diffs) > 1 and same_sign and abs(statistics.mean(diffs)) > max(spreads):
        return "Muon lower" if statistics.mean(diffs) < 0 else "AdamW lower"
    return "within noise"


def _stat(values: list[float]) -> dict:
    return {"mean": statistics.mean(values), "spread": max(values) - min(values), "per_seed": values}


def main(argv=None) -> int:
    args = parse_args(argv)
    results, figures = output_dirs(args, "studies")
    started = time.time()
    n_sweep = len(args.models) * 2 * len(args.lrs)
    runner = Runner(args, n_sweep + len(args.models) * 2 * len(args.seeds) + 2 * args.qk)
    out = {"steps": args.steps, "lrs": args.lrs, "seeds": args.seeds, "models": {}, "machine": machine(),
           "command": "python -m benchmarks.studies.muon_study " + " ".join(sys.argv[1:] if argv is None else argv)}
    for model in args.models:
        entry = out["models"][model] = {"sweep": {}, "best_lr": {}, "runs": {}}
        for opt in ("adamw", "muon"):
            for lr in args.lrs:
                run = curves(runner.run(f"{model}-{opt}-{lr:g}-s{args.seeds[0]}", model, opt, lr, args.seeds[0]))
                entry["sweep"][f"{opt} {lr:g}"] = run["final_eval_loss"]
            best = min(args.lrs, key=lambda lr: entry["sweep"][f"{opt} {lr:g}"])
            entry["best_lr"][opt] = best
            for seed in args.seeds:
                entry["runs"][f"{opt}-s{seed}"] = curves(runner.run(f"{model}-{opt}-{best:g}-s{seed}", model, opt,
                                                                    best, seed))
        entry["arms"], entry["paired"] = _compare(entry["runs"], args.seeds)
    if args.qk:
        free = curves(runner.run("qk-log-only", "dense", "muon", args.qk_lr, args.seeds[0],
                                 ["train.qk_clip_tau=1000000"]))
        tau = round(max(free["max_logit"]) / 2, 2)
        clip = curves(runner.run(f"qk-tau{tau:g}", "dense", "muon", args.qk_lr, args.seeds[0],
                                 [f"train.qk_clip_tau={tau}"]))
        out["qk_clip"] = {"lr": args.qk_lr, "tau": tau, "log_only": free, "clipped": clip,
                          "max_logit_after_first_clip": max(clip["max_logit"][1:] or [0.0]),
                          "eval_loss_change": clip["final_eval_loss"] - free["final_eval_loss"],
                          "step_time_ratio": clip["step_time_s"] / free["step_time_s"]}
    out["runs_wall_s"], out["wall_s"] = runner.wall, time.time() - started
    (results / "muon.json").write_text(json.dumps(out, indent=1) + "\n")
    _plot(out, figures / "muon.png")
    _table(out)
    return 0


def _compare(runs: dict, seeds: list[str]) -> tuple[dict, dict]:
    arms = {opt: {key: _stat([runs[f"{opt}-s{s}"][key] for s in seeds])
                  for key in ("final_eval_loss", "final_loss", "step_time_s")} for opt in ("adamw", "muon")}
    paired = {}
    for key in ("final_eval_loss", "final_loss"):
        diffs = [runs[f"muon-s{s}"][key] - runs[f"adamw-s{s}"][key] for s in seeds]
        paired[key] = {"muon_minus_adamw": diffs,
                       "verdict": verdict(diffs, [arms["adamw"][key]["spread"], arms["muon"][key]["spread"]])}
    fractions = []
    for s in seeds:
        reach = tokens_to_reach(runs[f"muon-s{s}"], runs[f"adamw-s{s}"]["final_loss"])
        fractions.append(None if reach is None else reach / runs[f"adamw-s{s}"]["tokens"][-1])
    paired["tokens_to_adamw_final_loss"] = {"fraction_of_adamw_tokens": fractions}
    paired["step_time_ratio"] = [runs[f"muon-s{s}"]["step_time_s"] / runs[f"adamw-s{s}"]["step_time_s"] for s in seeds]
    return arms, paired


def machine() -> str:
    from training.run.host import cpu_name
    return f"{cpu_name()}, {os.cpu_count()} cores"


def _plot(out: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = len(out["models"]) + ("qk_clip" in out)
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 4), squeeze=False)
    for ax, (model, entry) in zip(axes[0], out["models"].items()):
        for opt, color in (("adamw", "tab:blue"), ("muon", "tab:red")):
            for i, s in enumerate(out["seeds"]):
                run = entry["runs"][f"{opt}-s{s}"]
                ax.plot(run["tokens"], run["smoothed_loss"], color=color, alpha=0.8, lw=1,
                        label=f"{opt} lr {entry['best_lr'][opt]:g}" if i == 0 else None)
        ax.set(title=f"tiny {model}: training loss (20-step mean)", xlabel="tokens", ylabel="loss")
        ax.legend()
    if "qk_clip" in out:
        ax, qk = axes[0][-1], out["qk_clip"]
        ax.plot(qk["log_only"]["max_logit"], label="no clip", color="tab:gray")
        ax.plot(qk["clipped"]["max_logit"], label=f"QK-clip tau {qk['tau']:g}", color="tab:red")
        ax.axhline(qk["tau"], ls="--", color="k", lw=0.8)
        ax.set(title=f"largest attention logit, Muon lr {qk['lr']:g}", xlabel="step", ylabel="max logit")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _table(out: dict) -> None:
    for model, entry in out["models"].items():
        print(f"tiny {model}: best lr AdamW {entry['best_lr']['adamw']:g}, Muon {entry['best_lr']['muon']:g}")
        for opt, arm in entry["arms"].items():
            print(f"  {opt:6s} eval {arm['final_eval_loss']['mean']:.4f} (spread {arm['final_eval_loss']['spread']:.4f})"
                  f"  step {arm['step_time_s']['mean'] * 1e3:.0f} ms")
        print(f"  eval loss: {entry['paired']['final_eval_loss']['verdict']}; tokens to AdamW's final loss: "
              f"{entry['paired']['tokens_to_adamw_final_loss']['fraction_of_adamw_tokens']}")
    if "qk_clip" in out:
        qk = out["qk_clip"]
        print(f"QK-clip tau {qk['tau']:g}: max logit after the first clip {qk['max_logit_after_first_clip']:.2f} "
              f"(no clip: {max(qk['log_only']['max_logit']):.2f}); eval loss change {qk['eval_loss_change']:+.4f}; "
              f"step time x{qk['step_time_ratio']:.2f}")


if __name__ == "__main__":
    sys.exit(main())
