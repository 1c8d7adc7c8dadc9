"""Plots of one or several runs from their ``metrics.jsonl`` (``launch/plot_run.py``).

- ``training.png``: loss (lines) and eval loss (markers), learning rate, gradient norm and
  tokens/s against the optimizer step; one colour per run.
- ``moe_balance.png`` (MoE runs): the worst layer's max/mean expert load and the dropped
  fraction against the step, one colour per run; with an expert bias (loss-free balancing)
  also the spread of the biases (``expert_bias_range``).
- ``moe_load_<run>.png`` (MoE runs): per MoE layer, a heatmap of each expert's share of the
  layer's routed tokens times the number of experts (1.0 = an even share), expert x step, from
  the rows that carry ``moe_layers`` (every ``train.log_every`` steps).
- ``grad_norm_layers_<run>.png``: the gradient norm of the embedding, each block and the head
  against the step (log scale), from the rows that carry ``grad_norm_layers`` (every
  ``train.log_every`` steps and every spike); spikes marked. A spike's layer is the line that
  jumps (docs/stability.md, "Debugging a spike").

Each function returns the numbers it drew, so that tests can check the plot's data.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")                  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

TRAINING_PANELS = (("loss", "loss (train lines, eval markers)"), ("lr", "learning rate"),
                   ("grad_norm", "gradient norm"), ("tokens_per_s", "tokens/s"))


def read_metrics(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """(training rows, evaluation rows) of ``run_dir/metrics.jsonl``; ValueError (one line)
    when the file is missing, unreadable or holds no training step."""
    path = Path(run_dir) / "metrics.jsonl"
    if not Path(run_dir).is_dir():
        raise ValueError(f"--run-dir {run_dir}: no such directory")
    if not path.is_file():
        raise ValueError(f"--run-dir {run_dir}: no metrics.jsonl (is this a run directory made by "
                         f"launch/train.py, and has it finished a step?)")
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: line {number} is not JSON ({err.msg}); a run killed while "
                             f"writing leaves a partial last line: delete it") from None
    train = [r for r in rows if "loss" in r]
    if not train:
        raise ValueError(f"{path}: no training step logged yet")
    return train, [r for r in rows if "eval_loss" in r]


def plot_training(runs: dict[str, tuple[list[dict], list[dict]]], out: Path) -> dict:
    """``training.png``; returns {panel: {run: (steps, values)}} as drawn."""
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), constrained_layout=True)
    drawn: dict = {key: {} for key, _ in TRAINING_PANELS}
    for ax, (key, title) in zip(axes.flat, TRAINING_PANELS):
        for i, (name, (train, evals)) in enumerate(runs.items()):
            points = [(r["step"], r[key]) for r in train if r.get(key) is not None]
            if not points:
                continue
            steps, values = map(list, zip(*points))
            ax.plot(steps, values, color=f"C{i}", label=name)
            drawn[key][name] = (steps, values)
            if key == "loss" and evals:
                ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o",
                        color=f"C{i}", label=f"{name} eval")
        ax.set_title(title)
        ax.set_xlabel("step")
        if key == "grad_norm" and all(v > 0 for _, vs in drawn[key].values() for v in vs):
            ax.set_yscale("log")
    axes.flat[0].legend(fontsize="small")
    fig.savefig(out / "training.png", dpi=100)
    plt.close(fig)
    return drawn


def plot_moe_balance(runs: dict[str, tuple[list[dict], list[dict]]], out: Path) -> dict:
    """``moe_balance.png`` for the runs that logged router statistics; returns what was drawn
    ({} when no run is an MoE run, and nothing is written)."""
    keys = (("expert_load_max_over_mean", "max/mean expert load (worst layer; 1 = balanced)"),
            ("dropped_frac", "dropped fraction of routed assignments"))
    moe = {name: train for name, (train, _) in runs.items()
           if any("expert_load_max_over_mean" in r for r in train)}
    if not moe:
        return {}
    if any("expert_bias_range" in r for train in moe.values() for r in train):
        keys += (("expert_bias_range", "expert bias spread, max - min (widest layer)"),)
    fig, axes = plt.subplots(1, len(keys), figsize=(5.5 * len(keys), 3.8), constrained_layout=True)
    drawn: dict = {key: {} for key, _ in keys}
    for ax, (key, title) in zip(axes, keys):
        for i, (name, train) in enumerate(moe.items()):
            steps = [r["step"] for r in train if key in r]
            values = [r[key] for r in train if key in r]
            ax.plot(steps, values, color=f"C{i}", label=name)
            drawn[key][name] = (steps, values)
        ax.set_title(title)
        ax.set_xlabel("step")
    axes[0].axhline(1.0, color="grey", lw=0.8, ls="--")
    axes[0].legend(fontsize="small")
    fig.savefig(out / "moe_balance.png", dpi=100)
    plt.close(fig)
    return drawn


def load_shares(train: list[dict]) -> tuple[list[int], list[int], list[list[list[float]]]]:
    """(steps, blocks, shares[layer][expert][step]): each expert's share of its layer's routed
    assignments times the number of experts, at every row that carries ``moe_layers``."""
    rows = [r for r in train if "moe_layers" in r]
    if not rows:
        return [], [], []
    blocks = rows[0]["moe_layers"]["blocks"]
    shares = []
    for layer in range(len(blocks)):
        per_step = []
        for r in rows:
            counts = r["moe_layers"]["tokens_per_expert"][layer]
            total = sum(counts) or 1
            per_step.append([c * len(counts) / total for c in counts])
        shares.append([list(col) for col in zip(*per_step)])       # expert x step
    return [r["step"] for r in rows], blocks, shares


def plot_moe_load(name: str, train: list[dict], out: Path) -> dict:
    """``moe_load_<name>.png``; returns {"steps", "blocks", "shares"} ({} without router rows)."""
    steps, blocks, shares = load_shares(train)
    if not steps:
        return {}
    cols = min(len(blocks), 4)
    rows = -(-len(blocks) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 2.8 * rows), squeeze=False,
                             constrained_layout=True)
    for ax in axes.flat[len(blocks):]:
        ax.axis("off")
    for ax, block, grid in zip(axes.flat, blocks, shares):
        image = ax.imshow(grid, aspect="auto", cmap="coolwarm", vmin=0.0, vmax=2.0,
                          extent=(steps[0] - 0.5, steps[-1] + 0.5, len(grid) - 0.5, -0.5),
                          interpolation="nearest")
        ax.set_title(f"block {block}")
        ax.set_xlabel("step")
        ax.set_ylabel("expert")
    fig.colorbar(image, ax=axes, label="share of tokens x experts (1 = even)")
    fig.savefig(out / f"moe_load_{name}.png", dpi=100)
    plt.close(fig)
    return {"steps": steps, "blocks": blocks, "shares": shares}


def layer_grad_norms(train: list[dict]) -> tuple[list[int], dict[str, list[float]]]:
    """(steps, {"embed" | "block<i>" | "head": norm at each step}) from the rows that carry
    ``grad_norm_layers``."""
    rows = [r for r in train if "grad_norm_layers" in r]
    series: dict[str, list[float]] = {}
    for r in rows:
        f = r["grad_norm_layers"]
        for name, v in [("embed", f["embed"]), *((f"block{i}", b) for i, b in enumerate(f["blocks"])),
                        ("head", f["head"])]:
            series.setdefault(name, []).append(v)
    return [r["step"] for r in rows], series


def plot_layer_grad_norms(name: str, train: list[dict], out: Path) -> dict:
    """``grad_norm_layers_<name>.png``; returns {"steps", "series", "spikes"} ({} without such
    rows). Spikes: the steps flagged ``spike`` or ``grad_spike``."""
    steps, series = layer_grad_norms(train)
    if not steps:
        return {}
    spikes = [r["step"] for r in train if r.get("spike") or r.get("grad_spike")]
    fig, ax = plt.subplots(figsize=(8, 4), constrained_layout=True)
    cmap = plt.get_cmap("viridis")
    for i, (label, values) in enumerate(series.items()):
        ax.plot(steps, values, label=label, color=cmap(i / max(len(series) - 1, 1)), marker=".")
    for s in spikes:
        ax.axvline(s, color="red", alpha=0.3)
    if all(v > 0 for vs in series.values() for v in vs):
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("gradient norm")
    ax.set_title(f"{name}: gradient norm per layer (red: spikes)")
    ax.legend(fontsize=7, ncol=2)
    fig.savefig(out / f"grad_norm_layers_{name}.png", dpi=100)
    plt.close(fig)
    return {"steps": steps, "series": series, "spikes": spikes}
