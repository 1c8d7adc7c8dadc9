"""PNG plots of a router report (``analysis/router_report.py``, ``launch/analyze_router.py``).

- ``router_load.png``: per checkpoint, a heatmap of each MoE layer's expert load as share x E
  (1 = an even share), MoE layer x expert.
- ``router_vs_step.png``: load max/mean, router entropy and load entropy against the checkpoint
  step, one line per MoE layer (ln E dashed: the uniform value).
- ``router_co_selection.png`` (top-k >= 2): per MoE layer of the last checkpoint, the fraction
  of tokens that picked both experts, expert x expert (the diagonal left blank).
- ``router_classes.png``: per MoE layer of the last checkpoint, each token class's lift per
  expert (share among the expert's assignments / share in the text; 1 = no preference).

Each function returns the file name it wrote, or None when it had nothing to draw.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")                  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

from analysis.router_report import CLASSES  # noqa: E402


def _grid(n: int, cols: int = 4):
    cols = min(n, cols)
    return -(-n // cols), cols


def plot_load(report: dict, out: Path) -> str:
    entries = report["checkpoints"]
    rows, cols = _grid(len(entries))
    fig, axes = plt.subplots(rows, cols, figsize=(3.4 * cols, 0.5 * len(entries[0]["layers"]) * rows + 1.6 * rows),
                             squeeze=False, constrained_layout=True)
    for ax in axes.flat[len(entries):]:
        ax.axis("off")
    for ax, entry in zip(axes.flat, entries):
        grid = [[x["share_of_uniform"] for x in L["experts"]] for L in entry["layers"]]
        image = ax.imshow(grid, aspect="auto", cmap="coolwarm", vmin=0.0, vmax=2.0,
                          interpolation="nearest")
        ax.set_yticks(range(len(grid)), [f"block {L['block']}" for L in entry["layers"]])
        ax.set_xlabel("expert")
        ax.set_title(f"step {entry['step']}" if entry["step"] is not None else entry["tag"])
    fig.colorbar(image, ax=axes, label="share x experts (1 = even)")
    fig.savefig(out / "router_load.png", dpi=100)
    plt.close(fig)
    return "router_load.png"


def plot_vs_step(report: dict, out: Path) -> str:
    entries = [e for e in report["checkpoints"] if e["step"] is not None]
    entries = entries or report["checkpoints"]
    steps = [e["step"] if e["step"] is not None else i for i, e in enumerate(entries)]
    panels = (("load_max_over_mean", "load max/mean (1 = balanced)"),
              ("router_entropy", "router entropy per token (nats)"),
              ("load_entropy", "entropy of the load (nats)"))
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6), constrained_layout=True)
    for ax, (key, title) in zip(axes, panels):
        for j, L in enumerate(entries[0]["layers"]):
            ax.plot(steps, [e["layers"][j][key] for e in entries], "o-", color=f"C{j}",
                    label=f"block {L['block']}")
        if key != "load_max_over_mean":
            ax.axhline(entries[0]["layers"][0]["max_entropy"], color="grey", lw=0.8, ls="--")
        ax.set_title(title)
        ax.set_xlabel("step")
    axes[0].legend(fontsize="small")
    fig.savefig(out / "router_vs_step.png", dpi=100)
    plt.close(fig)
    return "router_vs_step.png"


def plot_co_selection(report: dict, out: Path) -> str | None:
    if report["top_k"] < 2:
        return None
    layers = report["layers"]
    rows, cols = _grid(len(layers))
    fig, axes = plt.subplots(rows, cols, figsize=(3.4 * cols, 3.0 * rows), squeeze=False,
                             constrained_layout=True)
    for ax in axes.flat[len(layers):]:
        ax.axis("off")
    for ax, L in zip(axes.flat, layers):
        tokens = max(L["tokens"], 1)
        # The diagonal (each expert's own count) is left blank: it would set the scale.
        grid = [[c / tokens if i != j else float("nan") for j, c in enumerate(row)]
                for i, row in enumerate(L["co_selection"])]
        image = ax.imshow(grid, cmap="viridis", vmin=0.0, interpolation="nearest")
        fig.colorbar(image, ax=ax, shrink=0.8)
        ax.set_title(f"block {L['block']}: share picking both", fontsize="medium")
        ax.set_xlabel("expert")
        ax.set_ylabel("expert")
    fig.savefig(out / "router_co_selection.png", dpi=100)
    plt.close(fig)
    return "router_co_selection.png"


def plot_classes(report: dict, out: Path) -> str:
    layers = report["layers"]
    rows, cols = _grid(len(layers))
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 3.0 * rows), squeeze=False,
                             constrained_layout=True)
    for ax in axes.flat[len(layers):]:
        ax.axis("off")
    present = [c for c in CLASSES if c in layers[0]["experts"][0]["classes"]]
    for ax, L in zip(axes.flat, layers):
        grid = [[x["classes"][c]["lift"] for c in present] for x in L["experts"]]
        image = ax.imshow(grid, aspect="auto", cmap="coolwarm", vmin=0.0, vmax=2.0,
                          interpolation="nearest")
        ax.set_xticks(range(len(present)), present, rotation=45, ha="right", fontsize="small")
        ax.set_ylabel("expert")
        ax.set_title(f"block {L['block']}: class lift")
    fig.colorbar(image, ax=axes, label="lift (1 = as in the text)")
    fig.savefig(out / "router_classes.png", dpi=100)
    plt.close(fig)
    return "router_classes.png"


def plot_all(report: dict, out: Path) -> list[str]:
    """Every plot above into ``out``; the names written."""
    names = [plot_load(report, out), plot_vs_step(report, out), plot_co_selection(report, out),
             plot_classes(report, out)]
    return [n for n in names if n]
