"""The block-wise init draw (model/parallel/draw.py), single process at every (tp_rank, ep_rank):

- each rank draws about its share: counting the elements each tile draw generates, per
  parameter, a tp/ep rank of tiny Mixtral (and Qwen2-MoE-style replicated kv heads, and Qwen3's
  fine-grained experts) draws exactly its shard where its blocks align with it (every split
  here), so at most its shard plus one tile per tensor; the routed experts' 1/(tp ep), and at
  TP2 under 0.6 of the model's elements (the replicated router and kv heads aside), where a
  draw of every full tensor on every rank would be all of them;
- the shards of TP2, EP2 (both placements) and TP2 x EP2 equal the single-process init's full
  tensors cut by their ``shard_spec``, bitwise;
- the values: Normal(0, std) per element (the residual projections scaled), deterministic,
  another seed gives other values, and tiles of one tensor are not copies of each other.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from model import Transformer
from model.config import MixtralConfig, MoEConfig
from model.parallel import draw as draw_mod
from model.parallel.groups import ParallelGroups
from model.parallel.layers import take_shard
from model.transformer import init_std_for
from training.config.recipe import load_recipe

REPO = Path(__file__).resolve().parents[2]
LAYOUTS = [(2, 1, "contiguous"), (1, 2, "contiguous"), (1, 2, "round_robin"),
           (2, 2, "round_robin"), (4, 1, "contiguous")]
SIZES = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, max_seq_len=16, init_std=0.2)


def _configs():
    tiny = load_recipe(REPO / "recipes" / "tiny_mixtral.yaml", []).model
    return {
        "tiny_mixtral": tiny,
        # One kv head: every tp rank holds it whole (and its bias), drawn by each.
        "qwen2": MixtralConfig(**SIZES, num_kv_heads=1, ffn_hidden_size=48, qkv_bias=True, moe=MoEConfig(
            num_experts=4, top_k=2, num_shared_experts=1, shared_expert_gate=True)).validate(),
        # Fine-grained experts (inner 16) after one dense block, per-head q/k norms.
        "qwen3": MixtralConfig(**SIZES, num_kv_heads=2, ffn_hidden_size=48, attn_head_dim=16,
                               qk_norm=True, moe=MoEConfig(num_experts=8, top_k=4,
                                                           expert_ffn_hidden_size=16,
                                                           first_k_dense=1)).validate(),
    }


def _groups(tp, ep, placement, tp_rank, ep_rank):
    return ParallelGroups(tp=tp, ep=ep, tp_rank=tp_rank, ep_rank=ep_rank, expert_placement=placement)


@pytest.mark.parametrize("name", ["tiny_mixtral", "qwen2", "qwen3"])
def test_each_rank_draws_about_its_share(name, monkeypatch):
    cfg = _configs()[name]
    std_for = init_std_for(cfg)
    drawn = []
    real = draw_mod._draw_tile

    def counting(shape, std, seed):
        drawn.append(math.prod(shape))
        return real(shape, std, seed)
    monkeypatch.setattr(draw_mod, "_draw_tile", counting)
    full = dict(Transformer(cfg, init_seed=None).named_parameters())
    full_total = sum(p.numel() for p in full.values())
    full_experts = sum(p.numel() for n, p in full.items() if ".experts." in n)
    for tp, ep, placement in LAYOUTS:
        for tp_rank in range(tp):
            for ep_rank in range(ep):
                model = Transformer(cfg, _groups(tp, ep, placement, tp_rank, ep_rank), init_seed=None)
                rank_total, experts = 0, 0
                for pname, p in model.named_parameters():
                    drawn.clear()
                    shard = draw_mod.draw(pname, p.full_shape, std_for(pname), 0, p.draw_blocks,
                                          p.shard_spec)
                    assert shard.shape == p.shape, pname
                    if not drawn:                     # ones or zeros: nothing drawn
                        continue
                    # Every split here aligns with the blocks: exactly the shard, and never
                    # more than the shard plus one tile.
                    assert sum(drawn) == p.numel() <= p.numel() + max(drawn), (pname, tp, ep)
                    rank_total += sum(drawn)
                    experts += sum(drawn) if ".experts." in pname else 0
                if (tp, ep) == (2, 1):                # all but norms, router, replicated kv
                    assert rank_total < 0.6 * full_total, (name, rank_total / full_total)
                assert experts == full_experts / (tp * ep), (name, tp, ep)


@pytest.mark.parametrize("name", ["tiny_mixtral", "qwen2", "qwen3"])
def test_every_layout_holds_shards_of_the_single_process_init(name):
    cfg = _configs()[name]
    full = {n: p.detach() for n, p in Transformer(cfg, init_seed=11).named_parameters()}
    for tp, ep, placement in LAYOUTS:
        seen = {n: torch.zeros(full[n].shape, dtype=torch.bool) for n in full}
        for tp_rank in range(tp):
            for ep_rank in range(ep):
                model = Transformer(cfg, _groups(tp, ep, placement, tp_rank, ep_rank), init_seed=11)
                for n, p in model.named_parameters():
                    assert torch.equal(p.detach(), take_shard(full[n], p.shard_spec)), (tp, ep, n)
                    index = [torch.arange(s) for s in p.full_shape]
                    for dim, idx in p.shard_spec:
                        index[dim] = index[dim][torch.as_tensor(idx)]
                    seen[n][torch.meshgrid(*index, indexing="ij")] = True
        assert all(s.all() for s in seen.values()), (tp, ep)     # the shards cover every element


def test_values_are_normal_deterministic_and_tiles_differ():
    cfg = _configs()["tiny_mixtral"]
    a = dict(Transformer(cfg, init_seed=3).named_parameters())
    b = dict(Transformer(cfg, init_seed=3).named_parameters())
    c = dict(Transformer(cfg, init_seed=4).named_parameters())
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not any(torch.equal(a[n], c[n]) for n in a if not n.endswith("norm.weight"))
    out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
    for n, std in (("embed_tokens.weight", cfg.init_std),                         # 4096 blocks of 1 row
                   ("layers.0.mlp.experts.gate_proj", cfg.init_std),              # 8 x 64 tiles
                   ("layers.1.mlp.experts.down_proj", out_std),
                   ("layers.0.self_attn.o_proj.weight", out_std)):                # 64 column blocks
        w = a[n].detach().double()
        assert abs(w.mean().item()) < 4 * std / math.sqrt(w.numel()), n
        assert w.std().item() == pytest.approx(std, rel=8 / math.sqrt(w.numel())), n
        # Standardized, the fraction beyond 1, 2 sigma is the normal's (0.3173, 0.0455).
        z = (w / std).abs()
        assert (z > 1).double().mean().item() == pytest.approx(0.3173, abs=0.02), n
        assert (z > 2).double().mean().item() == pytest.approx(0.0455, abs=0.01), n
    # Tiles are not copies of one another: no two rows of the row-blocked embedding are equal,
    # nor two experts' (H, I/64) column tiles.
    emb = a["embed_tokens.weight"].detach()
    assert torch.unique(emb[:, 0]).numel() == emb.shape[0]
    gate = a["layers.0.mlp.experts.gate_proj"].detach()          # (E, H, I), tiles (1, H, 2)
    firsts = gate[:, 0, ::2].reshape(-1)
    assert torch.unique(firsts).numel() == firsts.numel()


def test_draw_cuts_any_spec_like_take_shard():
    """Unaligned, descending and scattered indices: the shard drawn equals the full tensor cut."""
    blocks = {0: 3, 2: 4}
    full = draw_mod.draw("w", (7, 5, 10), 0.5, 1, blocks)
    for spec in ([(0, [6, 2, 3]), (2, [9, 0, 1, 2, 5])], [(0, [1, 2, 3, 4])], [(1, [4, 0])],
                 [(2, [3, 4, 5, 6, 7])], []):
        assert torch.equal(draw_mod.draw("w", (7, 5, 10), 0.5, 1, blocks, spec),
                           take_shard(full, spec)), spec
