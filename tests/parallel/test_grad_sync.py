"""``ReplicaGradSync`` on 2 gloo ranks (EP2, then TP2 with sequence parallelism, one spawn).

* "step" mode over 3 micro-batches (sums only at the boundary's backward, in buckets) gives the
  same gradients as "micro_batch" mode (a sum per parameter per backward), to fp32 rounding of
  summing in another order (1e-6).
* Nothing the autograd graph saves in forward is a view of a parameter (an autograd op on the
  parameter, e.g. ``param.view_as(param)``, would save one): a saved tensor sharing a parameter's
  storage must be the
  parameter itself, whose storage ZeRO-3 swaps out after forward (``param.data`` replaced by an
  empty tensor) and gathers again for backward; a view would keep the gathered tensor alive.
  Checked with ``F.linear`` replaced as ``deepspeed.zero.Init`` replaces it (its
  memory-efficient linear saves the weight itself, not ``weight.t()``).
"""

import torch

from model import MixtralConfig, Transformer
from model.config import MoEConfig
from model.parallel.groups import build_groups
from training.run.spawn import run_ranks

SIZES = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=1,
             ffn_hidden_size=48, max_seq_len=16, init_std=0.2, tie_embeddings=True)


def _cfg():
    moe = MoEConfig(num_experts=4, top_k=2, router_jitter=0.0, capacity_factor=None,
                    eval_capacity_factor=None)
    return MixtralConfig(**SIZES, moe=moe).validate()


def _batches(n):
    gen = torch.Generator().manual_seed(7)         # the same micro-batches on every rank
    return [(torch.randint(0, 64, (4, 16), generator=gen), torch.randint(0, 64, (4, 16), generator=gen))
            for _ in range(n)]


def _grads(model, mode, batches):
    model.grad_sync.mode = mode
    model.zero_grad(set_to_none=True)
    for i, (ids, labels) in enumerate(batches):
        model.grad_sync.boundary = i == len(batches) - 1
        out = model(ids, labels)
        (out.ce_sum / 100 + model.router_loss(out)).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _saved_views_of_params(model, ids, labels) -> list[str]:
    storages = {p.untyped_storage().data_ptr(): (n, p) for n, p in model.named_parameters()}
    views = []

    def pack(t):
        hit = storages.get(t.untyped_storage().data_ptr()) if t.numel() else None
        if hit is not None and t is not hit[1]:
            views.append(hit[0])
        return t

    from deepspeed.runtime.zero.linear import zero3_linear_wrap
    linear = torch.nn.functional.linear
    torch.nn.functional.linear = zero3_linear_wrap        # as zero.Init does
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(ids, labels)
    finally:
        torch.nn.functional.linear = linear
    return views


def _body(rank, world):
    cfg = _cfg()
    for layout in (dict(ep=2), dict(tp=2, sequence_parallel=True)):
        groups = build_groups(**layout)
        model = Transformer(cfg, groups, init_seed=0).train()
        marked = {n: p.grad_sum_over for n, p in model.named_parameters()
                  if getattr(p, "grad_sum_over", None)}
        if groups.ep > 1:      # everything outside the experts, over ep
            assert set(marked) == {n for n, _ in model.named_parameters() if ".experts." not in n}
        else:                  # under SP: the norms and the single kv head, over tp
            assert set(marked.values()) == {"tp"} and all(
                n.endswith(("norm.weight", "k_proj.weight", "v_proj.weight")) for n in marked), marked
        batches = _batches(3)
        per_micro_batch = _grads(model, "micro_batch", batches)
        per_step = _grads(model, "step", batches)
        for n, g in per_micro_batch.items():
            torch.testing.assert_close(per_step[n], g, rtol=1e-6, atol=1e-6, msg=lambda m, n=n: f"{layout} {n}: {m}")
        views = _saved_views_of_params(model, *batches[0])
        assert not views, f"{layout}: forward saved views of {sorted(set(views))}"


def test_step_mode_equals_micro_batch_mode_and_no_parameter_views_saved():
    run_ranks(_body, 2)
