"""Switch scaling with the expert count at equal active FLOPs, and expert placement over ep ranks.

Hardware: CPU, one process per run (fp32 ZeRO-1, ``ds_configs/zero1_fp32.json``). The study in
docs/switch.md (E = 1, 2, 4, ..., 64 x 2 seeds x 300 steps, 14 runs) took 37 min on a 2-core
machine under other jobs' load (load average 15-20; each run prints its seconds). Launch:

    OMP_NUM_THREADS=1 python -m benchmarks.studies.switch_scaling --out runs/switch_scaling \\
        [--experts 1,2,4,8,16,32,64] [--steps 300] [--seeds 2] [--eval-every 50] \\
        [--placement-experts 8,16] [--placement-ep 2,4,8] \\
        [--json benchmarks/studies/results/switch_scaling.json] [--png docs/studies/img/switch_scaling.png]
    python -m benchmarks.studies.switch_scaling --out DIR --skip-runs ...   # summarize DIR's finished sweep again

1. **Scaling with E.** ``recipes/tiny_switch.yaml`` with ``model.moe.num_experts`` = each of
   ``--experts`` (top-1, every expert the recipe's size, so each E does the same FLOPs per token:
   E = 1 is the dense model, which ``tests/model/test_moe.py`` shows equal to the dense MLP), one
   ``launch/sweep.py`` over ``num_experts x train.seed``. Per E: eval loss against steps and
   against training wall time, final eval loss over seeds (mean, max - min), median step time
   (``analysis/switch_scaling.py``, which reuses ``analysis/dense_vs_sparse.py``'s summary).
2. **Placement.** The trained routers of ``--placement-experts`` (the runs' logged
   ``tokens_per_expert``, every 10 steps, per MoE layer): per-rank routed load max/mean at each
   ``--placement-ep`` for the trainer's ``contiguous`` and ``round_robin`` placements, random
   balanced placements and a load-aware one fitted on the first half of the run.
3. **Expert count vs memory.** ``recipes/switch_base_128.yaml``'s layout (16 GPUs, EP8, ZeRO-2,
   H100-80GB) with E = 8 ... 256 through ``planning/estimator.py``: parameters per expert, per
   GPU, memory, fits; and the rows each expert's GEMM gets per micro-batch.

Writes ``--json`` and ``--png`` (plus ``<png stem>_placement.png``); the runs live under
``--out``/sweep (checkpoints are not written). Prints the tables. Bad input is one line, exit 2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from analysis import dense_vs_sparse as dvs
from analysis import switch_scaling as ss

REPO = Path(__file__).resolve().parents[2]

RECIPE = "recipes/tiny_switch.yaml"
CONFIG = "ds_configs/zero1_fp32.json"
LOG_EVERY = 10                       # rows with tokens_per_expert (the placement's input)
BASE_RECIPE = "recipes/switch_base_128.yaml"
BASE_CONFIG = "ds_configs/zero2.json"
BASE_GPUS = 16
BASE_GPU = "h100-80gb"
BASE_EXPERTS = (8, 16, 32, 64, 128, 256)


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{flag} {text!r}: expected comma-separated integers, e.g. 1,2,4,8") from None
    if not values or min(values) < 1:
        raise ValueError(f"{flag} {text!r}: expected integers >= 1")
    return values


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="the runs' directory (new or empty)")
    p.add_argument("--experts", default="1,2,4,8,16,32,64", help="expert counts (1 = dense)")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps of every run")
    p.add_argument("--seeds", type=int, default=2, help="seeds per E (train.seed 1234, 1235, ...)")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--placement-experts", default="8,16", help="E whose trained routers are placed")
    p.add_argument("--placement-ep", default="2,4,8", help="ep sizes of the placement study")
    p.add_argument("--json", type=Path, default=REPO / "benchmarks/studies/results/switch_scaling.json")
    p.add_argument("--png", type=Path, default=REPO / "docs/studies/img/switch_scaling.png")
    p.add_argument("--skip-runs", action="store_true", help="summarize --out's finished sweep again")
    return p.parse_args(argv)


def check(args) -> dict:
    """Every check before the first run; ValueError (one line naming the flag) on bad input."""
    for name in ("steps", "seeds", "eval_every", "eval_batches"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    if args.eval_every > args.steps:
        raise ValueError(f"--eval-every {args.eval_every}: larger than --steps {args.steps}, "
                         f"so no eval would run; choose at most {args.steps}")
    experts = sorted(set(_ints(args.experts, "--experts")))
    placement_experts = _ints(args.placement_experts, "--placement-experts") if args.placement_experts else []
    eps = _ints(args.placement_ep, "--placement-ep") if placement_experts else []
    ss.check_placement_args(experts, placement_experts, eps)
    sweep = args.out / "sweep"
    if args.skip_runs and not (sweep / "results.json").is_file():
        raise ValueError(f"--skip-runs: no {sweep}/results.json (run without --skip-runs first)")
    if not args.skip_runs and args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())):
        raise ValueError(f"--out {args.out}: exists and is not an empty directory; choose a new one "
                         f"(or --skip-runs to summarize it)")
    return {"experts": experts, "placement_experts": placement_experts, "eps": eps}


def settings(args) -> list[str]:
    return [f"eval.every={args.eval_every}", f"eval.batches={args.eval_batches}",
            f"train.log_every={LOG_EVERY}", f"train.save_every={args.steps * 10}",
            "train.keep_last=1", "tracking.wandb=false"]


def run_sweep(args, experts: list[int]) -> int:
    from launch import sweep
    argv = ["--config", CONFIG, "--recipe", RECIPE, "--steps", str(args.steps),
            "--grid", "model.moe.num_experts=" + ",".join(map(str, experts)),
            "--grid", "train.seed=" + ",".join(map(str, dvs.seeds(args.seeds))),
            "--set", *settings(args), "--out", str(args.out / "sweep")]
    print(f"{len(experts) * args.seeds} runs of {args.steps} steps through launch/sweep.py "
          f"(one line per finished run, with its seconds)", flush=True)
    return sweep.main(argv)


def facts_for(args, E: int) -> dict:
    arm = dvs.Arm(f"switch-e{E}", "switch", (f"model.moe.num_experts={E}",))
    facts = dvs.model_facts(arm, settings(args))
    from training.config.recipe import load_recipe
    cfg = load_recipe(RECIPE, [f"model.moe.num_experts={E}"]).model
    facts["params_per_expert"] = 3 * cfg.hidden_size * cfg.ffn_hidden_size     # SwiGLU: gate, up, down
    return facts


def summarize(args, plan: dict) -> dict:
    results = json.loads((args.out / "sweep" / "results.json").read_text())
    by_e: dict[int, list[Path]] = {}
    failed = []
    for r in results:
        if r["status"] != "ok":
            failed.append(f"{r['name']}: {r['status']}")
            continue
        by_e.setdefault(int(r["point"]["model.moe.num_experts"]), []).append(Path(r["run_dir"]))
    rows = [ss.summarize_e(E, facts_for(args, E), by_e[E]) for E in plan["experts"] if E in by_e]
    placements = {}
    for E in plan["placement_experts"]:
        score_fit = [ss.split_counts(ss.routed_counts(d), args.steps) for d in by_e.get(E, [])]
        fit = [c for f, _ in score_fit for c in f]
        score = [c for _, s in score_fit for c in s]
        if fit and score:
            placements[E] = {ep: ss.placement_study(fit, score, ep) for ep in plan["eps"]}
    return {"rows": rows, "placements": placements, "failed": failed,
            "runs_wall_s": sum(r["seconds"] for r in results)}


def expert_memory() -> list[dict]:
    """The base recipe's layout at each of ``BASE_EXPERTS`` through the memory estimator."""
    from planning.estimator import estimate
    from training.config.ds_config import load_ds_config
    from training.config.recipe import load_recipe
    from training.gpus import GPUS
    ds = load_ds_config(str(REPO / BASE_CONFIG))
    gpu = GPUS[BASE_GPU]
    ridge = gpu.bf16_tflops * 1e12 / (gpu.hbm_tb_s * 1e12)       # FLOP/byte where compute-bound
    out = []
    for E in BASE_EXPERTS:
        recipe = load_recipe(str(REPO / BASE_RECIPE), [f"model.moe.num_experts={E}"])
        est = estimate(recipe, ds, BASE_GPUS, gpu=BASE_GPU)
        cfg, moe, worst = recipe.model, recipe.model.moe, est["worst"]
        tokens = est["micro_batch"] * recipe.seq_len          # one micro-batch over the ep group
        rows = ss.rows_per_expert(tokens, moe.top_k, moe.capacity_factor, E)
        intensity = ss.gemm_intensity(rows, cfg.hidden_size, cfg.ffn_hidden_size)
        out.append({"num_experts": E, "ep": est["ep"], "experts_per_gpu": E // est["ep"],
                    "params_per_expert": 3 * cfg.hidden_size * cfg.ffn_hidden_size,
                    "params_total": est["params_total"], "params_active": est["params_active"],
                    "expert_params_per_gpu": worst["params"]["expert"],
                    "other_params_per_gpu": worst["params"]["other"],
                    "gpu_total_gb": worst["gpu_total"] / 1e9, "fits_h100_80gb": est["fits"],
                    "micro_batch_tokens": tokens,
                    "rows_per_expert": rows, "gemm_flop_per_byte": intensity,
                    "roofline_ceiling": min(1.0, intensity / ridge)})
    return out


def machine() -> str:
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        name = next(line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        name = platform.processor() or "unknown CPU"
        lscpu = ""
    flags = [f for f in ("AMX-BF16", "AVX512-BF16") if f.lower().replace("-", "_") in lscpu]
    return f"{name}{' with ' + '/'.join(flags) if flags else ''}, {os.cpu_count()} cores"


def report(args, plan: dict, study: dict, wall_s: float | None) -> dict:
    import torch
    return {"study": "switch_scaling", "recipe": RECIPE, "config": CONFIG, "steps": args.steps,
            "seeds": dvs.seeds(args.seeds), "settings": settings(args), "machine": machine(),
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d", time.gmtime()),
            "runs_wall_s": study["runs_wall_s"], "sweep_wall_s": wall_s,
            "command": "OMP_NUM_THREADS=1 python -m benchmarks.studies.switch_scaling --out runs/switch_scaling "
                       f"--experts {','.join(map(str, plan['experts']))} --steps {args.steps} --seeds {args.seeds}",
            "scaling": study["rows"], "failed": study["failed"],
            "placement": {"note": "mean over (step, MoE layer) of max/mean per-rank routed load, scored on "
                                  "the second half of each run, the load-aware placement fitted on the first",
                          "by_experts": {str(E): {str(ep): {k: v for k, v in p.items() if k != "ranks"}
                                                  for ep, p in by_ep.items()}
                                         for E, by_ep in study["placements"].items()},
                          "ranks": {str(E): {str(ep): p["ranks"] for ep, p in by_ep.items()}
                                    for E, by_ep in study["placements"].items()}},
            "expert_memory": {"recipe": BASE_RECIPE, "config": BASE_CONFIG, "gpus": BASE_GPUS,
                              "gpu": BASE_GPU,
                              "note": "roofline_ceiling: the expert GEMM's FLOP/byte (bf16) over the GPU's "
                                      "bf16 TFLOP/s / HBM TB/s, capped at 1: the most of peak it can reach",
                              "rows": expert_memory()}}


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        plan = check(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    wall = None
    if not args.skip_runs:
        args.out.mkdir(parents=True, exist_ok=True)
        start = time.time()
        rc = run_sweep(args, plan["experts"])
        wall = time.time() - start
        if rc == 2:
            return 2
    study = summarize(args, plan)
    if not study["rows"]:
        print(f"error: no run finished ({'; '.join(study['failed'])}; logs in {args.out / 'sweep'})",
              file=sys.stderr)
        return 1
    out = report(args, plan, study, wall)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.png.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1))
    ss.plot(study["rows"], study["placements"], args.png,
            f"tiny Switch, top-1, same expert size, {args.steps} steps x {args.seeds} seed(s); {out['machine']}")
    print(ss.scaling_table(study["rows"]), end="")
    if study["placements"]:
        print(ss.placement_table(study["placements"]), end="")
    for r in out["expert_memory"]["rows"]:
        print(f"E={r['num_experts']}: {r['params_total'] / 1e9:.2f}B total, "
              f"{r['expert_params_per_gpu'] / 1e9:.3f}B expert params/GPU, {r['gpu_total_gb']:.1f} GB/GPU, "
              f"{r['rows_per_expert']:.0f} rows/expert/micro-batch, "
              f"GEMM {r['gemm_flop_per_byte']:.0f} FLOP/B, at most {r['roofline_ceiling']:.0%} of bf16 peak")
    with contextlib.suppress(ValueError):
        print(f"wrote {args.json.relative_to(REPO)}, {args.png.relative_to(REPO)}")
    if study["failed"]:
        print(f"error: {len(study['failed'])} run(s) failed: {'; '.join(study['failed'])}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
