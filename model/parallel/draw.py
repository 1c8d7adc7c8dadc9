"""The initial weights, drawn block by block: each rank draws only the blocks of its own shard.

A parameter's full tensor is defined once for every layout: along each dim it may be sharded on
(the dims of its ``shard_spec``, which are the same at every layout; only the indices differ), it
is cut into canonical blocks (``param.draw_blocks``: dim -> block length, from the full shape
alone), and each tile of that grid is Normal(0, std) drawn from its own generator, seeded by
(seed, parameter name, tile index). A tile is always drawn whole and contiguous, so its values do
not depend on who draws it; a rank draws the tiles that meet its shard and keeps the elements it
holds. Tensors sharded along no dim (the router, norms) are one tile that every rank draws.

Per rank, for each parameter: its shard plus the unused part of the tiles at the shard's edges
(none when the block length divides the shard, as for any split in up to 64 parts of a size
that 64 divides), and at most one tile in flight per drawing thread: a column-parallel weight or the vocabulary
draws its output rows, a row-parallel weight its input columns, stacked experts (E, H, I) only
this rank's experts (blocks of one expert) and, under tp, its slice of their inner dim.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import itertools
import math
import os
import re

import torch
import torch.nn as nn

BLOCKS = 64  # at most this many blocks along a sharded dim
# Threads drawing one parameter's tiles (one per core, at most 16), and the parameter size below
# which one thread is faster than starting them.
_DRAW_THREADS = min(16, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
_THREADED_NUMEL = 1 << 22


def block_length(size: int) -> int:
    """The canonical block length along a sharded dim of ``size``: ``size / gcd(size, 64)``,
    so the blocks tile every even split of ``size`` in a number of parts dividing 64."""
    return size // math.gcd(size, BLOCKS)


_PIPELINE_PREFIX = re.compile(r"^(?:\d+|tied_modules\.\w+)\.")


def canonical_name(name: str) -> str:
    """A parameter's name in ``model.Transformer`` from its name in DeepSpeed's PipelineModule
    (``3.layers.2.mlp.gate.weight``, ``tied_modules.embed.embed_tokens.weight``); other names
    unchanged. Checkpoints of every layout meet under these names."""
    return _PIPELINE_PREFIX.sub("", name, count=1)


def take_shard(full: torch.Tensor, spec) -> torch.Tensor:
    """This rank's shard of ``full`` (see ``model.parallel.layers.shard_param``); ``full`` itself
    when the spec keeps every index (no copy of the largest tensors at tp 1)."""
    for dim, idx in spec:
        if list(idx) != list(range(full.shape[dim])):
            full = full.index_select(dim, torch.as_tensor(idx, device=full.device))
    return full.contiguous()


def _tile_seed(seed: int, name: str, tile: tuple[int, ...]) -> int:
    # 64 bits of (seed, name, tile); torch's CPU generator (mt19937) keeps the low 32 of them.
    key = f"{seed}/{name}/{','.join(map(str, tile))}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")


def _draw_tile(shape: list[int], std: float, seed: int) -> torch.Tensor:
    """One tile: fp32 Normal(0, std), always drawn whole into a fresh contiguous tensor (torch's
    normal_ takes another path for non-contiguous outputs, which would change the values)."""
    return torch.empty(shape).normal_(0.0, std, generator=torch.Generator().manual_seed(seed))


def _run(positions: list[int]) -> tuple[int, int] | None:
    """(start, length) when ``positions`` is one ascending run, else None."""
    start, n = positions[0], len(positions)
    return (start, n) if positions == list(range(start, start + n)) else None


def _put(dst: torch.Tensor, src: torch.Tensor, cuts: list[tuple[int, list[int], list[int]]]) -> None:
    """Copy the elements of ``src`` (a tile) that the shard holds into ``dst`` (the shard): for
    each (dim, shard positions, tile offsets) in ``cuts``, the i-th offset goes to the i-th
    position."""
    if not cuts:
        dst.copy_(src)
        return
    (dim, pos, off), rest = cuts[0], cuts[1:]
    o = _run(off)
    src = src.narrow(dim, *o) if o else src.index_select(dim, torch.as_tensor(off))
    p = _run(pos)
    if p:
        _put(dst.narrow(dim, *p), src, rest)
    else:                                       # shard indices not ascending: one slice at a time
        for j, q in enumerate(pos):
            _put(dst.narrow(dim, q, 1), src.narrow(dim, j, 1), rest)


def draw(name: str, full_shape: tuple, std: float | None, seed: int,
         blocks: dict[int, int] | None = None, spec=()) -> torch.Tensor:
    """This rank's fp32 shard (``spec``; default: the full tensor) of parameter ``name``: ones
    when ``std`` is None (norm weights), zeros when it is 0 (biases), else Normal(0, std) per
    element, drawing only the tiles of the ``blocks`` grid that meet the shard (see the module
    docstring). The same values as ``take_shard(draw(name, full_shape, std, seed, blocks), spec)``.
    """
    index = [list(range(n)) for n in full_shape]
    for dim, idx in spec:
        index[dim] = [index[dim][i] for i in idx]
    out = torch.empty([len(i) for i in index])
    if std is None or std == 0:
        return out.fill_(1.0 if std is None else 0.0)
    dims = sorted(blocks or {})
    parts = []                                  # per blocked dim: block -> (positions, offsets)
    for d in dims:
        b, by_block = blocks[d], {}
        for pos, i in enumerate(index[d]):
            p, o = by_block.setdefault(i // b, ([], []))
            p.append(pos), o.append(i % b)
        parts.append(by_block)
    # Dims cut without blocks (a parameter with no ``draw_blocks``): every tile spans them whole.
    unblocked = [(d, list(range(len(index[d]))), index[d]) for d in range(len(full_shape))
                 if d not in dims and index[d] != list(range(full_shape[d]))]
    def draw_and_put(tile: tuple[int, ...]) -> None:
        shape = list(full_shape)
        for d, k in zip(dims, tile):
            shape[d] = min(blocks[d], full_shape[d] - k * blocks[d])
        values = _draw_tile(shape, std, _tile_seed(seed, name, tile))
        _put(out, values, [(d, *part[k]) for d, k, part in zip(dims, tile, parts)] + unblocked)

    tiles = list(itertools.product(*(sorted(p) for p in parts)))
    # Each tile has its own generator and its own elements of ``out``, so tiles can be drawn in
    # any order and at once: normal_ releases the GIL, and a generator's draw is single-threaded,
    # so threads are what spreads a billion-parameter init over the host's cores (at most
    # ``_DRAW_THREADS`` tiles in flight). The values are those of the one-at-a-time loop.
    workers = min(_DRAW_THREADS, len(tiles))
    if workers <= 1 or out.numel() < _THREADED_NUMEL:
        for tile in tiles:
            draw_and_put(tile)
        return out
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        for done in pool.map(draw_and_put, tiles):
            del done
    return out


def _copy_into(param: nn.Parameter, shard: torch.Tensor) -> None:
    param.copy_(shard.to(param.dtype))


@torch.no_grad()
def fill_shards(module: nn.Module, shard_for, write=None) -> None:
    """Set every parameter of ``module`` to ``shard_for(name, param)``, this rank's shard of its
    full tensor, one tensor at a time.

    Args:
        shard_for: (parameter name, parameter) -> this rank's fp32 shard.
        write: (parameter, shard) -> None. Default: copy the shard into the parameter. A build
            whose parameters are already partitioned passes one that keeps only its partition
            (``training/engine/sharded_build.py``, ZeRO-3).
    """
    for name, p in module.named_parameters():
        (write or _copy_into)(p, shard_for(name, p))


def fill_from_full(module: nn.Module, full_for, write=None) -> None:
    """``fill_shards`` from full tensors (loaded): host memory peaks at the largest full tensor,
    never at the whole model. ``full_for``: (parameter name, full shape) -> the full tensor."""
    fill_shards(module, lambda name, p: take_shard(
        full_for(name, getattr(p, "full_shape", tuple(p.shape))), getattr(p, "shard_spec", [])), write)


def init_from_full(module: nn.Module, std_for, seed: int, write=None) -> None:
    """Initialize every parameter of ``module`` to this rank's shard of its full tensor drawn
    from (seed, parameter name) (``draw``: only the shard's tiles): the same full weights at any
    tensor/expert-parallel layout, however ``write`` stores them (see ``fill_shards``).

    Args:
        std_for: name -> std (None for ones, as for norm weights; 0 for zeros).
    """
    fill_shards(module, lambda name, p: draw(
        name, getattr(p, "full_shape", tuple(p.shape)), std_for(name), seed,
        getattr(p, "draw_blocks", None), getattr(p, "shard_spec", [])), write)


__all__ = ["BLOCKS", "block_length", "draw", "fill_from_full", "fill_shards", "init_from_full",
           "take_shard"]
