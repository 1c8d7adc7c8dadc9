"""What one attention layer, or a whole model, saves for backward per rank under context parallelism.

Hardware: any CPU; gloo ranks on 127.0.0.1. ``--scope layer`` (the defaults: about 2 minutes on
2 busy cores, 40 s of CPU; a few GiB of memory at the peak, p2p's block scores at CP2);
``--scope model`` (the defaults: about 4 minutes on 2 cores, a few GiB of memory: the fp32
logits of 16K tokens, the ring's block scores).
Launch:   python -m benchmarks.systems.context_parallel_memory                      # one layer, S = 16384
          python -m benchmarks.systems.context_parallel_memory --seq 4096 --modes a2a,allgather --json cp.json
          python -m benchmarks.systems.context_parallel_memory --scope model        # tiny_dense, S = 16384
          python -m benchmarks.systems.context_parallel_memory --scope model --recipe recipes/tiny_mixtral.yaml --seq 8192 --json cp.json

For each cp (1: one process) and exchange (``--modes``, of ``parallel.cp_comm``:
``model/parallel/context.py``'s a2a, allgather, p2p), each rank measures the bytes autograd keeps
for backward; the rank that saves most is reported.

``--scope layer`` (the default; ``--batch``, ``--heads``, ``--kv-heads``, ``--head-dim``): each
rank runs the forward of one causal attention over its load-balanced S/cp tokens (CP1: the
single-process causal SDPA) with ``torch.autograd.graph.saved_tensors_hooks`` counting every
tensor autograd keeps for backward, once per storage (q, k and v travel in one buffer under a2a,
K and V in one under allgather: views of one storage count once), then backward. Reported: the
saved bytes, of which the additive masks that CPU SDPA materializes (see below), and the rest as
a fraction of CP1's (which saves no mask).

What to expect (B rows, nh / nkv heads of width hd, fp32): CP1 saves q, k, v, the output and the
log-sum-exp of the whole window. a2a saves the gathered q, k, v and the output of S tokens for
nh/cp heads (kv heads repeated up to cp when fewer), about 1/cp of CP1. allgather saves the
whole K and V on every rank (2 nkv S hd, independent of cp) besides the local queries and
output. p2p saves only local tensors (S/cp) but its output in fp32. CPU SDPA kernels are not
CUDA's: on the CPU the bottom-right causal mask of allgather's key prefixes is materialized as a
bool (c, prefix) tensor and saved; flash on CUDA builds none. The p2p block math materializes
each block's scores transiently (not saved): its peak memory is not in this table.

Measured (defaults, torch 2.13 CPU)::

    S = 16384, B = 1, heads 4/2 x 16, fp32; saved for backward per rank (the largest rank)
     cp    cp_comm  saved MiB  CPU masks MiB  without MiB  vs CP1
      1          -      12.25           0.00        12.25    1.00
      2        a2a       6.12           0.00         6.12    0.50
      2  allgather     328.12         320.00         8.12    0.66
      2        p2p       6.12           0.00         6.12    0.50
      4        a2a       4.06           0.00         4.06    0.33
      4  allgather     150.06         144.00         6.06    0.49
      4        p2p       3.06           0.00         3.06    0.25

a2a at CP4 saves 1/3, not 1/4: the 2 kv heads are repeated to 4, one per rank. allgather keeps
the whole K and V (4 MiB here) on every rank whatever cp is. The CPU masks are the bottom-right
causal masks that CPU SDPA turns into float (c, prefix) tensors and saves; CUDA's flash kernel
takes ``causal_lower_right`` without one (not measured here: no GPU).

``--scope model`` (``--recipe``, default ``recipes/tiny_dense.yaml``): every rank builds the
recipe's model (fp32, ``model.max_seq_len`` raised to S) with its cp groups and runs one training
forward of one S-token window (no document masking) under
``planning.measured.saved_activation_bytes``: the bytes autograd holds for backward at the end of
the forward, the peak of a step's activations (the transients of backward come and go on top).
Reported beside the estimator's figure for the same layout
(``planning/memory_model.activation_bytes``) and the ratio to CP1. CPU SDPA materializes and
saves a float mask for the all-gather's bottom-right causal rule, which CUDA's fused kernels take
without one: reported in its own column and left out of the comparison (the estimator models
the GPU). Measured: docs/performance/context-parallel.md (both scopes).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from model.parallel import context as cpx
from training.run.spawn import gather_rows

MIB = 2.0 ** 20
# the options of one scope only, and their defaults there
SCOPE_OPTIONS = {"layer": {"batch": 1, "heads": 4, "kv_heads": 2, "head_dim": 16},
                 "model": {"recipe": "recipes/tiny_dense.yaml"}}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scope", choices=sorted(SCOPE_OPTIONS), default="layer",
                   help="one attention layer (default), or a whole model beside the estimator")
    p.add_argument("--seq", type=int, default=16384, help="window length S")
    p.add_argument("--batch", type=int, help="layer: rows (default 1)")
    p.add_argument("--heads", type=int, help="layer: query heads (default 4)")
    p.add_argument("--kv-heads", type=int, help="layer: kv heads (default 2)")
    p.add_argument("--head-dim", type=int, help="layer: head width (default 16)")
    p.add_argument("--recipe", help="model: the recipe (default recipes/tiny_dense.yaml)")
    p.add_argument("--cps", default="1,2,4", help="context-parallel sizes, comma-separated")
    p.add_argument("--modes", default=",".join(cpx.CP_COMMS), help="cp_comm values, comma-separated")
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args(argv)
    for scope, options in SCOPE_OPTIONS.items():
        for name, default in options.items():
            if scope != args.scope and getattr(args, name) is not None:
                p.error(f"--{name.replace('_', '-')}: an option of --scope {scope}")
            if scope == args.scope and getattr(args, name) is None:
                setattr(args, name, default)
    return args


def measure_layer(args, group, cp: int, rank: int, mode: str | None) -> dict:
    """Saved bytes of one attention forward on this rank (mode None: the single-process attention)."""
    g = torch.Generator().manual_seed(0)
    s = args.seq // cp
    q, k, v = (torch.randn(args.batch, n, s, args.head_dim, generator=g).requires_grad_()
               for n in (args.heads, args.kv_heads, args.kv_heads))
    saved: dict[int, int] = {}
    masks: set[int] = set()

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        saved[ptr] = t.untyped_storage().nbytes()
        if t.dim() == 2:                        # the only 2-D ones: CPU SDPA's additive masks
            masks.add(ptr)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if mode is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                               enable_gqa=args.kv_heads != args.heads)
        else:
            y = cpx.context_attention(q, k, v, group, mode)
    total = sum(saved.values())
    mask = sum(saved[ptr] for ptr in masks)
    y.sum().backward()
    return {"cp": cp, "mode": mode or "-", "rank": rank, "saved": total, "cpu_masks": mask,
            "saved_without_masks": total - mask}


def _model_cfg(args):
    from training.config.recipe import load_recipe
    return load_recipe(args.recipe, [f"model.max_seq_len={args.seq}", "model.mtp_depth=0"]).model


def measure_model(args, cp: int, mode: str, groups=None) -> dict:
    """This rank's saved bytes after one forward of the whole model, and of them the CPU masks."""
    from model import Transformer
    from planning.measured import saved_activation_bytes
    torch.set_num_threads(1)
    cfg = _model_cfg(args)
    model = Transformer(cfg, groups, init_seed=0).train()
    ids = torch.randint(0, cfg.vocab_size, (1, args.seq), generator=torch.Generator().manual_seed(1))
    c = args.seq // (2 * cp)
    masked: dict[int, int] = {}

    def cpu_mask(t):        # the all-gather's (c, prefix) masks: counted apart, once per storage
        if cp > 1 and t.dim() == 2 and t.shape[0] == c and t.shape[1] <= args.seq:
            masked[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return True
        return False
    saved = saved_activation_bytes(model, ids, ids, skip=cpu_mask)
    return {"cp": cp, "mode": mode if cp > 1 else "-", "saved": saved, "cpu_masks": sum(masked.values())}


def _ranks(rank: int, world: int, args, modes, out) -> None:
    """Each mode at cp = ``world``: rank 0 puts the row of the rank that saves most in ``out``."""
    torch.set_num_threads(1)
    for mode in modes:
        if args.scope == "layer":
            row = measure_layer(args, dist.group.WORLD, world, rank, mode)
        else:
            from model.parallel.groups import build_groups
            row = measure_model(args, world, mode, build_groups(cp=world, cp_comm=mode))
        rows = [None] * world
        dist.all_gather_object(rows, row)
        if rank == 0:
            out.put(max(rows, key=lambda r: r["saved"]))


def spawn_rows(args, cps, modes) -> list[dict]:
    """For each cp in ``cps``: one process at cp 1, else one row per mode from cp spawned gloo
    ranks (the rank that saves most); the rows in that order."""
    results = []
    for cp in cps:
        if cp == 1:
            results.append(measure_layer(args, None, 1, 0, None) if args.scope == "layer"
                           else measure_model(args, 1, "-"))
        else:
            results += gather_rows(_ranks, cp, args, modes, rows=len(modes))
    return results


def layer_table(args, cps, results) -> None:
    base = results[0]["saved"] if cps[0] == 1 else None
    print(f"S = {args.seq}, B = {args.batch}, heads {args.heads}/{args.kv_heads} x {args.head_dim}, fp32; "
          f"saved for backward per rank (the largest rank)")
    print(f"{'cp':>3} {'cp_comm':>10} {'saved MiB':>10} {'CPU masks MiB':>14} {'without MiB':>12} "
          f"{'vs CP1':>7}")
    for r in results:
        ratio = f"{r['saved_without_masks'] / base:.2f}" if base else "-"
        print(f"{r['cp']:>3} {r['mode']:>10} {r['saved'] / MIB:>10.2f} {r['cpu_masks'] / MIB:>14.2f} "
              f"{r['saved_without_masks'] / MIB:>12.2f} {ratio:>7}")


def model_table(args, cps, results) -> None:
    """Adds the estimator's figure to each row (``estimate``) as it prints it."""
    from planning import memory_model as mm
    cfg = _model_cfg(args)
    base = next((r["saved"] for r in results if r["cp"] == 1), None)
    print(f"{args.recipe}, S = {args.seq}, fp32, one window; saved for backward per rank (the largest rank)")
    print(f"{'cp':>3} {'cp_comm':>10} {'saved MiB':>10} {'vs CP1':>7} {'estimate MiB':>13} {'est/meas':>9} "
          f"{'CPU masks MiB':>14}")
    for r in results:
        layout = mm.Layout(r["cp"], cp=r["cp"], cp_comm=r["mode"] if r["cp"] > 1 else "a2a")
        r["estimate"] = mm.activation_bytes(cfg, layout, 1, args.seq, 4)["saved"]
        ratio = f"{r['saved'] / base:.3f}" if base else "-"
        print(f"{r['cp']:>3} {r['mode']:>10} {r['saved'] / MIB:>10.1f} {ratio:>7} {r['estimate'] / MIB:>13.1f} "
              f"{r['estimate'] / r['saved']:>9.4f} {r['cpu_masks'] / MIB:>14.1f}")


def main(argv=None) -> int:
    args = parse_args(argv)
    cps = [int(c) for c in args.cps.split(",")]
    modes = args.modes.split(",")
    for m in modes:
        cpx._check_comm(m)
    for cp in cps:
        cpx.split_for_cp(torch.zeros(1, args.seq), cp, 0)                  # its error, early
    if args.scope == "model":
        _model_cfg(args)                                                    # the recipe's error, early
    results = spawn_rows(args, cps, modes)
    (layer_table if args.scope == "layer" else model_table)(args, cps, results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if v is not None}, "rows": results},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
