"""The benchmarks and studies, by trade (``peers``, ``systems``, ``studies``, ``gpu``,
``reliability``); each runs as ``python -m benchmarks.<trade>.<name>`` from the repository root.

Where they write by default: results (JSON, markdown tables) beside the benchmark, in
``benchmarks/<trade>/results/``; the figures the docs show, in ``docs/studies/img/``."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FIGURES = REPO / "docs" / "studies" / "img"


def results_dir(trade: str) -> Path:
    """``benchmarks/<trade>/results/``: where that trade's results go by default."""
    return REPO / "benchmarks" / trade / "results"


def add_output_args(parser, trade: str, out: bool = False) -> None:
    """``--results DIR`` (default ``benchmarks/<trade>/results/``) and ``--figures DIR`` (default
    ``docs/studies/img/``); with ``out``, also ``--out DIR``: both in DIR."""
    parser.add_argument("--results", type=Path, metavar="DIR",
                        help=f"folder for the JSON results (default: benchmarks/{trade}/results)")
    parser.add_argument("--figures", type=Path, metavar="DIR",
                        help="folder for the figures (default: docs/studies/img)")
    if out:
        parser.add_argument("--out", dest="both", type=Path, metavar="DIR",
                            help="the JSON results and the figures both in DIR")


def output_dirs(args, trade: str) -> tuple[Path, Path]:
    """The results and figures folders ``add_output_args`` asked for, made."""
    both = getattr(args, "both", None)
    results = args.results or both or results_dir(trade)
    figures = args.figures or both or FIGURES
    for folder in (results, figures):
        folder.mkdir(parents=True, exist_ok=True)
    return results, figures
