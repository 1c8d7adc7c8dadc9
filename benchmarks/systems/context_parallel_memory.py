"""What one attention layer saves for backward per rank under context parallelism.

Hardware: any CPU; gloo ranks on 127.0.0.1 (the defaults: about 2 minutes on 2 busy cores,
40 s of CPU; a few GiB of memory at the peak, p2p's block scores at CP2).
Launch:   python -m benchmarks.systems.context_parallel_memory                      # S = 16384
          python -m benchmarks.systems.context_parallel_memory --seq 4096 --modes a2a,allgather --json cp.json

For each cp (1: the single-process causal SDPA) and exchange (``model/parallel/context.py``:
a2a, allgather, p2p), each rank runs the forward of one causal attention over its load-balanced
S/cp tokens with ``torch.autograd.graph.saved_tensors_hooks`` counting every tensor autograd
keeps for backward, once per storage (q, k and v travel in one buffer under a2a, K and V in one
under allgather: views of one storage count once), then backward. Reported for the rank that
saves most: the saved bytes, of which the additive masks that CPU SDPA materializes (see
below), and the rest as a fraction of CP1's (which saves no mask).

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


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=16384, help="window length S")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=16)
    p.add_argument("--cps", default="1,2,4", help="context-parallel sizes, comma-separated")
    p.add_argument("--modes", default=",".join(cpx.CP_COMMS), help="cp_comm values, comma-separated")
    p.add_argument("--json", help="also write the rows here")
    return p.parse_args(argv)


def measure(args, group, cp: int, rank: int, mode: str | None) -> dict:
    """Saved bytes of one forward on this rank (mode None: the single-process attention)."""
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


def _ranks(rank: int, world: int, args, modes, out) -> None:
    torch.set_num_threads(1)
    for mode in modes:
        row = measure(args, dist.group.WORLD, world, rank, mode)
        rows = [None] * world
        dist.all_gather_object(rows, row)
        if rank == 0:
            out.put(rows)


def spawn_rows(cps, single, ranks, args, modes) -> list:
    """For each cp in ``cps``: ``single()`` on this process at cp 1, else ``ranks(rank, world,
    args, modes, out)`` on cp spawned gloo ranks, whose rank 0 puts one row per mode in ``out``;
    the rows in that order (also ``context_parallel_model_memory.py``'s)."""
    results = []
    for cp in cps:
        results += [single()] if cp == 1 else gather_rows(ranks, cp, args, modes, rows=len(modes))
    return results


def main(argv=None) -> int:
    args = parse_args(argv)
    cps = [int(c) for c in args.cps.split(",")]
    modes = args.modes.split(",")
    for m in modes:
        cpx._check_comm(m)
    for cp in cps:
        cpx.split_for_cp(torch.zeros(1, args.seq), cp, 0)                  # its error, early
    results = spawn_rows(cps, lambda: [measure(args, None, 1, 0, None)], _ranks, args, modes)
    base = results[0][0]["saved"] if cps[0] == 1 else None
    mib = 2.0 ** 20
    print(f"S = {args.seq}, B = {args.batch}, heads {args.heads}/{args.kv_heads} x {args.head_dim}, fp32; "
          f"saved for backward per rank (the largest rank)")
    print(f"{'cp':>3} {'cp_comm':>10} {'saved MiB':>10} {'CPU masks MiB':>14} {'without MiB':>12} "
          f"{'vs CP1':>7}")
    rows = []
    for per_rank in results:
        r = max(per_rank, key=lambda x: x["saved"])
        rows.append(r)
        ratio = f"{r['saved_without_masks'] / base:.2f}" if base else "-"
        print(f"{r['cp']:>3} {r['mode']:>10} {r['saved'] / mib:>10.2f} {r['cpu_masks'] / mib:>14.2f} "
              f"{r['saved_without_masks'] / mib:>12.2f} {ratio:>7}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
