"""How long each rank takes to initialize its weights: the block-wise draw (each rank draws only
the blocks of its tp/ep shard, ``model/parallel/draw.py``) against the full draw
(``former_draw``, ``--skip-former`` leaves it out), where every rank draws every full tensor
from (seed, name) and keeps its slice.

    python -m benchmarks.systems.build_time                          # Mixtral-shaped, 0.428B parameters
    python -m benchmarks.systems.build_time --set model.num_layers=2 # any recipe override

For each layout (TP1 control, TP2, EP2, TP2 x EP2) and each of its ranks, builds the model at that
rank's coordinates in this process (the init needs no communication: the ranks of a job do the
same work side by side, so a rank's time is the job's build time) on one thread, and times the
construction plus the init; the construction alone (``init_seed=None``) is timed once and
reported apart. Also counts the elements each rank draws. Checks that the shards of every layout
are the control's full tensors cut by their ``shard_spec`` (bitwise), and prints a markdown table.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch


from model import Transformer                                     
from model.parallel import draw as draw_mod                       
from model.parallel.groups import ParallelGroups                  
from model.parallel.layers import take_shard                      
from training.config.recipe import load_recipe

MIXTRAL = ["model.hidden_size=1024", "model.num_heads=8", "model.num_kv_heads=2",
           "model.ffn_hidden_size=3584", "model.num_layers=4", "model.vocab_size=32000",
           "tokenizer.vocab_size=32000"]
LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]


def former_draw(name, full_shape, std, seed, blocks=None, spec=()):
    """The full draw: the full tensor from one generator seeded by (seed, name), then the slice."""
    import zlib
    if std is None or std == 0:
        return take_shard(torch.full(full_shape, 1.0 if std is None else 0.0), spec)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return take_shard(torch.empty(full_shape).normal_(0.0, std, generator=gen), spec)


def build(cfg, tp, ep, tp_rank, ep_rank, drawn):
    real = draw_mod._draw_tile

    def counting(shape, std, seed):
        drawn.append(torch.Size(shape).numel())
        return real(shape, std, seed)
    draw_mod._draw_tile = counting
    try:
        groups = ParallelGroups(tp=tp, ep=ep, tp_rank=tp_rank, ep_rank=ep_rank)
        start = time.perf_counter()
        model = Transformer(cfg, groups, init_seed=0)
        return model, time.perf_counter() - start
    finally:
        draw_mod._draw_tile = real


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", default="recipes/tiny_mixtral.yaml")
    parser.add_argument("--set", nargs="*", default=[], help="recipe overrides after the defaults")
    parser.add_argument("--skip-former", action="store_true", help="time only the block-wise draw")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    cfg = load_recipe(args.recipe, MIXTRAL + args.set).model
    start = time.perf_counter()
    bare = Transformer(cfg, init_seed=None)
    construct = time.perf_counter() - start
    full_total = sum(p.numel() for p in bare.parameters())
    del bare
    print(f"{full_total / 1e9:.3f}B parameters; construction alone (TP1, no init): {construct:.2f} s")
    rows, control = [], None
    for mode in ("block-wise", "former"):
        if mode == "former" and args.skip_former:
            continue
        real_draw = draw_mod.draw
        if mode == "former":
            draw_mod.draw = former_draw
        try:
            for tp, ep in LAYOUTS:
                times, counts = [], []
                for ep_rank in range(ep):
                    for tp_rank in range(tp):
                        drawn = []
                        model, seconds = build(cfg, tp, ep, tp_rank, ep_rank, drawn)
                        times.append(seconds)
                        counts.append(sum(drawn) if mode == "block-wise" else None)
                        params = {n: p.detach() for n, p in model.named_parameters()}
                        if mode == "block-wise" and (tp, ep) == (1, 1):
                            control = params
                        elif mode == "block-wise":
                            for n, p in params.items():
                                shard = take_shard(control[n], model.get_parameter(n).shard_spec)
                                assert torch.equal(p, shard), (tp, ep, n)
                        del model, params
                drawn_s = ("-" if counts[0] is None else
                           " / ".join(f"{c / full_total:.3f}" for c in counts))
                rows.append((mode, f"TP{tp} x EP{ep}", " / ".join(f"{t:.2f}" for t in times),
                             f"{max(times):.2f}", drawn_s))
                print(rows[-1], flush=True)
        finally:
            draw_mod.draw = real_draw
    print("\n| draw | layout | build per rank (s) | slowest rank (s) | drawn / full model, per rank |")
    print("|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
