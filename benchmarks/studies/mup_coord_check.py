"""muP coordinate check and learning-rate sweep: standard (SP) vs maximal-update (muP) parametrization.

Hardware: any CPU (results in docs/studies/mup.md are from a shared 2-core CPU, one thread).
Launch:   python -m benchmarks.studies.mup_coord_check              # coordinate check
          python -m benchmarks.studies.mup_coord_check --lr-sweep   # lr sweep
          python -m benchmarks.studies.mup_coord_check --out DIR    # the JSON and the PNG both in DIR

The JSON goes to ``--results`` (default ``benchmarks/studies/results/``), the PNG to ``--figures``
(default ``docs/studies/img/``).

Both modes train our ``Transformer`` in process (no DeepSpeed): a dense model of 2 blocks with 4
heads (so the head width grows with the model width and the attention scale matters), byte-level
tokens (vocab 256) of the embedded corpus (this Python's standard library, ``data_pipeline/sources.py``),
plain ``torch.optim.AdamW`` over the param groups the trainer builds (``training.optim.optimizers.param_groups``
and ``apply_group_lr_scales``: muP's hidden matrices at lr / m), constant lr, no weight decay.
muP runs use ``mup_base_hidden_size`` = the smallest width, so at that width the two differ only in
the attention scale (1/d vs 1/sqrt(d)).

Coordinate check (Yang et al. 2022, Fig. 5): at each width, the mean |x| of the embeddings'
output, the middle block's attention and MLP outputs, and the logits, in each of the first
``--steps`` forward passes (pass t sees the weights after t-1 updates). Under muP every curve is
flat in width; under SP the logits and the attention/MLP outputs grow with it after the first
update. Writes ``mup_coord_check.json`` and ``mup_coord_check.png``.

LR sweep: final training loss (mean of the last 10 steps) per (parametrization, width, lr); under
muP the best lr stays put as the width grows, under SP it moves. Writes ``mup_lr_sweep.json``
and ``mup_lr_sweep.png`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks import add_output_args, output_dirs
from model.config import DenseConfig
from model.transformer import Transformer
from data_pipeline.sources import stdlib_files
from training.optim import optimizers

QUANTITIES = ("embedding", "attention", "mlp", "logits")


def corpus_bytes(max_bytes: int = 2_000_000) -> torch.Tensor:
    """Bytes of the embedded corpus (standard-library sources, in key order) as token ids."""
    out, total = [], 0
    for path, _key in stdlib_files():                      # in key order
        data = path.read_bytes()
        out.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return torch.frombuffer(bytearray(b"".join(out)[:max_bytes]), dtype=torch.uint8).long()


def batches(tokens: torch.Tensor, steps: int, batch: int, seq: int, seed: int):
    """``steps`` (input_ids, labels) batches of random windows, the same for every run."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, len(tokens) - seq - 1, (batch,), generator=g)
        win = torch.stack([tokens[s:s + seq + 1] for s in starts.tolist()])       # (B, S+1)
        yield win[:, :-1], win[:, 1:]


def model_config(width: int, mup: bool, base: int, layers: int = 2) -> DenseConfig:
    return DenseConfig(vocab_size=256, hidden_size=width, num_layers=layers, num_heads=4,
                       num_kv_heads=4, ffn_hidden_size=2 * width, max_seq_len=256,
                       mup_base_hidden_size=base if mup else None).validate()


def build(cfg: DenseConfig, lr: float, seed: int):
    """The model and an AdamW over the trainer's param groups (muP: hidden group at lr / m)."""
    model = Transformer(cfg, init_seed=seed)
    groups = optimizers.param_groups(model, 0.0, cfg)
    optimizers.apply_group_lr_scales({"optimizer": {"params": {"lr": lr}}}, groups)
    opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    return model, opt


def coord_check(width: int, mup: bool, base: int, steps: int, lr: float, seed: int,
                tokens: torch.Tensor, batch: int = 8, seq: int = 64) -> dict[str, list[float]]:
    """Mean |x| of each of ``QUANTITIES`` in forward passes 1..steps at one width."""
    cfg = model_config(width, mup, base)
    model, opt = build(cfg, lr, seed)
    mid = model.layers[cfg.num_layers // 2]
    seen: dict[str, float] = {}

    def record(name):
        return lambda _m, _i, out: seen.__setitem__(name, out.detach().abs().mean().item())
    hooks = [model.embed_tokens.register_forward_hook(record("embedding")),
             mid.self_attn.register_forward_hook(record("attention")),
             mid.mlp.register_forward_hook(record("mlp"))]
    stats = {q: [] for q in QUANTITIES}
    for x, y in batches(tokens, steps, batch, seq, seed):
        out = model(x, y)
        seen["logits"] = out.logits.detach().abs().mean().item()
        for q in QUANTITIES:
            stats[q].append(seen[q])
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        opt.step()
    for h in hooks:
        h.remove()
    return stats


def train_loss(width: int, mup: bool, base: int, lr: float, steps: int, seed: int,
               tokens: torch.Tensor, batch: int = 16, seq: int = 64) -> float:
    """Mean training loss of the last 10 steps (inf when it diverged)."""
    model, opt = build(model_config(width, mup, base), lr, seed)
    losses = []
    for x, y in batches(tokens, steps, batch, seq, seed):
        loss = model(x, y).loss
        if not torch.isfinite(loss):
            return float("inf")
        losses.append(loss.item())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    tail = losses[-10:]
    return sum(tail) / len(tail)


def run_coord_check(args, tokens) -> dict:
    result = {"widths": args.widths, "steps": args.steps, "lr": args.lr, "seeds": args.seeds}
    for name, mup in (("sp", False), ("mup", True)):
        per_width = []
        for w in args.widths:
            runs = [coord_check(w, mup, args.widths[0], args.steps, args.lr, s, tokens)
                    for s in range(args.seeds)]
            per_width.append({q: [sum(r[q][t] for r in runs) / len(runs) for t in range(args.steps)]
                              for q in QUANTITIES})
            print(f"{name} width {w}: " + ", ".join(
                f"{q} {per_width[-1][q][0]:.3g}->{per_width[-1][q][-1]:.3g}" for q in QUANTITIES), flush=True)
        result[name] = per_width
    return result


def plot_coord_check(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    widths, steps = result["widths"], result["steps"]
    fig, axes = plt.subplots(2, len(QUANTITIES), figsize=(4 * len(QUANTITIES), 7), sharex=True)
    cmap = plt.get_cmap("viridis")
    for row, name in enumerate(("sp", "mup")):
        for col, q in enumerate(QUANTITIES):
            ax = axes[row][col]
            for t in range(steps):
                ax.plot(widths, [result[name][i][q][t] for i in range(len(widths))], marker="o",
                        color=cmap(t / max(steps - 1, 1)), label=f"step {t + 1}")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{'SP' if name == 'sp' else 'muP'}: {q}")
            if row == 1:
                ax.set_xlabel("width (hidden_size)")
            if col == 0:
                ax.set_ylabel("mean |x|")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"Coordinate check: AdamW lr {result['lr']}, mean over {result['seeds']} seeds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run_lr_sweep(args, tokens) -> dict:
    result = {"widths": args.sweep_widths, "lrs": args.lrs, "steps": args.sweep_steps,
              "batch": args.sweep_batch}
    for name, mup in (("sp", False), ("mup", True)):
        result[name] = {}
        for w in args.sweep_widths:
            losses = [train_loss(w, mup, args.sweep_widths[0], lr, args.sweep_steps, 0, tokens,
                                 batch=args.sweep_batch)
                      for lr in args.lrs]
            result[name][str(w)] = losses
            best = args.lrs[min(range(len(losses)), key=losses.__getitem__)]
            print(f"{name} width {w}: best lr {best:g}; " +
                  " ".join(f"{lr:g}:{loss:.3f}" for lr, loss in zip(args.lrs, losses)), flush=True)
    return result


def sweep_table(result: dict) -> str:
    lrs = result["lrs"]
    lines = ["| param. | width | " + " | ".join(f"{lr:g}" for lr in lrs) + " | best lr |",
             "|---|---|" + "---|" * len(lrs) + "---|"]
    for name in ("sp", "mup"):
        for w, losses in result[name].items():
            i = min(range(len(losses)), key=losses.__getitem__)
            cells = [f"**{v:.3f}**" if j == i else f"{v:.3f}" for j, v in enumerate(losses)]
            lines.append(f"| {'SP' if name == 'sp' else 'muP'} | {w} | " + " | ".join(cells)
                         + f" | {lrs[i]:g} |")
    return "\n".join(lines)


def plot_lr_sweep(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, name in zip(axes, ("sp", "mup")):
        for w, losses in result[name].items():
            ax.plot(result["lrs"], losses, marker="o", label=f"width {w}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("AdamW lr (base lr under muP)")
        ax.set_title(f"{'SP' if name == 'sp' else 'muP'}: loss after {result['steps']} steps")
        ax.legend()
    axes[0].set_ylabel("train loss (mean of last 10 steps)")
    finite = [v for n in ("sp", "mup") for ls in result[n].values() for v in ls if v < float("inf")]
    axes[0].set_ylim(min(finite) - 0.05, min(max(finite), min(finite) + 1.5))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_output_args(p, "studies", out=True)
    p.add_argument("--lr-sweep", action="store_true", help="run the lr sweep instead")
    p.add_argument("--widths", type=int, nargs="+", default=[64, 128, 256, 512])
    p.add_argument("--steps", type=int, default=6, help="coordinate check: forward passes recorded")
    p.add_argument("--lr", type=float, default=1e-2, help="coordinate check: AdamW lr")
    p.add_argument("--seeds", type=int, default=2, help="coordinate check: seeds averaged")
    p.add_argument("--sweep-widths", type=int, nargs="+", default=[32, 64, 128])
    p.add_argument("--lrs", type=float, nargs="+",
                   default=[2.0 ** e for e in range(-10, -4)])
    p.add_argument("--sweep-steps", type=int, default=40)
    p.add_argument("--sweep-batch", type=int, default=8, help="lr sweep: sequences of 64 bytes per step")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    results, figures = output_dirs(args, "studies")
    tokens = corpus_bytes()
    if args.lr_sweep:
        result = run_lr_sweep(args, tokens)
        (results / "mup_lr_sweep.json").write_text(json.dumps(result, indent=1))
        plot_lr_sweep(result, figures / "mup_lr_sweep.png")
        print(sweep_table(result))
    else:
        result = run_coord_check(args, tokens)
        (results / "mup_coord_check.json").write_text(json.dumps(result, indent=1))
        plot_coord_check(result, figures / "mup_coord_check.png")
    print(f"wrote {results}" if results == figures else f"wrote {results} and {figures}")


if __name__ == "__main__":
    main()
