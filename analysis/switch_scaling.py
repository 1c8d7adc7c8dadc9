"""Switch scaling with the expert count, and expert placement over ep ranks
(``benchmarks/studies/switch_scaling.py``).

Two questions, each answered from runs' ``metrics.jsonl`` (this module runs nothing):

- **Scaling with E.** Tiny Switch at 1 (dense), 2, 4, ... experts, top-1, each expert the same
  size, so every arm does the same FLOPs per token (E only adds parameters). Per E: the eval
  loss against steps and against training wall time (the sum of the rows' ``step_time_s``, eval
  and start-up excluded), the median step time, over seeds. ``analysis/dense_vs_sparse.py``
  reads the eval curves and summarizes each arm; this module adds the clock.
- **Placement.** Which experts an ep rank holds (``model/parallel/groups.py``'s
  ``local_experts``: ``contiguous`` or ``round_robin``) decides each rank's routed load: the
  sum of its experts' ``tokens_per_expert``. The busiest rank sets the step, so the figure of
  merit is max/mean of the per-rank loads, per step and MoE layer. Beside the two placements:
  the same figure for random balanced placements (E/ep experts per rank; the band a placement
  that ignores the router lands in) and for a load-aware placement fitted on earlier steps'
  counts and scored on later ones (``balanced_placement``).
"""

from __future__ import annotations

import random
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")                  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

from analysis import dense_vs_sparse as dvs  # noqa: E402
from analysis import run_plots  # noqa: E402
from model.parallel.groups import ParallelGroups, local_experts  # noqa: E402

PLACEMENTS = ("contiguous", "round_robin")
WARMUP_STEPS = 10          # steps left out of the median step time (allocator and cache warm-up)
RANDOM_DRAWS = 1000        # random balanced placements per (E, ep)


# -- placement ---------------------------------------------------------------------------------

def placement(num_experts: int, ep: int, kind: str) -> list[list[int]]:
    """Global expert ids held by each ep rank, from the trainer's own ``local_experts``;
    ValueError (one line) when ep does not divide E."""
    return [local_experts(num_experts, ParallelGroups(ep=ep, ep_rank=r, expert_placement=kind))
            for r in range(ep)]


def rank_loads(counts: list[float], ranks: list[list[int]]) -> list[float]:
    """Routed assignments per ep rank: the sum of its experts' counts."""
    return [sum(counts[e] for e in experts) for experts in ranks]


def max_over_mean(loads: list[float]) -> float:
    """The busiest rank's load over the mean (1.0 = even; ep = one rank takes everything)."""
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean else 1.0


def balanced_placement(counts: list[float], ep: int) -> list[list[int]]:
    """A load-aware placement: experts by ``counts`` descending, each to the least-loaded rank
    that still has room for E/ep (longest-processing-time first under a cardinality limit).
    Hand-written: a dozen lines, where an optimal partition solver would be a dependency for a
    bound this greedy already comes within a few percent of at these sizes."""
    per = len(counts) // ep
    ranks: list[list[int]] = [[] for _ in range(ep)]
    loads = [0.0] * ep
    for e in sorted(range(len(counts)), key=lambda i: -counts[i]):
        r = min((r for r in range(ep) if len(ranks[r]) < per), key=lambda r: loads[r])
        ranks[r].append(e)
        loads[r] += counts[e]
    return [sorted(experts) for experts in ranks]


def _mean_imbalance(rows: list[list[float]], ranks: list[list[int]]) -> float:
    return statistics.mean(max_over_mean(rank_loads(c, ranks)) for c in rows)


def placement_study(fit: list[list[float]], score: list[list[float]], ep: int,
                    draws: int = RANDOM_DRAWS, seed: int = 0) -> dict:
    """Per-rank routed load of each placement at ``ep``, scored on ``score`` (one count vector
    per step and MoE layer: the trained router). ``fit`` (earlier rows of the same run) is what
    the load-aware placement sees. Returns, each as the mean over the scored rows of max/mean:
    ``contiguous``, ``round_robin``, ``load_aware``, ``random`` ({mean, p05, p95} over
    ``draws`` random balanced placements), and ``aggregate`` (max/mean of the placements'
    rank loads on the scored counts summed over rows: the persistent part of the imbalance)."""
    E = len(score[0])
    named = {kind: placement(E, ep, kind) for kind in PLACEMENTS}
    named["load_aware"] = balanced_placement([sum(col) for col in zip(*fit)], ep)
    rng = random.Random(seed)
    ids = list(range(E))
    sampled = []
    for _ in range(draws):
        rng.shuffle(ids)
        sampled.append(_mean_imbalance(score, [ids[r::ep] for r in range(ep)]))
    sampled.sort()
    total = [sum(col) for col in zip(*score)]
    return {**{k: _mean_imbalance(score, ranks) for k, ranks in named.items()},
            "random": {"mean": statistics.mean(sampled), "p05": sampled[int(0.05 * (draws - 1))],
                       "p95": sampled[int(0.95 * (draws - 1))], "draws": draws},
            "aggregate": {k: max_over_mean(rank_loads(total, ranks)) for k, ranks in named.items()},
            "ranks": named}


def routed_counts(run_dir: Path) -> list[tuple[int, list[list[int]]]]:
    """(step, tokens_per_expert per MoE layer) of every row that carries ``moe_layers``."""
    train, _ = run_plots.read_metrics(run_dir)
    return [(r["step"], r["moe_layers"]["tokens_per_expert"]) for r in train if "moe_layers" in r]


def split_counts(rows: list[tuple[int, list[list[int]]]], steps: int) -> tuple[list, list]:
    """The count vectors (one per row and layer) of the first half of the run (fit) and of the
    second (score: the trained router)."""
    fit = [c for step, layers in rows if step <= steps // 2 for c in layers]
    score = [c for step, layers in rows if step > steps // 2 for c in layers]
    return fit, score


# -- rows per expert ---------------------------------------------------------------------------

def rows_per_expert(tokens: int, top_k: int, capacity_factor: float | None, num_experts: int) -> float:
    """Rows each expert's GEMM gets per micro-batch: tokens x k x capacity / E (with capacity,
    the slots; dropless, the mean under even routing)."""
    return tokens * top_k * (capacity_factor or 1.0) / num_experts


def gemm_intensity(rows: float, hidden: int, ffn: int, bytes_per_element: int = 2) -> float:
    """FLOPs per byte moved of one expert projection, (rows x hidden) @ (hidden x ffn): 2*M*h*f
    over each operand and the output read or written once. For rows << hidden, ffn it is about
    ``rows``: the weight dominates the bytes, and each weight byte serves only M rows."""
    moved = bytes_per_element * (rows * hidden + hidden * ffn + rows * ffn)
    return 2 * rows * hidden * ffn / moved


# -- scaling with E ----------------------------------------------------------------------------

def clock(run_dir: Path) -> dict:
    """One run's step times: the training wall time at each eval step (the running sum of
    ``step_time_s``), and after ``WARMUP_STEPS`` the median and the fastest decile (10th
    percentile: other jobs on a shared machine only ever add time, so it is the steadier)."""
    train, evals = run_plots.read_metrics(run_dir)
    elapsed, at = 0.0, {}
    for r in train:
        elapsed += r["step_time_s"]
        at[r["step"]] = elapsed
    steady = [r["step_time_s"] for r in train if r["step"] > WARMUP_STEPS] or [train[-1]["step_time_s"]]
    decile = sorted(steady)[int(0.1 * (len(steady) - 1))]
    return {"eval_wall_s": [at[r["step"]] for r in evals], "train_wall_s": elapsed,
            "median_step_s": statistics.median(steady), "fast_step_s": decile}


def _stat(values: list[float]) -> dict:
    return {"mean": statistics.mean(values), "spread": max(values) - min(values),
            "spread_kind": "max - min over seeds", "per_seed": values}


def summarize_e(num_experts: int, facts: dict, run_dirs: list[Path]) -> dict:
    """One expert count's row: ``analysis/dense_vs_sparse.py``'s summary of the arm (eval loss
    over seeds, parameters, FLOPs per token, load, drops) plus its eval curve (mean over seeds),
    the training wall time at each eval (measured, and ``eval_wall_s_fast``: steps x the
    fastest-decile step time, which other jobs inflate least), and the step times."""
    curves = [dvs.curve(d) for d in run_dirs]
    clocks = [clock(d) for d in run_dirs]
    arm = dvs.Arm(f"switch-e{num_experts}", "switch", (f"model.moe.num_experts={num_experts}",))
    n = min(len(c["steps"]) for c in curves)
    row = dvs.summarize(arm, facts, curves)
    fast = statistics.mean(k["fast_step_s"] for k in clocks)
    return {"num_experts": num_experts, **row,
            "params_per_expert": facts.get("params_per_expert"),
            "eval_steps": curves[0]["steps"][:n],
            "eval_loss_curve": [statistics.mean(c["eval_loss"][j] for c in curves) for j in range(n)],
            "eval_wall_s": [statistics.mean(k["eval_wall_s"][j] for k in clocks) for j in range(n)],
            "eval_wall_s_fast": [step * fast for step in curves[0]["steps"][:n]],
            "train_wall_s": _stat([k["train_wall_s"] for k in clocks]),
            "median_step_s": _stat([k["median_step_s"] for k in clocks]),
            "fast_step_s": _stat([k["fast_step_s"] for k in clocks])}


def scaling_table(rows: list[dict]) -> str:
    """Markdown: one line per E, in the numbers the JSON holds."""
    dense = rows[0]["eval_loss"]["mean"] if rows and rows[0]["num_experts"] == 1 else None
    lines = ["| E | total params | active params | eval loss (mean) | spread | vs E=1 | "
             "step s (fastest decile / median) | load max/mean | dropped |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        d = "-" if dense is None else f"{r['eval_loss']['mean'] - dense:+.4f}"
        load, drop = r.get("load_max_over_mean_final"), r.get("dropped_frac")
        lines.append(f"| {r['num_experts']} | {r['total_params']:,} | {r['active_params']:,} | "
                     f"{r['eval_loss']['mean']:.4f} | {r['eval_loss']['spread']:.4f} | {d} | "
                     f"{r['fast_step_s']['mean']:.3f} / {r['median_step_s']['mean']:.3f} | "
                     f"{'-' if load is None else format(load['mean'], '.2f')} | "
                     f"{'-' if drop is None else format(drop['mean'], '.3f')} |")
    return "\n".join(lines) + "\n"


def placement_table(placements: dict) -> str:
    """Markdown: per (E, ep), mean per-step max/mean rank load of each placement."""
    lines = ["| E | ep | contiguous | round-robin | random (5-95%) | load-aware | "
             "aggregate contiguous / round-robin |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for E, by_ep in placements.items():
        for ep, p in by_ep.items():
            lines.append(f"| {E} | {ep} | {p['contiguous']:.3f} | {p['round_robin']:.3f} | "
                         f"{p['random']['mean']:.3f} ({p['random']['p05']:.3f}-{p['random']['p95']:.3f}) | "
                         f"{p['load_aware']:.3f} | {p['aggregate']['contiguous']:.3f} / "
                         f"{p['aggregate']['round_robin']:.3f} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], placements: dict, path: Path, title: str) -> None:
    """Four panels: eval loss vs step and vs training wall time (one colour per E), final eval
    loss vs E (each seed a point), median step time vs E; and per-rank load max/mean of each
    placement per (E, ep) in a second file ``<stem>_placement.png``."""
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.4), constrained_layout=True)
    colours = plt.cm.viridis([i / max(len(rows) - 1, 1) for i in range(len(rows))])
    for colour, r in zip(colours, rows):
        label = f"E={r['num_experts']}" + (" (dense)" if r["num_experts"] == 1 else "")
        axes[0].plot(r["eval_steps"], r["eval_loss_curve"], "o-", ms=3, color=colour, label=label)
        axes[1].plot(r["eval_wall_s_fast"], r["eval_loss_curve"], "o-", ms=3, color=colour, label=label)
    es = [r["num_experts"] for r in rows]
    for r in rows:
        axes[2].plot([r["num_experts"]] * len(r["eval_loss"]["per_seed"]), r["eval_loss"]["per_seed"],
                     "o", color="C0", alpha=0.6)
        axes[3].plot([r["num_experts"]] * len(r["fast_step_s"]["per_seed"]),
                     r["fast_step_s"]["per_seed"], "o", color="C1", alpha=0.6)
    axes[2].plot(es, [r["eval_loss"]["mean"] for r in rows], "-", color="C0")
    axes[3].plot(es, [r["fast_step_s"]["mean"] for r in rows], "-", color="C1", label="fastest decile")
    axes[3].plot(es, [r["median_step_s"]["mean"] for r in rows], "--", color="grey", label="median")
    axes[3].legend(fontsize=8)
    for ax, xl, yl, t in ((axes[0], "step", "eval loss", "eval loss vs step"),
                          (axes[1], "training time, s (step x fastest-decile step time)", "eval loss",
                           "eval loss vs wall time"),
                          (axes[2], "experts E (top-1, same expert size)", "final eval loss",
                           "final eval loss vs E (points: seeds)"),
                          (axes[3], "experts E", "step time, s", "step time vs E (points: seeds)")):
        ax.set_xlabel(xl)
        ax.set_ylabel(yl)
        ax.set_title(t, fontsize=10)
    for ax in axes[2:]:
        ax.set_xscale("log", base=2)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    if not placements:
        return
    fig, axes = plt.subplots(1, len(placements), figsize=(5.5 * len(placements), 4),
                             constrained_layout=True, squeeze=False)
    for ax, (E, by_ep) in zip(axes[0], placements.items()):
        eps = list(by_ep)
        x = range(len(eps))
        ax.fill_between(x, [by_ep[e]["random"]["p05"] for e in eps], [by_ep[e]["random"]["p95"] for e in eps],
                        color="grey", alpha=0.3, label="random placements, 5-95%")
        for kind, marker in (("contiguous", "o-"), ("round_robin", "s--"), ("load_aware", "^:")):
            ax.plot(x, [by_ep[e][kind] for e in eps], marker, label=kind.replace("_", "-"))
        ax.set_xticks(list(x), [str(e) for e in eps])
        ax.set_xlabel("ep (ranks)")
        ax.set_ylabel("busiest rank / mean, per step (mean)")
        ax.set_title(f"E={E}: busiest ep rank vs the mean", fontsize=10)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.legend(fontsize=8)
    fig.savefig(path.with_name(path.stem + "_placement.png"), dpi=100)
    plt.close(fig)


def check_placement_args(experts: list[int], placement_experts: list[int], eps: list[int]) -> None:
    """ValueError (one line, naming the flag and the fix) for placement settings that cannot be
    computed: an E not in the study, or an ep that does not divide it."""
    for E in placement_experts:
        if E not in experts:
            raise ValueError(f"--placement-experts {E}: not among --experts "
                             f"({','.join(map(str, experts))}); add it there or drop it here")
        for ep in eps:
            if ep < 2 or E % ep:
                raise ValueError(f"--placement-ep {ep}: must be >= 2 and divide every --placement-experts "
                                 f"(E={E}: num_experts % expert_parallel_size must be 0)")

