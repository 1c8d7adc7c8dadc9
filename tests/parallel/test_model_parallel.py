"""Tensor- (with and without sequence parallelism) and expert-parallel models against one
unsharded reference, on 2 and 4 gloo ranks.

Every rank builds the full reference model and the sharded one from the same seed and feeds both
the same micro-batch. Checked: init (each shard equals the reference's slice exactly), the loss,
the router losses, and every gradient (each shard's gradient equals the reference gradient's
slice); with router jitter, seeded as the trainer seeds each step, the same again (the noise, and
so the routing, is the unsharded model's at every layout). Tolerance: fp32, the sharded model sums the same products in a different order (split
matmuls, all-reduces), ~1e-7 relative per op; 1e-5 absolute on O(1) values covers 2 layers.
"""

import torch
import torch.distributed as dist

from model import DenseConfig, MixtralConfig, SwitchConfig, Transformer
from model.config import MoEConfig
from model.moe.layer import MoELayer
from model.parallel import comm
from model.parallel.groups import build_groups
from model.parallel.layers import take_shard
from training.run.spawn import run_ranks

SIZES = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
             ffn_hidden_size=48, max_seq_len=16, init_std=0.2)
TOL = dict(rtol=1e-5, atol=1e-5)
MLA = dict(SIZES, num_kv_heads=4, attention="mla", kv_lora_rank=10, qk_nope_head_dim=6,
           qk_rope_head_dim=4, v_head_dim=5)


def _configs():
    moe = dict(router_jitter=0.0, capacity_factor=None, eval_capacity_factor=None)
    return {
        "dense": DenseConfig(**SIZES).validate(),
        "dense_tied_1kv": DenseConfig(**{**SIZES, "num_kv_heads": 1, "tie_embeddings": True}).validate(),
        "switch": SwitchConfig(**SIZES, moe=MoEConfig(num_experts=4, top_k=1, normalize_top_k=False,
                                                      moe_layer_freq=2, **moe)).validate(),
        "mixtral": MixtralConfig(**SIZES, moe=MoEConfig(num_experts=4, top_k=2, **moe)).validate(),
        # DeepSeek-V3-style routing on a Mixtral-shaped model: sigmoid scores, an expert bias
        # (set non-zero by ``_set_expert_bias``), 2 of 4 groups kept, scaling, and 2 shared
        # experts (one FFN of 2 x 48) with Qwen2-MoE's gate.
        "deepseek": MixtralConfig(**SIZES, moe=MoEConfig(
            num_experts=8, top_k=2, score_function="sigmoid", n_group=4, topk_group=2,
            routed_scaling_factor=2.5, expert_bias_update_rate=1e-3, num_shared_experts=2,
            shared_expert_gate=True, **moe)).validate(),
        # Qwen3-MoE-style: per-head q/k norms, heads wider than hidden/heads (16, not 8),
        # fine-grained experts (inner 16) after one dense block.
        "qwen3": MixtralConfig(**SIZES, attn_head_dim=16, qk_norm=True, moe=MoEConfig(
            num_experts=8, top_k=4, expert_ffn_hidden_size=16, first_k_dense=1, **moe)).validate(),
        # Qwen2-MoE-style: q/k/v biases with one kv head (held whole by both tp ranks, so its
        # k/v bias gradient is summed over tp) and a gated shared expert.
        "qwen2": MixtralConfig(**{**SIZES, "num_kv_heads": 1}, qkv_bias=True, moe=MoEConfig(
            num_experts=4, top_k=2, normalize_top_k=False, num_shared_experts=1,
            shared_expert_gate=True, **moe)).validate(),
        # DeepSeek-V3's multi-head latent attention with its routing, a query latent, YaRN x2,
        # one ungated shared expert after a dense block, and two MTP depths (MoE blocks); and
        # MLA without a query latent on the dense family.
        "mla": MixtralConfig(**MLA, q_lora_rank=12, rope_scaling="yarn", rope_factor=2.0, mtp_depth=2,
                             rope_original_max_seq_len=8, yarn_mscale=1.0, yarn_mscale_all_dim=1.0,
                             moe=MoEConfig(num_experts=8, top_k=2, score_function="sigmoid", n_group=4,
                                           topk_group=2, routed_scaling_factor=2.5, first_k_dense=1,
                                           num_shared_experts=1, **moe)).validate(),
        "dense_mla": DenseConfig(**MLA).validate(),
    }


def _set_qwen_extras(ref, par) -> None:
    """Non-trivial q/k/v biases and q/k norm weights (init makes them 0 and 1): the reference's
    full tensor and this rank's shard of it, so init parity still holds."""
    ref_params = dict(ref.named_parameters())
    with torch.no_grad():
        for name, p in par.named_parameters():
            if name.endswith((".bias", "q_norm.weight", "k_norm.weight")):
                full = ref_params[name]
                full.copy_(1.0 + torch.linspace(-0.5, 0.5, full.numel()).view(full.shape))
                p.copy_(take_shard(full, p.shard_spec))


def _set_expert_bias(model) -> None:
    """A non-zero expert bias, the same in every model and layout, large enough to change the
    choice of experts (sigmoid scores lie in (0, 1))."""
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(torch.linspace(-0.3, 0.3, b.numel()).roll(int(name.split(".")[1]) + 1))


def _switch_with_jitter(jitter: float):
    """Switch (top-1, dropless) with router jitter: the routing depends on the noise."""
    moe = MoEConfig(num_experts=4, top_k=1, normalize_top_k=False, moe_layer_freq=2,
                    router_jitter=jitter, capacity_factor=None, eval_capacity_factor=None)
    return SwitchConfig(**SIZES, moe=moe).validate()


def _trainer_seed(groups, step: int = 1) -> int:
    """The trainer's per-step seed: the same on every rank of a data/pipeline replica (tp and ep
    ranks excluded), as the jitter noise needs to match the unsharded model's (``jitter_noise``)."""
    return 1234 * 1_000_003 + step * 7919 + groups.pp_rank * groups.dp + groups.dp_rank


def _run(model, ids, labels, seed):
    if seed is not None:
        torch.manual_seed(seed)
    return model(ids, labels)


def _check(cfg, groups, tag, checkpointing="none", seed=None):
    """``seed``: seed the default generators before each model's forward, as the trainer does
    each step (the router jitter draws from them); then the loss must match to 1e-6 relative."""
    ref = Transformer(cfg, None, init_seed=7)
    par = Transformer(cfg, groups, init_seed=7)
    _set_expert_bias(ref), _set_expert_bias(par)
    _set_qwen_extras(ref, par)
    par.set_activation_checkpointing(checkpointing)    # recompute re-issues the collectives
    ref_params = dict(ref.named_parameters())
    for name, p in par.named_parameters():               # init parity at this layout
        assert torch.equal(p, take_shard(ref_params[name].detach(), p.shard_spec)), (tag, name)

    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(0, cfg.vocab_size, (4, 16), generator=gen)
    labels = torch.randint(0, cfg.vocab_size, (4, 16), generator=gen)
    seen = []   # the residual stream a block receives: (B, S/tp, H) under sequence parallelism
    par.layers[1].register_forward_pre_hook(lambda mod, args: seen.append(args[0].shape))
    out_ref, out_par = _run(ref, ids, labels, seed), _run(par, ids, labels, seed)
    split = groups.tp if groups.sequence_parallel else 1
    assert seen == [(4 // groups.ep, 16 // split, cfg.hidden_size)], (tag, seen)
    # Mean over the micro-batch's 64 target tokens, so values and gradients are O(1).
    loss_ref = (out_ref.ce_sum + ref.mtp_objective(out_ref)) / 64 + ref.router_loss(out_ref)
    loss_par = (out_par.ce_sum + par.mtp_objective(out_par)) / 64 + par.router_loss(out_par)
    loss_ref.backward()
    loss_par.backward()
    if seed is not None:      # an ep rank's loss is its share of the micro-batch's
        total = comm.all_reduce_sum(loss_par.detach().clone(), groups.ep_group)
        assert abs(total - loss_ref).item() <= 1e-6 * abs(loss_ref).item(), (tag, total, loss_ref)

    # The ce of an ep rank covers its slice of the batch; tp ranks each hold the full value.
    ce = comm.all_reduce_sum(out_par.ce_sum.detach().clone(), groups.ep_group)
    torch.testing.assert_close(ce, out_ref.ce_sum.detach(), **TOL, msg=tag)
    assert len(out_par.mtp_ce_sum) == len(out_ref.mtp_ce_sum) == cfg.mtp_depth
    for depth, (got, want) in enumerate(zip(out_par.mtp_ce_sum, out_ref.mtp_ce_sum), 1):
        got = comm.all_reduce_sum(got.detach().clone(), groups.ep_group)
        torch.testing.assert_close(got, want.detach(), **TOL, msg=f"{tag} mtp depth {depth}")
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
    _check(cfgs["deepseek"], ep2, "ep2/deepseek")
    _check(cfgs["deepseek"], ep2, "ep2/deepseek/moe-checkpointing", "moe")
    _check(cfgs["qwen3"], ep2, "ep2/qwen3")
    _check(cfgs["qwen2"], ep2, "ep2/qwen2")
    _check(cfgs["mla"], ep2, "ep2/mla")
    _check(cfgs["mla"], sp, "tp2-sp/mla/attention-checkpointing", "attention")
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
    _jitter_two_ranks(tp2, sp, ep2)


def _jitter_two_ranks(tp2, sp, ep2):
    """Router jitter: with the trainer's seeds every layout routes as the unsharded model (the
    recomputation of a checkpointed block too); seeded per tp rank, tp peers route differently,
    which ``replica_divergence`` shows, as it shows a drifted router weight."""
    seed = _trainer_seed(tp2)
    for jitter in (0.01, 0.5):
        cfg = _switch_with_jitter(jitter)
        _check(cfg, tp2, f"tp2/switch-jitter-{jitter}", seed=seed)
        _check(cfg, sp, f"tp2-sp/switch-jitter-{jitter}", seed=seed)
        _check(cfg, ep2, f"ep2/switch-jitter-{jitter}", seed=seed)
    cfg = _switch_with_jitter(0.5)
    _check(cfg, sp, "tp2-sp/switch-jitter/full-checkpointing", "full", seed=seed)
    _check(cfg, tp2, "tp2/switch-jitter/moe-checkpointing", "moe", seed=seed)

    model = Transformer(cfg, tp2, init_seed=7)
    ids = torch.randint(0, cfg.vocab_size, (4, 16), generator=torch.Generator().manual_seed(3))
    routers = [m.gate.weight for m in model.modules() if isinstance(m, MoELayer)]

    def routing_divergence(seed):
        aux = _run(model, ids, ids, seed).moe_aux
        return comm.replica_divergence([a.routed_per_expert for a in aux], tp2.tp_group).item()
    assert routing_divergence(seed) == 0.0
    assert routing_divergence(seed + tp2.tp_rank) > 0       # seeded per tp rank: peers diverge
    assert comm.replica_divergence(routers, tp2.tp_group).item() == 0.0
    with torch.no_grad():
        routers[0][0, 0] += 1e-3 * tp2.tp_rank
    assert comm.replica_divergence(routers, tp2.tp_group).item() >= 0.9e-3


def _four_ranks(rank, world):
    cfgs = _configs()
    g = build_groups(tp=2, ep=2)
    assert (g.tp_rank, g.ep_rank) == (rank % 2, rank // 2)
    _check(cfgs["mixtral"], g, "tp2xep2/mixtral")
    _check(cfgs["dense"], g, "tp2xep2/dense")
    sp = build_groups(tp=2, ep=2, sequence_parallel=True)
    _check(cfgs["mixtral"], sp, "tp2xep2-sp/mixtral")
    _check(cfgs["deepseek"], sp, "tp2xep2-sp/deepseek")
    _check(cfgs["qwen3"], sp, "tp2xep2-sp/qwen3")
    _check(cfgs["mla"], sp, "tp2xep2-sp/mla")
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
    # Context parallelism, rank order tp, ep, cp, dp: cp 2 x dp 2, then ep 2 x cp 2. DeepSpeed's
    # data parallelism (the mpu) is dp x cp; the data shards over dp.
    cp = build_groups(cp=2)
    assert (cp.cp_rank, cp.dp_rank) == (rank % 2, rank // 2)
    assert total(cp.cp_group) == {0: 1, 1: 1, 2: 5, 3: 5}[rank]
    assert total(cp.dp_group) == {0: 2, 1: 4, 2: 2, 3: 4}[rank]
    assert total(cp.get_data_parallel_group()) == total(cp.batch_group) == 6
    assert (cp.get_data_parallel_world_size(), cp.get_data_parallel_rank()) == (4, rank)
    ecp = build_groups(ep=2, cp=2)
    assert (ecp.ep_rank, ecp.cp_rank) == (rank % 2, rank // 2) and ecp.dp_group is None
    assert total(ecp.cp_group) == total(ecp.get_data_parallel_group()) == {0: 2, 1: 4, 2: 2, 3: 4}[rank]
    assert total(ecp.ep_cp_group) == total(ecp.batch_group) == 6
    assert (ecp.get_data_parallel_world_size(), ecp.get_data_parallel_rank()) == (2, rank // 2)
    for jitter in (0.01, 0.5):                                # router jitter, trainer's seeds
        _check(_switch_with_jitter(jitter), g, f"tp2xep2/switch-jitter-{jitter}", seed=_trainer_seed(g))
    _check(_switch_with_jitter(0.5), sp, "tp2xep2-sp/switch-jitter", seed=_trainer_seed(sp))


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


def test_shared_experts_and_expert_bias_merge_back_into_the_full_model():
    """The shared experts' tp shards merge like the MLP's; the expert bias (a persistent buffer,
    the same on every rank) is carried into the merged state dict."""
    from interop.consolidate import merge_model_parallel
    from model.parallel.groups import ParallelGroups
    cfg = _configs()["deepseek"]
    reference = Transformer(cfg, init_seed=5)
    _set_expert_bias(reference)
    ref = reference.state_dict()
    assert "layers.0.mlp.gate.e_score_correction_bias" in ref
    shards = {}
    for ep_rank in range(2):
        for tp_rank in range(2):
            model = Transformer(cfg, ParallelGroups(tp=2, ep=2, tp_rank=tp_rank, ep_rank=ep_rank),
                                init_seed=5)
            _set_expert_bias(model)
            shards[ep_rank * 2 + tp_rank] = model.state_dict()
    world = {"tensor_parallel_size": 2, "expert_parallel_size": 2}
    full = merge_model_parallel(cfg, world, shards)
    assert full.keys() == ref.keys()
    for name, t in ref.items():
        assert torch.equal(full[name], t), name
