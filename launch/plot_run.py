"""Plot one run, or overlay several, from their ``metrics.jsonl`` as PNG files.

    python launch/plot_run.py --run-dir runs/tiny-mixtral [--run-dir runs/other ...] [--out DIR]

Writes ``training.png`` (loss and eval loss, lr, gradient norm, tokens/s), and for MoE runs
``moe_balance.png`` (max/mean expert load, dropped fraction, expert bias spread) and
``moe_load_<run>.png`` (each layer's expert x step load heatmap), and
``grad_norm_layers_<run>.png`` (each layer's gradient norm, spikes marked) into ``DIR`` (default
``<first run dir>/plots``), and prints their paths. See ``analysis/run_plots.py``. A missing or unreadable run is one line, exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from analysis import run_plots  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run-dir", action="append", required=True,
                   help="a run directory of launch/train.py; repeat it to overlay runs")
    p.add_argument("--out", help="where the PNG files go (default: <first run dir>/plots)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        runs = {}
        for i, run_dir in enumerate(args.run_dir):
            name = Path(run_dir).resolve().name
            runs[name if name not in runs else f"{name}-{i}"] = run_plots.read_metrics(Path(run_dir))
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else Path(args.run_dir[0]) / "plots"
    out.mkdir(parents=True, exist_ok=True)
    written = ["training.png"]
    run_plots.plot_training(runs, out)
    if run_plots.plot_moe_balance(runs, out):
        written.append("moe_balance.png")
    for name, (train, _) in runs.items():
        if run_plots.plot_moe_load(name, train, out):
            written.append(f"moe_load_{name}.png")
        if run_plots.plot_layer_grad_norms(name, train, out):
            written.append(f"grad_norm_layers_{name}.png")
    for name in written:
        print(out / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
