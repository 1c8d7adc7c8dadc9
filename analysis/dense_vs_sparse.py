"""Dense vs Switch vs Mixtral at equal active parameters (``benchmarks/dense_vs_sparse.py``).

The study is a list of *arms*: a recipe plus fixed ``--set`` overrides, each run once per seed
by ``launch/sweep.py`` (``--grid train.seed=...``), so that every arm sees the same tokens in the
same order for a given seed index (``train.seed`` seeds both the sample order and the init).
This module names the arms, reads the runs' ``metrics.jsonl`` back and summarizes and plots
them; it runs nothing itself.

Per arm the summary holds the parameter counts and training FLOPs per token from the model's
own formulas (``TransformerConfig.num_params``, ``model.flops.train_flops_per_token``),
the final eval loss over seeds as a mean and a min-max spread, the mean tokens/s, and for MoE
arms the worst layer's max/mean expert load and the dropped fraction.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")                  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

from analysis import run_plots  # noqa: E402
from model.flops import train_flops_per_token  # noqa: E402
from training.config.recipe import load_recipe  # noqa: E402

RECIPES = {"dense": "recipes/tiny_dense.yaml", "switch": "recipes/tiny_switch.yaml",
           "mixtral": "recipes/tiny_mixtral.yaml"}
FIRST_SEED = 1234                      # the tiny recipes' train.seed; seed index i is 1234 + i
ACTIVE_TOLERANCE = 0.01                # the tiny recipes' stated match (tests/training/config/test_recipe.py)


@dataclass(frozen=True)
class Arm:
    """One configuration of the study: a family's recipe and the overrides that make it."""

    name: str
    family: str
    sets: tuple[str, ...] = field(default=())

    @property
    def recipe(self) -> str:
        return RECIPES[self.family]


# Each sweep: (what it shows, its arms). Top-1 vs top-2 keeps the active size: top-1 experts are
# twice as wide, and its single weight is the raw probability (renormalized it would be 1 and
# the router would get no gradient).
SWEEPS = {
    "capacity": ("Switch capacity factor: dropped fraction vs loss", [
        Arm(f"switch-cf{cf}", "switch", (f"model.moe.capacity_factor={cf}",)) for cf in (1.0, 1.25, 2.0)]),
    "top_k": ("top-1 vs top-2 at the same active size (Mixtral, dropless)", [
        Arm("mixtral-top1", "mixtral", ("model.moe.top_k=1", "model.ffn_hidden_size=256",
                                        "model.moe.normalize_top_k=false")),
        Arm("mixtral-top2", "mixtral")]),
    "experts": ("expert count at top-2 (Mixtral, dropless)", [
        Arm(f"mixtral-e{e}", "mixtral", (f"model.moe.num_experts={e}",)) for e in (4, 8, 16)]),
    "aux": ("aux-loss coefficient, 0 included (Mixtral, dropless): collapse", [
        Arm(f"mixtral-aux{c}", "mixtral", (f"model.moe.aux_loss_coef={c}",)) for c in (0.0, 0.01, 0.1)]),
}


def family_arms(families: list[str]) -> list[Arm]:
    """The main comparison's arms; ValueError (one line) naming an unknown family."""
    for family in families:
        if family not in RECIPES:
            raise ValueError(f"--families: unknown family {family!r} (choose from {', '.join(RECIPES)})")
    return [Arm(family, family) for family in families]


def sweep_arms(names: list[str]) -> dict[str, list[Arm]]:
    """{sweep: arms}; ValueError (one line) naming an unknown sweep."""
    for name in names:
        if name not in SWEEPS:
            raise ValueError(f"--sweeps: unknown sweep {name!r} (choose from {', '.join(SWEEPS)})")
    return {name: SWEEPS[name][1] for name in names}


def seeds(count: int) -> list[int]:
    return [FIRST_SEED + i for i in range(count)]


def model_facts(arm: Arm, sets: list[str]) -> dict:
    """Parameter counts and training FLOPs per token of the arm's model (with ``sets`` applied)."""
    recipe = load_recipe(arm.recipe, [*sets, *arm.sets])
    cfg = recipe.model
    return {"active_params": cfg.num_params(active=True), "total_params": cfg.num_params(),
            "flops_per_token": train_flops_per_token(cfg, recipe.seq_len), "seq_len": recipe.seq_len}


def curve(run_dir: Path) -> dict:
    """One run's eval curve against tokens seen (eval rows carry only the step: the tokens come
    from the training row of that step) and its router statistics."""
    train, evals = run_plots.read_metrics(run_dir)
    tokens = {r["step"]: r["tokens"] for r in train}
    moe = [r for r in train if "expert_load_max_over_mean" in r]
    return {"steps": [r["step"] for r in evals], "tokens": [tokens[r["step"]] for r in evals],
            "eval_loss": [r["eval_loss"] for r in evals],
            "final_loss": train[-1]["loss"],
            "tokens_per_s": sum(r["tokens_per_s"] for r in train) / len(train),
            "load_steps": [r["step"] for r in moe],
            "load_max_over_mean": [r["expert_load_max_over_mean"] for r in moe],
            "dropped_frac": [r.get("dropped_frac", 0.0) for r in moe]}


def _stat(values: list[float]) -> dict:
    return {"mean": sum(values) / len(values), "spread": max(values) - min(values),
            "spread_kind": "max - min over seeds", "min": min(values), "max": max(values),
            "per_seed": values}


def summarize(arm: Arm, facts: dict, curves: list[dict]) -> dict:
    """The arm's row of ``results.json``: final eval loss over seeds (mean, min-max spread),
    mean tokens/s, and for MoE arms the worst layer's final max/mean load, its peak over the
    run, and the dropped fraction averaged over the run's steps."""
    row = {"family": arm.family, "arm": arm.name, "recipe": arm.recipe, "settings": list(arm.sets),
           **facts, "seeds": len(curves), "steps": curves[0]["steps"][-1],
           "tokens": curves[0]["tokens"][-1],
           "train_flops": curves[0]["tokens"][-1] * facts["flops_per_token"],
           "eval_loss": _stat([c["eval_loss"][-1] for c in curves]),
           "final_train_loss": _stat([c["final_loss"] for c in curves]),
           "tokens_per_s": sum(c["tokens_per_s"] for c in curves) / len(curves)}
    if curves[0]["load_max_over_mean"]:
        row["load_max_over_mean_final"] = _stat([c["load_max_over_mean"][-1] for c in curves])
        row["load_max_over_mean_peak"] = _stat([max(c["load_max_over_mean"]) for c in curves])
        row["dropped_frac"] = _stat([sum(c["dropped_frac"]) / len(c["dropped_frac"]) for c in curves])
    return row


def table(rows: list[dict]) -> str:
    """Markdown table of summary rows, in the numbers ``results.json`` holds."""
    lines = ["| arm | active params | total params | train FLOPs/token | eval loss (mean) | "
             "spread (max-min) | tokens/s | load max/mean (final) | dropped |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        load = r.get("load_max_over_mean_final")
        drop = r.get("dropped_frac")
        lines.append(f"| {r['arm']} | {r['active_params']:,} | {r['total_params']:,} | "
                     f"{r['flops_per_token']:.4g} | {r['eval_loss']['mean']:.4f} | "
                     f"{r['eval_loss']['spread']:.4f} | {r['tokens_per_s']:,.0f} | "
                     f"{'-' if load is None else format(load['mean'], '.2f')} | "
                     f"{'-' if drop is None else format(drop['mean'], '.3f')} |")
    return "\n".join(lines) + "\n"


def plot_eval(runs: dict[str, tuple[dict, list[dict]]], out: Path) -> dict:
    """``eval_loss_vs_tokens.png`` and ``eval_loss_vs_flops.png``: one colour per arm, the seeds'
    mean as a line and each seed as points; returns {x axis: {arm: (xs, mean ys)}} as drawn."""
    drawn: dict = {"tokens": {}, "flops": {}}
    for axis, label in (("tokens", "tokens seen"), ("flops", "training FLOPs (train_flops_per_token x tokens)")):
        fig, ax = plt.subplots(figsize=(7, 4.5), constrained_layout=True)
        for i, (name, (facts, curves)) in enumerate(runs.items()):
            scale = facts["flops_per_token"] if axis == "flops" else 1
            n = min(len(c["tokens"]) for c in curves)
            xs = [t * scale for t in curves[0]["tokens"][:n]]
            mean = [sum(c["eval_loss"][j] for c in curves) / len(curves) for j in range(n)]
            ax.plot(xs, mean, color=f"C{i}", label=f"{name} ({len(curves)} seeds)")
            for c in curves:
                ax.plot([t * scale for t in c["tokens"][:n]], c["eval_loss"][:n], ".", color=f"C{i}", alpha=0.6)
            drawn[axis][name] = (xs, mean)
        ax.set_xlabel(label)
        ax.set_ylabel("eval loss")
        ax.set_title(f"eval loss against {label.split(' (')[0]}")
        ax.legend()
        fig.savefig(out / f"eval_loss_vs_{axis}.png", dpi=100)
        plt.close(fig)
    return drawn


def plot_sweep(name: str, rows: list[dict], curves: dict[str, list[dict]], out: Path) -> dict:
    """``sweep_<name>.png``: final eval loss against the router statistic the sweep moves (the
    dropped fraction for capacity, else the worst layer's final max/mean load), one point per
    seed, and that statistic against the step (first seed); returns the points drawn."""
    key = "dropped_frac" if name == "capacity" else "load_max_over_mean"
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    drawn = {}
    for i, row in enumerate(rows):
        runs = curves[row["arm"]]
        xs = [sum(c[key]) / len(c[key]) if key == "dropped_frac" else c[key][-1] for c in runs]
        ys = [c["eval_loss"][-1] for c in runs]
        left.plot(xs, ys, "o", color=f"C{i}", label=row["arm"])
        right.plot(runs[0]["load_steps"], runs[0][key], color=f"C{i}", label=row["arm"])
        drawn[row["arm"]] = (xs, ys)
    left.set_xlabel("mean dropped fraction" if key == "dropped_frac" else "worst layer max/mean load (final)")
    left.set_ylabel("final eval loss")
    left.set_title(SWEEPS[name][0])
    left.legend(fontsize="small")
    right.set_xlabel("step")
    right.set_ylabel("dropped fraction" if key == "dropped_frac" else "worst layer max/mean load")
    if key != "dropped_frac":
        right.axhline(1.0, color="grey", lw=0.8, ls="--")
    fig.savefig(out / f"sweep_{name}.png", dpi=100)
    plt.close(fig)
    return drawn
