"""Router jitter and token dropping under context parallelism against one process, per token.

Spawned once on 2 gloo ranks (CP2, a2a, fp32). For a Switch-style router (top-1, raw
probability, jitter 0.5, capacity factor 1.0) and a Mixtral one (top-2, renormalized, jitter
0.1, capacity 1.0, eval capacity 1.0) in a 2-layer MoE model, every rank's default generator
is seeded as the trainer seeds the cp ranks of one data-parallel replica (the step's seed: the
trainer's per-step seed leaves out tp, ep and cp), and the single process's alike. Then, in
training mode:

* ``jitter_noise`` at CP2 is, row for row, rank r's ``split_for_cp`` of the single process's
  noise for the whole samples (bitwise: the same draws, copied);
* every MoE layer drops the same tokens (capacity counted on the whole sequences: each rank's
  dropped count summed over cp equals the single process's, which is > 0) and routes them the
  same way (the routed counts summed over cp, equal);
* the logits (gathered back into window order), the cross-entropy sum, the aux and z losses and
  every parameter's gradient (summed over cp, as DeepSpeed does over dp x cp) equal the single
  process's;
* in eval mode (no jitter, ``eval_capacity_factor``) the logits again.

Tolerance: relative 1e-5, absolute 1e-6 on gradients (fp32). The routing decisions are equal,
so only the order of fp32 sums differs (attention's exchange, the cp ranks' gradient parts added
in another order; measured below 1e-6 relative). A token given another rank's noise, or dropped
by a per-rank capacity, changes its expert: its logits move by O(init_std), far outside this.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from model import MixtralConfig, Transformer
from model.config import MoEConfig
from model.moe.router import jitter_noise
from model.parallel.cp_layout import gather_from_cp, split_for_cp
from model.parallel.groups import build_groups
from training.run.spawn import run_ranks

TOL = dict(rtol=1e-5, atol=1e-6)
SIZES = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
             ffn_hidden_size=48, max_seq_len=32, init_std=0.2, tie_embeddings=False)
ROUTERS = {
    "switch": MoEConfig(num_experts=4, top_k=1, normalize_top_k=False, router_jitter=0.5,
                        capacity_factor=1.0, eval_capacity_factor=1.0),
    "mixtral": MoEConfig(num_experts=4, top_k=2, router_jitter=0.1, capacity_factor=1.0,
                         eval_capacity_factor=1.0),
}
SEED = 1234          # the step's seed, the same on the cp ranks of a replica


def _run(model, ids, seed: int):
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    out = model(ids, ids)
    (out.ce_sum / ids.numel() + model.router_loss(out)).backward()
    dropped = torch.stack([a.dropped_frac for a in out.moe_aux])          # (L,) this rank's share
    routed = torch.stack([a.routed_per_expert for a in out.moe_aux])      # (L, E)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return out, dropped, routed, grads


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def _ranks(rank: int, world: int) -> None:
    torch.set_num_threads(1)
    groups = build_groups(cp=world, cp_comm="a2a")
    ids = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(5))   # (B, S)

    # The noise itself: the control's whole-sample draw, split.
    torch.manual_seed(SEED)
    whole = jitter_noise((2 * 32, 16), 0.5, torch.device("cpu"), 3, 2).view(2, 32, 16)
    torch.manual_seed(SEED)
    mine = jitter_noise((2 * 16, 16), 0.5, torch.device("cpu"), 3, 2, world, rank)
    assert torch.equal(mine.view(2, 16, 16), split_for_cp(whole, world, rank, 1)), "jitter noise"

    for name, moe in ROUTERS.items():
        cfg = MixtralConfig(**SIZES, moe=moe).validate()
        control = Transformer(cfg, init_seed=3).train()
        model = Transformer(cfg, groups, init_seed=3).train()
        ref, ref_dropped, ref_routed, ref_grads = _run(control, ids, SEED)
        out, dropped, routed, grads = _run(model, ids, SEED)
        assert (ref_dropped > 0).all(), (name, ref_dropped)                 # the capacity drops
        # Every value is this rank's share (the router losses too, see MoEAux): sum over cp.
        sums = [dropped, routed, *(getattr(out, k).detach() for k in ("ce_sum", "aux_loss", "z_loss"))]
        for t in (*sums, *grads.values()):
            dist.all_reduce(t, group=groups.cp_group)
        torch.testing.assert_close(dropped, ref_dropped, rtol=1e-6, atol=0, msg=f"{name}: dropped")
        assert torch.equal(routed, ref_routed), (name, routed, ref_routed)
        logits = gather_from_cp(out.logits.detach(), groups.cp_group)
        torch.testing.assert_close(logits, ref.logits.detach(), **TOL, msg=f"{name}: logits")
        for key, got in zip(("ce_sum", "aux_loss", "z_loss"), sums[2:]):
            torch.testing.assert_close(got, getattr(ref, key).detach(), **TOL, msg=f"{name}: {key}")
        for n, g in ref_grads.items():
            torch.testing.assert_close(grads[n], g, **TOL, msg=f"{name}: grad {n}")
        worst = max(_relative(logits, ref.logits.detach()),
                    *(_relative(grads[n], g) for n, g in ref_grads.items()))
        if rank == 0:
            print(f"{name}: largest relative difference (logits, gradients) {worst:.2e}")

        control.eval(), model.eval()
        with torch.no_grad():
            want = control(ids, ids).logits
            got = gather_from_cp(model(ids, ids).logits, groups.cp_group)
        torch.testing.assert_close(got, want, **TOL, msg=f"{name}: eval logits")


def test_cp2_jitter_and_capacity_drop_route_every_token_as_one_process():
    run_ranks(_ranks, 2, timeout=180)
