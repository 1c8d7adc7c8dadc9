"""Tensor- (with and without sequence parallelism) and expert-parallel models against one
unsharded reference, on 2 and 4 gloo ranks.

Every rank builds the full reference model and the sharded one from the same seed and feeds both
the same micro-batch. Checked: init (each shard equals the reference's slice exactly), the loss,
the router losses, and every gradient (each shard's gradient equals the reference gradient's
slice). Tolerance: fp32, the sharded model sums the same products in a different order (split
matmuls, all-reduces), ~1e-7 relative per op; 1e-5 absolute on O(1) values covers 2 layers.
"""

import torch
import torch.distributed as dist

from model import DenseConfig, MixtralConfig, SwitchConfig, Transformer
from model.config import MoEConfig
from model.parallel import comm
from model.parallel.groups import build_groups
from model.parallel.layers import take_shard
from tests.distributed import run_ranks

SIZES = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
             ffn_hidden_size=48, max_seq_len=16, init_std=0.2)
TOL = dict(rtol=1e-5, atol=1e-5)


def _configs():
    moe = dict(router_jitter=0.0, capacity_factor=None, eval_capacity_factor=None)
    return {
        "dense": DenseConfig(**SIZES).validate(),
        "dense_tied_1kv": DenseConfig(**{**SIZES, "num_kv_heads": 1, "tie_embeddings": True}).validate(),
        "switch": SwitchConfig(**SIZES, moe=MoEConfig(num_experts=4, top_k=1, normalize_top_k=False,
                                                      moe_layer_freq=2, **moe)).validate(),
        "mixtral": MixtralConfig(**SIZES, moe=MoEConfig(num_experts=4, top_k=2, **moe)).validate(),
    }


def _check(cfg, groups, tag, checkpointing="none"):
    ref = Transformer(cfg, None, init_seed=7)
    par = Transformer(cfg, groups, init_seed=7)
    par.set_activation_checkpointing(checkpointing)    # recompute re-issues the collectives
    ref_params = dict(ref.named_parameters())
    for name, p in par.named_parameters():               # init parity at this layout
        assert torch.equal(p, take_shard(ref_params[name].detach(), p.shard_spec)), (tag, name)

    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(0, cfg.vocab_size, (4, 16), generator=gen)
    labels = torch.randint(0, cfg.vocab_size, (4, 16), generator=gen)
    seen = []   # the residual stream a block receives: (B, S/tp, H) under sequence parallelism
    par.layers[1].register_forward_pre_hook(lambda mod, args: seen.append(args[0].shape))
    out_ref, out_par = ref(ids, labels), par(ids, labels)
    split = groups.tp if groups.sequence_parallel else 1
    assert seen == [(4 // groups.ep, 16 // split, cfg.hidden_size)], (tag, seen)
    # Mean over the micro-batch's 64 target tokens, so values and gradients are O(1).
    (out_ref.ce_sum / 64 + ref.router_loss(out_ref)).backward()
    (out_par.ce_sum / 64 + par.router_loss(out_par)).backward()

    # The ce of an ep rank covers its slice of the batch; tp ranks each hold the full value.
    ce = comm.all_reduce_sum(out_par.ce_sum.detach().clone(), groups.ep_group)
    torch.testing.assert_close(ce, out_ref.ce_sum.detach(), **TOL, msg=tag)
    if cfg.moe is not None:
        aux = comm.all_reduce_sum(out_par.aux_loss.detach().clone(), groups.ep_group)
        z = comm.all_reduce_sum(out_par.z_loss.detach().clone(), groups.ep_group)
        torch.testing.assert_close(aux, out_ref.aux_loss.detach(), **TOL, msg=tag)
        torch.testing.assert_close(z, out_ref.z_loss.detach(), **TOL, msg=tag)
    for name, p in par.named_parameters():
        expected = take_shard(ref_params[name].grad, p.shard_spec)
        torch.testing.assert_close(p.grad, expected, **TOL, msg=f"{tag} grad {name}")


def _two_ranks(rank, world):
    cfgs = _configs()
    tp2 = build_groups(tp=2)
    for name, cfg in cfgs.items():
        _check(cfg, tp2, f"tp2/{name}")
    sp = build_groups(tp=2, sequence_parallel=True)
    for name, cfg in cfgs.items():
        _check(cfg, sp, f"tp2-sp/{name}")
    _check(cfgs["mixtral"], sp, "tp2-sp/mixtral/full-checkpointing", "full")
    _check(cfgs["mixtral"], sp, "tp2-sp/mixtral/moe-checkpointing", "moe")
    ep2 = build_groups(ep=2)
    _check(cfgs["mixtral"], ep2, "ep2/mixtral")
    _check(cfgs["switch"], ep2, "ep2/switch")
    _check(cfgs["mixtral"], ep2, "ep2/mixtral/experts-checkpointing", "experts")
    _check(cfgs["dense_tied_1kv"], ep2, "ep2/dense-tied")     # one gradient sum, two uses
    rr = build_groups(ep=2, expert_placement="round_robin")
    _check(cfgs["mixtral"], rr, "ep2-round-robin/mixtral")
    # Each ep rank holds different experts; placements differ as documented.
    experts = Transformer(cfgs["mixtral"], rr).layers[0].mlp.experts.expert_ids
    assert experts == [rank, rank + 2]
    experts = Transformer(cfgs["mixtral"], ep2).layers[0].mlp.experts.expert_ids
    assert experts == [2 * rank, 2 * rank + 1]
    # Rank-as-data: the groups contain who they should.
    t = torch.tensor([float(rank)])
    assert comm.all_reduce_sum(t.clone(), tp2.tp_group).item() == 1.0
    assert tp2.dp == 1 and ep2.dp == 1 and tp2.ep_group is None and ep2.tp_group is None


def _four_ranks(rank, world):
    cfgs = _configs()
    g = build_groups(tp=2, ep=2)
    assert (g.tp_rank, g.ep_rank) == (rank % 2, rank // 2)
    _check(cfgs["mixtral"], g, "tp2xep2/mixtral")
    _check(cfgs["dense"], g, "tp2xep2/dense")
    sp = build_groups(tp=2, ep=2, sequence_parallel=True)
    _check(cfgs["mixtral"], sp, "tp2xep2-sp/mixtral")
    _check(cfgs["switch"], sp, "tp2xep2-sp/switch")
    # Rank-as-data: group sums of the rank ids name the members.
    def total(group):
        return comm.all_reduce_sum(torch.tensor([float(rank)]), group).item()
    assert total(g.tp_group) == {0: 1, 1: 1, 2: 5, 3: 5}[rank]
    assert total(g.ep_group) == {0: 2, 1: 4, 2: 2, 3: 4}[rank]
    assert total(g.mp_group) == 6 and g.dp_group is None
    dp2 = build_groups(tp=2)                                  # tp 2 x dp 2
    assert dp2.dp == 2 and total(dp2.dp_group) == {0: 2, 1: 4, 2: 2, 3: 4}[rank]
    _check(cfgs["switch"], dp2, "tp2-dp2/switch")


def test_tp2_and_ep2_match_the_unsharded_model():
    run_ranks(_two_ranks, 2)


def test_tp2_x_ep2_matches_the_unsharded_model():
    run_ranks(_four_ranks, 4)


def test_init_is_the_same_full_model_at_any_layout_single_process():
    cfg = _configs()["mixtral"]
    a, b = Transformer(cfg, init_seed=3), Transformer(cfg, init_seed=3)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n
    c = Transformer(cfg, init_seed=4)
    assert not torch.equal(a.layers[0].self_attn.q_proj.weight, c.layers[0].self_attn.q_proj.weight)
    assert not dist.is_initialized()


def test_model_parallel_shards_merge_back_into_the_full_model():
    from interop.consolidate import merge_model_parallel
    from model.parallel.groups import ParallelGroups
    cfg = _configs()["mixtral"]
    ref = dict(Transformer(cfg, init_seed=5).named_parameters())
    for placement in ("contiguous", "round_robin"):
        shards = {}
        for ep_rank in range(2):
            for tp_rank in range(2):
                layout = ParallelGroups(tp=2, ep=2, tp_rank=tp_rank, ep_rank=ep_rank,
                                        expert_placement=placement)
                model = Transformer(cfg, layout, init_seed=5)
                shards[ep_rank * 2 + tp_rank] = {n: p.detach() for n, p in model.named_parameters()}
        world = {"tensor_parallel_size": 2, "expert_parallel_size": 2, "expert_placement": placement}
        full = merge_model_parallel(cfg, world, shards)
        assert full.keys() == ref.keys()
        for name, p in ref.items():
            assert torch.equal(full[name], p.detach()), (placement, name)
