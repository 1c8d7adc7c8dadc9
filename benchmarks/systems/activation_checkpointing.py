"""Activation checkpointing: the memory each policy saves against the time its recompute costs.

Hardware: any CPU (results in docs/performance/activation-recompute.md are from a 2-core CPU) or one CUDA GPU.
Launch:   python -m benchmarks.systems.activation_checkpointing                 # CPU fp32, ~1-2 min
          python -m benchmarks.systems.activation_checkpointing --device cuda --dtype bf16 --json ac.json

For each model (the tiny dense and tiny Mixtral recipes, and both at hidden 256 / seq 256) and
each policy of ``Transformer.set_activation_checkpointing`` (none, full, attention, moe,
experts, every_k:2):

- saved: the bytes autograd holds for backward at the end of the forward, counted with
  ``torch.autograd.graph.saved_tensors_hooks``: distinct storages, parameters excluded, only those
  still alive when the forward returns (a detached side graph is freed). Next to it the
  estimator's figure (``planning/memory_model.py``: ``activation_bytes(...)["saved"]``) and its
  ``recompute`` term, the one block (or sub-layer) that backward rebuilds at a time.
- time: one step = zero grads, forward, loss (cross-entropy + router losses), backward; the
  median of ``--repeats`` rounds after ``--warmup``, every policy of a model timed inside each
  round so that noise from other processes hits all of them alike, and the fastest step beside
  it (on a shared machine other load only ever adds time).

Ratios are against ``none`` of the same model: memory saved = 1 - saved / saved(none);
recompute overhead = time / time(none) - 1. ``moe`` and ``experts`` recompute nothing in a dense
model (n/a).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time

import torch


from planning import measured, memory_model as mm
from training.config.recipe import load_recipe
from model import Transformer

POLICIES = ("none", "full", "attention", "moe", "experts", "every_k:2")
MOE_ONLY = ("moe", "experts")
LARGER = ["model.hidden_size=256", "model.max_seq_len=256", "data.seq_len=256"]
MODELS = {   # name -> (recipe, overrides)
    "tiny-dense": ("recipes/tiny_dense.yaml", []),
    "tiny-mixtral": ("recipes/tiny_mixtral.yaml", []),
    "dense-h256-s256": ("recipes/tiny_dense.yaml", LARGER + ["model.ffn_hidden_size=512"]),
    "mixtral-h256-s256": ("recipes/tiny_mixtral.yaml", LARGER + ["model.ffn_hidden_size=256"]),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--repeats", type=int, default=7, help="timed rounds; the median is reported")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (CPU)")
    p.add_argument("--json", default=None, help="write the rows to this file")
    return p.parse_args(argv)




def train_step(model: Transformer, ids: torch.Tensor, labels: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    out = model(ids, labels)
    (out.ce_sum / out.num_target_tokens + model.router_loss(out)).backward()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def bench_model(name: str, args) -> list[dict]:
    path, overrides = MODELS[name]
    recipe = load_recipe(path, overrides)
    cfg, seq, micro = recipe.model, recipe.seq_len, args.micro_batch
    dtype, a = DTYPES[args.dtype], mm.DTYPE_BYTES[args.dtype]
    torch.manual_seed(0)
    model = Transformer(cfg).to(device=args.device, dtype=dtype).train()
    ids = torch.randint(0, cfg.vocab_size, (micro, seq), device=args.device)
    labels = torch.randint(0, cfg.vocab_size, (micro, seq), device=args.device)
    policies = [p for p in POLICIES if p not in MOE_ONLY or cfg.moe is not None]
    rows = {}
    for policy in policies:
        model.set_activation_checkpointing(policy)
        est = mm.activation_bytes(cfg, mm.Layout(1), micro, seq, a, policy)
        rows[policy] = {"model": name, "policy": policy, "params": cfg.num_params(),
                        "hidden": cfg.hidden_size, "layers": cfg.num_layers, "seq": seq,
                        "micro_batch": micro, "saved": measured.saved_activation_bytes(model, ids, labels),
                        "estimate_saved": est["saved"], "estimate_recompute": est["recompute"],
                        "times": []}
    for r in range(args.warmup + args.repeats):
        for policy in policies:
            model.set_activation_checkpointing(policy)
            sync(args.device)
            t0 = time.perf_counter()
            train_step(model, ids, labels)
            sync(args.device)
            if r >= args.warmup:
                rows[policy]["times"].append(time.perf_counter() - t0)
    base = rows["none"]
    for row in rows.values():
        row["time_s"], row["min_time_s"] = statistics.median(row["times"]), min(row["times"])
        row["memory_saved"] = 1 - row["saved"] / base["saved"]
        row["recompute_overhead"] = row["time_s"] / statistics.median(base["times"]) - 1
        row["recompute_overhead_min"] = row["min_time_s"] / min(base["times"]) - 1
    if cfg.moe is None:
        rows.update({p: {"model": name, "policy": p, "na": True} for p in MOE_ONLY})
    return [rows[p] for p in POLICIES if p in rows]


def format_table(rows: list[dict]) -> str:
    lines = ["| model | policy | saved MB (measured) | saved MB (estimator) | est/meas | recompute MB (est) "
             "| memory saved vs none | fwd+bwd ms median (min) | recompute overhead vs none: median (min) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("na"):
            lines.append(f"| {r['model']} | {r['policy']} | n/a (dense: no MoE layer) | | | | | | |")
            continue
        lines.append(f"| {r['model']} | {r['policy']} | {r['saved'] / 1e6:.2f} "
                     f"| {r['estimate_saved'] / 1e6:.2f} "
                     f"| {r['estimate_saved'] / r['saved']:.2f} | {r['estimate_recompute'] / 1e6:.2f} "
                     f"| {r['memory_saved']:.0%} | {r['time_s'] * 1e3:.1f} ({r['min_time_s'] * 1e3:.1f}) "
                     f"| {r['recompute_overhead']:+.0%} ({r['recompute_overhead_min']:+.0%}) |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    rows = []
    for name in args.models.split(","):
        rows += bench_model(name, args)
    header = (f"{datetime.date.today()} | {platform.processor() or platform.machine()} | "
              f"torch {torch.__version__} | {args.device} {args.dtype} | threads "
              f"{torch.get_num_threads()} | micro-batch {args.micro_batch} | median of "
              f"{args.repeats} rounds")
    print(header)
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            out = [{k: v for k, v in r.items() if k != "times"} for r in rows]
            json.dump({"header": header, "rows": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
