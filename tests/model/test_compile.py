"""``train.compile`` (training/engine/compile.py): compiled blocks train as eager ones, the MoE block is
one graph, and the custom ops that keep it one graph compute what eager computes.

One process for the whole file, tiny fp32 models on CPU. Every test starts from an empty dynamo
cache (``torch._dynamo.reset``), so that no test reuses another's graphs or counts its
compilations; inductor's on-disk cache still makes a graph compiled before cheap to rebuild.
"""

import pytest
import torch

from model import DenseConfig, MixtralConfig, Transformer
from model.config import MoEConfig
from model.document_mask import attention_inputs
from model.moe import experts
from model.moe.experts import grouped_mm
from training.engine.compile import compile_blocks

SIZES = dict(vocab_size=96, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
             ffn_hidden_size=48, max_seq_len=16)
STEPS = 20


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _losses(cfg, compiled: bool) -> torch.Tensor:
    """(STEPS,) losses of a plain AdamW loop on ``Transformer(cfg)``, blocks compiled or not."""
    model = compile_blocks(Transformer(cfg, init_seed=0), compiled)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        ids = torch.randint(0, cfg.vocab_size, (2, cfg.max_seq_len + 1), generator=g)
        out = model(ids[:, :-1], ids[:, 1:])
        loss = out.loss + model.router_loss(out)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses)


@pytest.mark.parametrize("cls", [DenseConfig, MixtralConfig])
def test_compiled_blocks_train_as_eager(cls):
    """20 fp32 AdamW steps, compiled within 1e-5 relative of eager at every step.

    Why 1e-5: inductor fuses the pointwise ops and reorders fp32 reductions (the norms' means,
    the softmaxes, the residual adds), so a compiled block differs from eager by a few ulps, and
    20 AdamW steps at lr 1e-2 carry that into the weights: measured 1.1e-7 (dense) and 3.1e-7
    (Mixtral) at worst over the 20 losses, 30x below the bound. A compiled block that computes
    something else (another routing, a missing gradient, a stale weight) is off by 1e-3 or more
    within a few steps.
    """
    cfg = cls(**SIZES).validate()
    eager = _losses(cfg, compiled=False)
    stats = torch._dynamo.utils.counters["stats"]
    before = stats["unique_graphs"]
    compiled = _losses(cfg, compiled=True)
    # Both layers ran compiled, from one graph: the second block reuses the first one's code.
    assert stats["unique_graphs"] - before == 1
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=0)
    assert not torch.equal(compiled[1:], compiled[:-1])          # it trained


def _block_and_inputs(moe: MoEConfig):
    cfg = MixtralConfig(**SIZES, moe=moe).validate()
    model = Transformer(cfg, init_seed=0).train()
    x = torch.randn(2, cfg.max_seq_len, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    rope, mask = attention_inputs(model.rotary, cfg.max_seq_len, x, None)
    return model.layers[0], x, rope, mask


GRAPH_CASES = {
    # The contract: Mixtral routing, top-2, dropless, one process (ep 1).
    "mixtral dropless": MoEConfig(num_experts=8, top_k=2, capacity_factor=None),
    # Switch routing: capacity drops, and the jitter's host seed.
    "switch capacity+jitter": MoEConfig(num_experts=4, top_k=1, capacity_factor=1.0,
                                        normalize_top_k=False, router_jitter=0.1),
}


@pytest.mark.parametrize("case", sorted(GRAPH_CASES))
def test_moe_block_compiles_to_one_graph(case):
    """No graph break in a training MoE block at ep 1, counted by dynamo itself. Fails on the
    eager-only code: its grouped GEMM reads ``data_ptr()`` and catches the kernel's refusal, and
    the jitter reads its seed with ``.item()``; each would split the block."""
    block, x, rope, mask = _block_and_inputs(GRAPH_CASES[case])
    explained = torch._dynamo.explain(block)(x, rope, mask)
    reasons = [str(r.reason) for r in explained.break_reasons]
    assert explained.graph_break_count == 0, reasons
    assert explained.graph_count == 1


@pytest.mark.parametrize("policy", ["moe", "experts"])
def test_compiled_checkpointed_moe_block_routes_as_eager(policy):
    """With the router's jitter and a checkpoint inside the compiled block (``moe``: the router
    and the experts; ``experts``: the grouped GEMMs' custom ops only), the compiled backward
    recomputes the same noise and routing: gradients bitwise equal to eager.

    The ``aot_eager`` backend runs the same ATen ops as eager through the same graph capture,
    partitioner and checkpoint handling as inductor, so any difference would come from the graph
    (a noise drawn again on recomputation, another routing), not from fused arithmetic: exact
    equality is the test. Two forwards and backwards: the second draws a new base seed."""
    cfg = MixtralConfig(**SIZES, moe=MoEConfig(num_experts=4, top_k=2, capacity_factor=1.0,
                                               router_jitter=0.1)).validate()
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.max_seq_len), generator=torch.Generator().manual_seed(1))
    grads = []
    for compiled in (False, True):
        model = Transformer(cfg, init_seed=0)
        model.set_activation_checkpointing(policy)
        for block in model.layers if compiled else []:     # as compile_blocks, on aot_eager
            block.forward = torch.compile(block.forward, backend="aot_eager", dynamic=False)
        torch.manual_seed(7)
        for _ in range(2):
            out = model(ids, ids)
            (out.ce_sum + model.router_loss(out)).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, g in grads[0].items():
        assert torch.equal(grads[1][name], g), name


@pytest.mark.parametrize("path", ["kernel", "loop"])
def test_grouped_mm_op_matches_eager(path, monkeypatch):
    """``moe::grouped_mm`` (what a compiled block calls) against the eager ``grouped_mm``,
    forward and both gradients, with empty experts and dropped rows past the last group:
    bitwise on the kernel (its backward is ATen's own), to 1e-6 on the loop. ``opcheck`` checks
    the op's schema, fake (meta) function and autograd registration against its real run."""
    monkeypatch.setattr(experts, "_UNSUPPORTED", set())
    if path == "loop":
        monkeypatch.setattr(experts, "_GROUPED_MM", None)
    elif experts._GROUPED_MM is None:
        pytest.skip(f"torch {torch.__version__} has no grouped_mm")
    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([0, 5, 3, 0, 8])
    x = torch.randn(20, 16, generator=g, requires_grad=True)           # 4 rows past the groups
    w = torch.randn(5, 16, 8, generator=g, requires_grad=True)
    dy = torch.randn(20, 8, generator=g)
    dy[16:] = 0.0                  # the dropped rows' output is unspecified: no gradient reaches it
    results = []
    for fn in (grouped_mm, torch.ops.moe.grouped_mm):
        y = fn(x, w, counts)
        results.append((y[:16], *torch.autograd.grad(y, (x, w), dy)))
    (y0, dx0, dw0), (y1, dx1, dw1) = results
    exact = dict(rtol=0, atol=0) if path == "kernel" else dict(rtol=1e-6, atol=1e-6)
    for got, want in ((y1, y0), (dx1[:16], dx0[:16]), (dw1, dw0)):
        torch.testing.assert_close(got, want, **exact)
    assert torch.all(dw1[0] == 0) and torch.all(dw1[3] == 0)            # the empty experts
    # opcheck compares whole outputs: without the rows past the groups, which are unspecified.
    kept = x[:16].detach().requires_grad_()
    torch.library.opcheck(torch.ops.moe.grouped_mm, (kept, w, counts))
    torch.library.opcheck(torch.ops.moe.grouped_mm_wgrad, (kept.detach(), dy[:16], counts))


def test_trainer_compiles_blocks_in_place():
    """``training.engine.build.build_model``, the trainer's model before ``deepspeed.initialize``: with
    ``train.compile`` each block's forward is compiled in place (parameter names unchanged, so
    checkpoints, shard maps and ``--init-from`` keep their keys); off, the default, nothing is.
    Under ZeRO-3 each block is also a ZeRO-3 leaf (its hooks gather it whole around the graph)."""
    from training.engine.build import build_model
    from training.config.recipe import load_recipe
    sizes = [f"model.{k}={v}" for k, v in SIZES.items() if k != "vocab_size"]
    small = sizes + ["model.vocab_size=512", "tokenizer.vocab_size=512", "data.seq_len=16"]
    models = {flag: build_model(load_recipe(None, small + [f"train.compile={flag}"]), None, None)
              for flag in ("false", "true")}

    def compiled(block):
        return hasattr(block.forward, "_torchdynamo_orig_callable")
    assert [compiled(b) for b in models["true"].layers] == [True, True]
    assert not any(compiled(b) for b in models["false"].layers)
    assert list(models["true"].state_dict()) == list(models["false"].state_dict())
    assert load_recipe(None).train.compile is False
    zero3 = compile_blocks(Transformer(MixtralConfig(**SIZES).validate()), True,
                           {"zero_optimization": {"stage": 3}})
    assert [getattr(b, "_z3_leaf", False) for b in zero3.layers] == [True, True]
    assert not any(hasattr(b, "_z3_leaf") for b in models["true"].layers)   # ZeRO-0/1/2
