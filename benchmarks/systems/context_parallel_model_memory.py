"""A whole model's saved activations per rank under context parallelism, measured and estimated.

Hardware: any CPU; gloo ranks on 127.0.0.1 (the defaults: about 4 minutes on 2 cores, a few GiB
of memory: the fp32 logits of 16K tokens, the ring's block scores).
Launch:   python -m benchmarks.systems.context_parallel_model_memory                  # tiny_dense, S = 16384
          python -m benchmarks.systems.context_parallel_model_memory --recipe recipes/tiny_mixtral.yaml --seq 8192 --json cp.json

For cp = 1, 2, 4 and each exchange (``parallel.cp_comm``: a2a, allgather, p2p), every rank builds
the recipe's model (fp32, ``model.max_seq_len`` raised to S) with its cp groups and runs one
training forward of one S-token window (no document masking) under
``planning.measured.saved_activation_bytes``: the bytes autograd holds for backward at the end of
the forward, the peak of a step's activations (the transients of backward come and go on top).
The rank that saves most is reported, beside the estimator's figure for the same layout
(``planning/memory_model.activation_bytes``) and the ratio to CP1. CPU SDPA materializes and saves a
float mask for the all-gather's bottom-right causal rule, which CUDA's fused kernels take without
one: reported in its own column and left out of the comparison (the estimator models the GPU).

Measured: docs/PERFORMANCE.md ("Context parallelism: a model's saved memory per rank").
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.distributed as dist


from benchmarks.systems.context_parallel_memory import spawn_rows
from model import Transformer
from model.parallel.groups import build_groups
from planning import memory_model as mm
from planning.measured import saved_activation_bytes
from training.config.recipe import load_recipe

MODES = ("a2a", "allgather", "p2p")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="recipes/tiny_dense.yaml")
    p.add_argument("--seq", type=int, default=16384, help="window length S")
    p.add_argument("--cps", default="1,2,4", help="context-parallel sizes, comma-separated")
    p.add_argument("--json", help="also write the rows here")
    return p.parse_args(argv)


def _cfg(args):
    return load_recipe(args.recipe, [f"model.max_seq_len={args.seq}", "model.mtp_depth=0"]).model


def measure(args, cp: int, mode: str, groups=None) -> dict:
    """This rank's saved bytes after one forward, and of them the CPU masks."""
    torch.set_num_threads(1)
    cfg = _cfg(args)
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
    for mode in modes:
        row = measure(args, world, mode, build_groups(cp=world, cp_comm=mode))
        rows = [None] * world
        dist.all_gather_object(rows, row)
        if rank == 0:
            out.put(max(rows, key=lambda r: r["saved"]))


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg = _cfg(args)
    cps = [int(c) for c in args.cps.split(",")]
    results = spawn_rows(cps, lambda: measure(args, 1, "-"), _ranks, args, MODES)
    base = next((r["saved"] for r in results if r["cp"] == 1), None)
    mib = 2.0 ** 20
    print(f"{args.recipe}, S = {args.seq}, fp32, one window; saved for backward per rank (the largest rank)")
    print(f"{'cp':>3} {'cp_comm':>10} {'saved MiB':>10} {'vs CP1':>7} {'estimate MiB':>13} {'est/meas':>9} "
          f"{'CPU masks MiB':>14}")
    for r in results:
        layout = mm.Layout(r["cp"], cp=r["cp"], cp_comm=r["mode"] if r["cp"] > 1 else "a2a")
        r["estimate"] = mm.activation_bytes(cfg, layout, 1, args.seq, 4)["saved"]
        ratio = f"{r['saved'] / base:.3f}" if base else "-"
        print(f"{r['cp']:>3} {r['mode']:>10} {r['saved'] / mib:>10.1f} {ratio:>7} {r['estimate'] / mib:>13.1f} "
              f"{r['estimate'] / r['saved']:>9.4f} {r['cpu_masks'] / mib:>14.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
