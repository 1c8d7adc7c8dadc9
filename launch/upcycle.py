"""Upcycle a dense model into an MoE init dir (sparse upcycling).

    python launch/upcycle.py --from DIR --recipe MOE.yaml --out OUT_DIR [--set KEY=VALUE ...]
                             [--split N] [--noise STD] [--router-std STD] [--seed S] [--shared-fraction F]
    python launch/train.py --config ds_configs/zero1.json --recipe MOE.yaml --init-from OUT_DIR

``--from``: a run directory of launch/train.py (its newest checkpoint) or an init dir (what
``--init-from`` reads) holding a dense model. The MoE recipe (with the same ``--set`` overrides
that train.py will get) must match it: vocab, hidden size, heads, layers, and ffn_hidden_size =
the dense one / ``--split``. Non-FFN weights are copied; each expert is a copy of the block's
dense SwiGLU MLP (``--split N``: one of N slices of its inner dimension; expert e = slice e mod N
of copy e // N), times ``1 + STD * N(0, 1)`` with ``--noise`` (multiplicative); the router is
normal(0, ``--router-std``), default the recipe's init_std, or zeros with ``--split`` > 1.
With shared experts the shared FFN is a copy of the MLP carrying ``--shared-fraction`` of its
output at init (default 0.5), the routed experts the rest.
The last line says whether the MoE computes the dense model's function at init and, if not, why
(see interop/upcycle.py and docs/upcycling.md). OUT_DIR must not exist. Bad input: one line on
stderr, exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="upcycle.py", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 2)[2],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--from", dest="source", type=Path, required=True, metavar="DIR",
                   help="dense run directory (newest checkpoint) or dense init dir")
    p.add_argument("--recipe", required=True, metavar="MOE.yaml",
                   help="the MoE recipe YAML the model will train with")
    p.add_argument("--out", type=Path, required=True, metavar="OUT_DIR",
                   help="init dir to write (must not exist)")
    p.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                   help="recipe overrides, as train.py's --set (give train.py the same ones)")
    p.add_argument("--split", type=int, default=1, metavar="N",
                   help="cut the dense MLP's inner dimension into N slices, each an expert (default 1)")
    p.add_argument("--noise", type=float, default=0.0, metavar="STD",
                   help="std of multiplicative Gaussian noise on expert weights (default 0: copies)")
    p.add_argument("--router-std", type=float, default=None, metavar="STD",
                   help="std of the router's normal init (default: model.init_std; 0 with --split > 1)")
    p.add_argument("--seed", type=int, default=0, metavar="S",
                   help="seed of the noise and the router (default 0)")
    p.add_argument("--shared-fraction", type=float, default=0.5, metavar="F",
                   help="with shared experts: their share of the MLP's output at init (default 0.5)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        from interop.upcycle import UpcycleOptions, check_out_dir, upcycle
        from training.config.recipe import load_recipe
        opts = UpcycleOptions(args.split, args.noise, args.seed, args.router_std,
                              args.shared_fraction).validate()
        check_out_dir(args.out)
        recipe = load_recipe(args.recipe, [s for s in args.set if not s.startswith("ds.")])
        verdict = upcycle(args.source, recipe.model, args.out, opts)
    except (ValueError, FileNotFoundError) as err:
        print(f"upcycle.py: error: {err}", file=sys.stderr)
        return 2
    cfg = recipe.model
    print(f"upcycle: wrote {args.out}: {cfg.family}, {cfg.moe.num_experts} experts top-{cfg.moe.top_k} "
          f"from {args.source} (split {opts.split}, noise {opts.noise}, router std "
          f"{opts.router_init_std(cfg):g})", file=sys.stderr)
    if verdict is None:
        print("upcycle: at init the MoE computes the dense model's function (up to float rounding)")
    else:
        print(f"upcycle: at init the MoE differs from the dense model: {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
