"""The planner's cost model against published training runs: predicted vs published tokens/s/GPU.

Hardware: any CPU, under a second (nothing trains: the cost model is arithmetic).
Launch:   python benchmarks/planner_vs_published.py                    # the built-in cases
          python benchmarks/planner_vs_published.py --cases mine.json  # and yours
          python benchmarks/planner_vs_published.py --only mixtral --breakdown --json out.json

The built-in cases are ``benchmarks/peers/published_runs.json``: each is a published run reproduced as
a recipe's model section, a cluster and a layout, with the figure and where it was published.
``--cases FILE`` adds cases in the same form (docs/planning.md, "Checking it against your runs"):

    {"cases": [{"name": "...", "title": "...", "source": {"url": "..."},
                "model": {recipe model keys} | "recipe": "recipes/X.yaml", "set": ["k=v"],
                "mlp": "swiglu" | "gelu",
                "cluster": {"gpu": "h100-80gb", "gpus": 64, "gpus_per_node": 8,
                            "network_gbit_s": 3200},
                "layout": {planning.cost_model.Layout fields but world},
                "published": {"value": 468, "unit": "tokens/s/gpu" | "tflops/gpu",
                              "flops": "megatron-2024" | "megatron-2025" | "bigscience"},
                "held": true | false, "why_not_held": "..."}]}

A figure in TFLOP/s is turned into tokens/s with the FLOP count of the code that reported it
(``FLOP_COUNTS``), so the comparison is in tokens/s per GPU at the stated sequence length. Every
row ends in the relative error of the prediction, (predicted - published) / published. Exit 1
when a held row is off by more than ``--tolerance`` (default 25%), 2 on a bad case file. A case
with ``"held": false`` is printed as a reference, marked, and not held to the tolerance: the
built-in ones say why (``why_not_held``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from planning.cost_model import Layout, Shape, step_cost
from planning.hardware import cluster
from training.config.recipe import load_recipe, recipe_from_dict

REPO = Path(__file__).resolve().parents[2]

BUILT_IN = Path(__file__).with_name("published_runs.json")
TOLERANCE = 0.25


# ---------------------------------------------------------------------------------------------
# FLOPs per token as each reporting code counts them (the formulas are quoted in docs/planning.md
# with their repository, path and commit).

def _megatron(shape: Shape, seq: int, causal: bool) -> float:
    """Megatron-LM ``num_floating_point_operations`` per token: 12 L h^2 [(1 + g/n + s/h) q/h
    + f k (3/2 if SwiGLU) / h + V / (2 L h)]; MoE as the routed top-k (core_r0.8-0.9, 2024),
    with the causal half of s/h and the shared experts added in the 2025 code
    (``transformer_flops``, commit 8873b55 onwards)."""
    h, layers = shape.hidden, shape.layers
    q_ratio = shape.heads * shape.head_dim / h
    gated = 1.5 if shape.gated else 1.0
    attn = (1 + shape.kv_heads / shape.heads + seq / h / (2 if causal else 1)) * q_ratio
    if shape.experts:
        moe_layers = sum(shape.is_moe(i) for i in range(layers))
        ffn = (shape.expert_ffn * shape.top_k + (shape.shared_ffn if causal else 0)) * moe_layers \
            + shape.ffn * (layers - moe_layers)
        mlp = ffn / layers * gated / h
    else:
        mlp = shape.ffn * gated / h
    return 12 * layers * h * h * (attn + mlp + shape.vocab / (2 * layers * h))


def _bigscience(shape: Shape, seq: int) -> float:
    """bigscience Megatron-DeepSpeed (BLOOM): 96 l h^2 (1 + s / 6h + V / 16 l h) per token with
    activation checkpointing: the recomputed forward counted (4x instead of 3x)."""
    h, layers = shape.hidden, shape.layers
    coefficient = 32 if shape.gated else 24
    return coefficient * 4 * layers * h * h * (1 + seq / (6 * h) + shape.vocab / (16 * layers * h))


FLOP_COUNTS = {
    "megatron-2024": lambda shape, seq: _megatron(shape, seq, causal=False),
    "megatron-2025": lambda shape, seq: _megatron(shape, seq, causal=True),
    "bigscience": _bigscience,
}
LAYOUT_KEYS = set(Layout.__dataclass_fields__) - {"world"}


# ---------------------------------------------------------------------------------------------
# Cases.

def load_cases(path: Path) -> list[dict]:
    """The ``cases`` list of a JSON file; ValueError naming the file and what is wrong."""
    try:
        data = json.loads(path.read_text())
    except OSError as err:
        raise ValueError(f"--cases {path}: cannot read it ({err.strerror})") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"--cases {path}: not JSON ({err.msg}, line {err.lineno})") from None
    cases = data.get("cases") if isinstance(data, dict) else None
    if not isinstance(cases, list) or not cases:
        raise ValueError(f"--cases {path}: expected an object with a non-empty \"cases\" list")
    return cases


def build(case: dict, gemm_fraction: float | None = None) -> tuple[Shape, object, Layout, str]:
    """(shape, cluster, layout, model config) of one case; ValueError naming the field."""
    name = case.get("name") or "?"
    try:
        if "recipe" in case:
            cfg = load_recipe(str(REPO / case["recipe"]), case.get("set", [])).model
        else:
            cfg = recipe_from_dict({"name": name, "model": case["model"]}).model
        shape = Shape.from_config(cfg)
        if case.get("mlp", "swiglu") not in ("swiglu", "gelu"):
            raise ValueError(f"mlp {case['mlp']!r}: swiglu or gelu")
        if case.get("mlp") == "gelu":
            shape = Shape(**{**shape.__dict__, "gated": False})
        c = case["cluster"]
        where = cluster(c["gpu"], c.get("gpus_per_node", 8), c.get("network_gbit_s"),
                        gemm_fraction=gemm_fraction)
        unknown = set(case["layout"]) - LAYOUT_KEYS
        if unknown:
            raise ValueError(f"layout key(s) {', '.join(sorted(unknown))}: not a "
                             f"planning.cost_model.Layout field")
        layout = Layout(world=int(c["gpus"]), **case["layout"])
        layout.check(shape)
        pub = case["published"]
        if pub.get("unit") not in ("tokens/s/gpu", "tflops/gpu"):
            raise ValueError(f"published.unit {pub.get('unit')!r}: tokens/s/gpu or tflops/gpu")
        if pub["unit"] == "tflops/gpu" and pub.get("flops") not in FLOP_COUNTS:
            raise ValueError(f"published.flops {pub.get('flops')!r}: one of {', '.join(FLOP_COUNTS)}")
    except KeyError as err:
        raise ValueError(f"case {name}: {err.args[0]} is missing") from None
    except (TypeError, ValueError) as err:
        raise ValueError(f"case {name}: {err}") from None
    return shape, where, layout, cfg


def published_tokens(case: dict, shape: Shape, layout: Layout) -> float:
    pub = case["published"]
    if pub["unit"] == "tokens/s/gpu":
        return float(pub["value"])
    return float(pub["value"]) * 1e12 / FLOP_COUNTS[pub["flops"]](shape, layout.seq_len)


def evaluate(case: dict, gemm_fraction: float | None = None) -> dict:
    shape, where, layout, cfg = build(case, gemm_fraction)
    cost = step_cost(shape, layout, where)
    published = published_tokens(case, shape, layout)
    peak = where.device.peak_flops
    row = {"name": case["name"], "gpu": where.device.name, "gpus": layout.world,
           "held": bool(case.get("held", True)),
           "published": published, "predicted": cost.tokens_per_s_per_gpu,
           "error": cost.tokens_per_s_per_gpu / published - 1,
           "mfu_causal": cost.tokens_per_s_per_gpu * shape.flops_per_token(layout.seq_len) / peak,
           "mfu_full": cost.tokens_per_s_per_gpu * shape.flops_per_token(layout.seq_len, False) / peak,
           "published_mfu_full": published * shape.flops_per_token(layout.seq_len, False) / peak,
           **cost.as_dict()}
    return row


def _layout_text(case: dict) -> str:
    lay = case["layout"]
    parts = [f"{k}{lay[k]}" for k in ("tp", "cp", "ep", "pp") if lay.get(k, 1) > 1]
    if lay.get("vpp", 1) > 1:
        parts.append(f"vpp{lay['vpp']}")
    zero = {0: "ddp", 1: "zero1", 2: "zero2", 3: "fsdp"}[lay.get("zero_stage", 1)]
    return " ".join(parts + [zero, f"mb{lay.get('micro_batch', 1)}", f"gb{lay['global_batch']}",
                             f"s{lay['seq_len']}", f"rc:{lay.get('recompute', 'none')}"])


def table(cases: list[dict], rows: list[dict], breakdown: bool) -> str:
    lines = [f"{'case':<58} {'GPUs':>4} {'layout':<44} {'published':>9} {'predicted':>9} "
             f"{'MFU pub':>7} {'MFU pred':>8} {'error':>7}"]
    for case, r in zip(cases, rows):
        lines.append(f"{r['name']:<58} {r['gpus']:>4} {_layout_text(case):<44} "
                     f"{r['published']:>9.0f} {r['predicted']:>9.0f} {r['published_mfu_full']:>7.1%} "
                     f"{r['mfu_full']:>8.1%} {r['error']:>+7.1%}" + ("" if r["held"] else "  (reference)"))
        if breakdown:
            b = r["breakdown"]
            lines.append("    step {:.3f} s: gemm {:.3f} attention {:.3f} elementwise {:.3f} "
                         "recompute {:.3f} head {:.3f} | exposed tp {:.3f} dp {:.3f} ep {:.3f} "
                         "pp {:.3f} | bubble {:.3f} optimizer {:.3f}".format(
                             r["step_s"], b["gemm"], b["attention"], b["elementwise"],
                             b["recompute"], b["head"], r["tp_comm_s"], r["dp_comm_s"],
                             r["ep_comm_s"], r["pp_comm_s"], r["bubble_s"], r["optimizer_s"]))
    held = [abs(r["error"]) for r in rows if r["held"]]
    if held:
        lines.append(f"{len(held)} held cases: mean |error| {sum(held) / len(held):.1%}, "
                     f"largest {max(held):.1%}")
    refs = [r for r in rows if not r["held"]]
    if refs:
        lines.append(f"{len(refs)} reference cases (not held): errors "
                     + ", ".join(f"{r['error']:+.1%}" for r in refs))
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", action="append", default=[], metavar="FILE",
                   help="a JSON file of more cases, in the built-in form (repeatable)")
    p.add_argument("--no-built-in", action="store_true", help="only the --cases files")
    p.add_argument("--only", default=None, help="cases whose name contains this")
    p.add_argument("--breakdown", action="store_true", help="print each prediction's breakdown")
    p.add_argument("--tolerance", type=float, default=TOLERANCE,
                   help="largest |error| that passes (default 0.25)")
    p.add_argument("--gemm-fraction", type=float, default=None,
                   help="every GPU's large-GEMM share of its peak (a calibration; default the table's)")
    p.add_argument("--json", default=None, help="write the rows to this file")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        cases = [] if args.no_built_in else load_cases(BUILT_IN)
        for f in args.cases:
            cases += load_cases(Path(f))
        if args.only:
            cases = [c for c in cases if args.only in c.get("name", "")]
        if not cases:
            raise ValueError("no case to compare: check --only and --cases")
        rows = [evaluate(c, args.gemm_fraction) for c in cases]
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(table(cases, rows, args.breakdown))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 1 if any(r["held"] and abs(r["error"]) > args.tolerance for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
