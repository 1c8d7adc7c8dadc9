"""MoE routing semantics (docs/routers-and-top-k.md), single process, fp32 unless stated."""

import math

import pytest
import torch
import torch.nn.functional as F

from model.config import MoEConfig, SwitchConfig
from model.moe import dispatcher, losses
from model.moe.experts import _looped_mm, grouped_mm
from model.moe.layer import MoELayer, load_balancing_losses
from model.moe.router import route
from model.transformer import MLP

H, I = 16, 24


def _layer(moe: MoEConfig, seed: int = 0) -> MoELayer:
    torch.manual_seed(seed)
    layer = MoELayer(moe, H, I)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return layer


def test_aux_loss_is_one_at_perfect_balance():
    # Uniform probabilities and equal counts: E/(kT) * E * (kT/E) * (1/E) = 1.
    T, E, k = 12, 4, 2
    probs = torch.full((T, E), 1.0 / E)
    counts = torch.full((E,), k * T // E)
    assert losses.load_balancing_loss(probs, counts, k).item() == pytest.approx(1.0, abs=1e-7)
    # Non-uniform per-token probabilities whose mean is uniform also give exactly 1.
    probs = torch.tensor([[0.7, 0.1, 0.1, 0.1], [0.1, 0.7, 0.1, 0.1],
                          [0.1, 0.1, 0.7, 0.1], [0.1, 0.1, 0.1, 0.7]])
    assert losses.load_balancing_loss(probs, torch.tensor([2, 2, 2, 2]), 2).item() == pytest.approx(1.0)


def test_aux_and_z_loss_hand_computation_on_fixed_logits():
    logits = torch.tensor([[2.0, 1.0, 0.0],
                           [0.0, 3.0, 1.0],
                           [1.0, 1.0, 1.0],
                           [0.5, 0.0, 2.5]])
    T, E, k = 4, 3, 2
    probs = torch.softmax(logits, -1)
    _, idx = probs.topk(k, -1)
    # Hand computation with Python loops (independent of the vectorised code).
    counts = [0] * E
    for t in range(T):
        for e in idx[t].tolist():
            counts[e] += 1
    mean_prob = [sum(probs[t, e].item() for t in range(T)) / T for e in range(E)]
    expected = E / (k * T) * sum(c * p for c, p in zip(counts, mean_prob))
    got = losses.load_balancing_loss(probs, torch.tensor(counts), k)
    assert got.item() == pytest.approx(expected, rel=1e-6)
    # transformers' Mixtral loss on the same logits is k times ours (it sums the top-k one-hot
    # fractions without dividing by k); check against it as an outside reference.
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
    hf = load_balancing_loss_func((logits,), num_experts=E, top_k=k)
    assert got.item() == pytest.approx(hf.item() / k, rel=1e-6)
    z_expected = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in logits.tolist()) / T
    assert losses.router_z_loss(logits).item() == pytest.approx(z_expected, rel=1e-6)


def test_dispatch_plan_matches_written_table():
    # The docstring example of dispatcher.py.
    expert_idx = torch.tensor([[0, 1], [0, 2], [0, 1], [2, 0]])
    plan = dispatcher.plan_dispatch(expert_idx, num_experts=3, capacity=2)
    # k*T rows whatever the capacity keeps: the 6 kept by expert, then the 2 dropped.
    assert plan.token_idx.tolist() == [0, 1, 0, 2, 3, 1, 2, 3]
    assert plan.slot_idx.tolist() == [0, 0, 1, 1, 0, 1, 0, 1]
    assert plan.row_kept.tolist() == [True] * 6 + [False] * 2
    assert plan.kept_per_expert.tolist() == [2, 2, 2]
    assert plan.routed_per_expert.tolist() == [4, 2, 2]
    assert plan.num_dropped.item() == 2
    dropless = dispatcher.plan_dispatch(expert_idx, num_experts=3)
    assert dropless.token_idx.tolist() == [0, 1, 2, 3, 0, 2, 3, 1]
    assert dropless.kept_per_expert.tolist() == [4, 2, 2] and dropless.row_kept is None


def test_switch_capacity_drops_exactly_the_rule():
    # Router = identity on the first E features, so token t goes to expert argmax(x_t[:E]).
    E = 4
    moe = MoEConfig(num_experts=E, top_k=1, capacity_factor=1.0, eval_capacity_factor=1.0,
                    normalize_top_k=False)
    layer = _layer(moe)
    with torch.no_grad():
        layer.gate.weight.zero_()
        layer.gate.weight[:, :E] = torch.eye(E) * 10
    # 8 tokens -> capacity ceil(1*8/4*1.0) = 2 per expert.
    targets = [0, 0, 0, 1, 2, 0, 3, 1]
    #  token:  0  1  2  3  4  5  6  7
    #  expert 0 gets tokens 0, 1, 2, 5 -> keeps 0, 1; drops 2, 5 (position 3 and 4 in line)
    #  expert 1 gets 3, 7; expert 2 gets 4; expert 3 gets 6: all kept
    expected_dropped = [2, 5]
    x = torch.randn(1, 8, H) * 0.1
    for t, e in enumerate(targets):
        x[0, t, e] = 1.0
    layer.eval()
    out, aux = layer(x)
    dropped = [t for t in range(8) if torch.all(out[0, t] == 0)]
    assert dropped == expected_dropped
    assert aux.dropped_frac.item() == pytest.approx(2 / 8)
    assert aux.routed_per_expert.tolist() == [4, 2, 1, 1]
    # Kept tokens are scaled by the raw top-1 probability (no renormalization).
    probs = torch.softmax(x[0].float() @ layer.gate.weight.t(), -1)
    t = 3
    mlp_out = layer.experts(x[0, t:t + 1], torch.tensor([0, 1, 0, 0]))
    assert torch.allclose(out[0, t], mlp_out[0] * probs[t, 1], atol=1e-6)


def test_switch_with_one_expert_equals_dense_mlp():
    moe = MoEConfig(num_experts=1, top_k=1, capacity_factor=None, normalize_top_k=False)
    layer = _layer(moe)
    mlp = MLP(H, I)
    with torch.no_grad():
        mlp.gate_proj.weight.copy_(layer.experts.gate_proj[0].t())
        mlp.up_proj.weight.copy_(layer.experts.up_proj[0].t())
        mlp.down_proj.weight.copy_(layer.experts.down_proj[0].t())
    x = torch.randn(2, 5, H)
    out, aux = layer(x)
    # One expert: softmax over one logit is exactly 1.0, so the combine weight is exactly 1.
    torch.testing.assert_close(out, mlp(x), rtol=1e-6, atol=1e-6)
    assert load_balancing_losses([aux]).item() == pytest.approx(1.0)


def test_dropless_equals_infinite_capacity():
    x = torch.randn(2, 16, H)
    dropless = _layer(MoEConfig(num_experts=4, top_k=2, capacity_factor=None))
    # A capacity factor of E makes capacity k*T, more than any expert can receive: the capacity
    # code path runs but drops nothing.
    big = _layer(MoEConfig(num_experts=4, top_k=2, capacity_factor=4.0))
    big.load_state_dict(dropless.state_dict())
    a, aux_a = dropless(x)
    b, aux_b = big(x)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert aux_b.dropped_frac.item() == 0.0
    assert MoEConfig(capacity_factor=math.inf).capacity(100, training=True) is None


def test_jitter_only_in_training():
    moe = MoEConfig(num_experts=4, top_k=1, normalize_top_k=False, router_jitter=0.5)
    layer = _layer(moe)
    clean = _layer(MoEConfig(num_experts=4, top_k=1, normalize_top_k=False, router_jitter=0.0))
    clean.load_state_dict(layer.state_dict())
    x = torch.randn(1, 64, H)
    layer.eval(), clean.eval()
    torch.testing.assert_close(layer(x)[0], clean(x)[0], rtol=0, atol=0)
    layer.train(), clean.train()
    torch.manual_seed(1)
    noisy = layer(x)[0]
    assert not torch.allclose(noisy, clean(x)[0])


def test_router_math_is_fp32_under_bf16():
    layer = _layer(MoEConfig(num_experts=8, top_k=2)).to(torch.bfloat16)
    x = torch.randn(3, 8, H, dtype=torch.bfloat16)
    r = route(x.reshape(-1, H), layer.gate.weight, 2, True)
    assert r.logits.dtype == r.probs.dtype == r.weights.dtype == torch.float32
    ref = x.reshape(-1, H).float() @ layer.gate.weight.float().t()
    torch.testing.assert_close(r.logits, ref, rtol=1e-6, atol=1e-6)
    # The bf16 logits would differ: the fp32 path is not a no-op.
    assert not torch.equal(F.linear(x.reshape(-1, H), layer.gate.weight).float(), r.logits)
    out, aux = layer(x)
    assert out.dtype == torch.bfloat16
    assert aux.z_loss.dtype == load_balancing_losses([aux]).dtype == torch.float32


@pytest.fixture
def grouped_mm_paths(monkeypatch):
    """Counts which path ``grouped_mm`` takes: the grouped kernel or the per-expert loop (with a
    fresh record of unsupported cases, so that an earlier test's fallback does not decide)."""
    from model.moe import experts
    calls = {"kernel": 0, "loop": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper
    if experts._GROUPED_MM is not None:
        monkeypatch.setattr(experts, "_GROUPED_MM", counted("kernel", experts._GROUPED_MM))
    monkeypatch.setattr(experts, "_looped_mm", counted("loop", experts._looped_mm))
    monkeypatch.setattr(experts, "_UNSUPPORTED", set())
    return calls


def _kernel_unavailable(x, w, counts) -> str | None:
    """Why torch's grouped kernel cannot compute this product here, or None when it can."""
    from model.moe import experts
    kernel = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    if kernel is None:
        return f"torch {torch.__version__} has no grouped_mm"
    try:
        kernel(x.detach(), w.detach(), offs=torch.cumsum(counts, 0, dtype=torch.int32))
    except RuntimeError as err:
        return f"torch {torch.__version__}'s grouped_mm fails on {x.device.type} {x.dtype}: {err}"
    assert experts._GROUPED_MM is not None
    return None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_matches_loop_including_empty_experts(dtype, grouped_mm_paths):
    # Rows of 16 elements: 64 bytes (fp32) and 32 bytes (bf16), aligned as the CPU kernel wants.
    torch.manual_seed(0)
    counts = torch.tensor([0, 5, 3, 0, 8])
    x = torch.randn(int(counts.sum()), 16, dtype=dtype, requires_grad=True)
    w = torch.randn(5, 16, 8, dtype=dtype, requires_grad=True)
    y = grouped_mm(x, w, counts)
    taken = dict(grouped_mm_paths)
    ref = _looped_mm(x, w, counts)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y, ref, rtol=tol, atol=tol)
    g = torch.randn_like(y)
    gx, gw = torch.autograd.grad(y, (x, w), g)
    rx, rw = torch.autograd.grad(ref, (x, w), g)
    torch.testing.assert_close(gx, rx, rtol=tol, atol=tol)
    torch.testing.assert_close(gw, rw, rtol=tol, atol=tol)
    assert torch.all(gw[0] == 0) and torch.all(gw[3] == 0)
    # The product above was the kernel's, not the loop's, wherever the kernel can compute it.
    why_not = _kernel_unavailable(x, w, counts)
    if why_not is not None:
        assert taken == {"kernel": taken["kernel"], "loop": 1}
        pytest.skip(f"the loop fallback was checked; not the kernel: {why_not}")
    assert taken == {"kernel": 1, "loop": 0}


def test_mixtral_layer_matches_per_token_reference():
    # Reference: for each token, sum over its top-2 experts of renormalized prob * SwiGLU_e(x).
    layer = _layer(MoEConfig(num_experts=4, top_k=2))
    x = torch.randn(1, 6, H)
    out, _ = layer(x)
    probs = torch.softmax(x[0] @ layer.gate.weight.t(), -1)
    for t in range(6):
        p, e = probs[t].topk(2)
        p = p / p.sum()
        ref = sum(p[j] * (F.silu(x[0, t] @ layer.experts.gate_proj[e[j]]) * (x[0, t] @ layer.experts.up_proj[e[j]]))
                  @ layer.experts.down_proj[e[j]] for j in range(2))
        torch.testing.assert_close(out[0, t], ref, rtol=1e-5, atol=1e-5)


def test_switch_family_places_moe_every_other_block():
    cfg = SwitchConfig(vocab_size=64, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=4,
                       ffn_hidden_size=48, max_seq_len=32).validate()
    assert [cfg.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    assert cfg.moe.top_k == 1 and cfg.moe.normalize_top_k is False
    assert cfg.moe.capacity(100, training=True) == math.ceil(100 / 8 * 1.25)
    assert cfg.moe.capacity(100, training=False) == math.ceil(100 / 8 * 2.0)


def test_grouped_mm_fallback_is_narrow_and_out_of_memory_is_not_swallowed(monkeypatch):
    from model.moe import experts
    counts = torch.tensor([2, 3])
    x, w = torch.randn(5, 16), torch.randn(2, 16, 8)

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("out of memory")
    monkeypatch.setattr(experts, "_GROUPED_MM", oom)
    monkeypatch.setattr(experts, "_UNSUPPORTED", set())
    with pytest.raises(torch.OutOfMemoryError):
        experts.grouped_mm(x, w, counts)
    assert experts._UNSUPPORTED == set()        # an OOM does not switch the kernel off

    def unsupported(*args, **kwargs):
        raise RuntimeError("strides should be multiple of 16 bytes")
    monkeypatch.setattr(experts, "_GROUPED_MM", unsupported)
    torch.testing.assert_close(experts.grouped_mm(x, w, counts), _looped_mm(x, w, counts))
    assert experts._UNSUPPORTED == {("cpu", torch.float32, True)}


# ------------------------------------------------------------------------------ host syncs

class HostSyncs:
    """Records every call that copies device data to the host, a sync on CUDA, as (op, model
    function issuing it): ``Tensor.tolist/cpu/numpy`` (seen by a TorchFunctionMode), and at the
    ATen level, forward and backward, ``item``/``bool`` (``_local_scalar_dense``), ``nonzero``,
    ``bincount``, ``masked_select``, ``unique``, boolean-mask indexing and ``repeat_interleave``
    without ``output_size``. On CPU nothing is copied, so the calls are what is counted."""

    ATEN = {"_local_scalar_dense", "nonzero", "bincount", "masked_select", "_unique2",
            "unique_dim", "unique_consecutive"}
    METHODS = {"tolist", "cpu", "numpy"}

    def __init__(self):
        from torch.overrides import TorchFunctionMode
        from torch.utils._python_dispatch import TorchDispatchMode
        self.calls: list[tuple[str, str]] = []
        record = self._record

        class Functions(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                if getattr(func, "__name__", "") in HostSyncs.METHODS:
                    record(func.__name__)
                return func(*args, **(kwargs or {}))

        class Aten(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                name = getattr(getattr(func, "_overloadpacket", None), "__name__", str(func))
                if (name in HostSyncs.ATEN
                        or (name == "repeat_interleave" and kwargs.get("output_size") is None)
                        or (name in ("index", "index_put", "index_put_") and any(
                            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]))):
                    record(name)
                return func(*args, **kwargs)

        self._modes = (Functions(), Aten())

    def _record(self, op: str) -> None:
        import os
        import sys

        import model
        package = os.path.dirname(model.__file__) + os.sep
        f, where = sys._getframe(2), "backward"      # autograd's C++ nodes have no model frame
        while f is not None:
            if f.f_code.co_filename.startswith(package):
                where = f.f_code.co_qualname
                break
            f = f.f_back
        self.calls.append((op, where))

    def __enter__(self):
        for m in self._modes:
            m.__enter__()
        return self

    def __exit__(self, *exc):
        for m in reversed(self._modes):
            m.__exit__(*exc)


def _forward_backward_syncs(layer: MoELayer, x: torch.Tensor) -> list[tuple[str, str]]:
    """The host syncs of one training forward+backward of ``layer``."""
    layer.train()
    with HostSyncs() as syncs:
        out, aux = layer(x)
        (out.square().sum() + load_balancing_losses([aux]).sum() + aux.z_loss).backward()
    return syncs.calls


SYNC_CASES = {   # name: (config, host syncs on the grouped kernel path)
    "dropless": (MoEConfig(num_experts=4, top_k=2, capacity_factor=None), []),
    "capacity": (MoEConfig(num_experts=4, top_k=1, capacity_factor=1.0, normalize_top_k=False,
                           router_jitter=0.0), []),
    # The jitter's base seed is a draw of the default CPU generator: a host value, no device.
    "capacity+jitter": (MoEConfig(num_experts=4, top_k=1, capacity_factor=1.0,
                                  normalize_top_k=False, router_jitter=0.5),
                        [("_local_scalar_dense", "jitter_noise")]),
    # DeepSeek-V3 routing (sigmoid, bias, 1 of 2 groups, scaling) with a gated shared expert.
    "deepseek+shared": (MoEConfig(num_experts=4, top_k=2, capacity_factor=None,
                                  score_function="sigmoid", n_group=2, topk_group=1,
                                  routed_scaling_factor=2.5, expert_bias_update_rate=1e-3,
                                  num_shared_experts=1, shared_expert_gate=True), []),
}
# The per-expert loop (no grouped kernel here, or a CUDA dtype/GPU without it) copies the
# group sizes to the host once per layer call, not once per projection (3).
LOOP_SYNC = ("tolist", "ExpertGroups.sizes")


@pytest.mark.parametrize("case", sorted(SYNC_CASES))
@pytest.mark.parametrize("path", ["kernel", "loop"])
def test_moe_layer_forward_backward_host_syncs_single_process(case, path, monkeypatch):
    from model.moe import experts
    moe, expected = SYNC_CASES[case]
    monkeypatch.setattr(experts, "_UNSUPPORTED", set())
    if path == "loop":
        monkeypatch.setattr(experts, "_GROUPED_MM", None)
        expected = expected + [LOOP_SYNC]
    else:
        why_not = _kernel_unavailable(torch.randn(8, H), torch.randn(4, H, I), torch.tensor([2, 2, 2, 2]))
        if why_not is not None:
            pytest.skip(why_not)
    layer = _layer(moe)
    x = torch.randn(2, 16, H, requires_grad=True)
    assert sorted(_forward_backward_syncs(layer, x)) == sorted(expected)
    out, aux = layer(x)
    if moe.capacity_factor is not None:        # the dropped rows' path ran, and leaked nothing
        assert aux.dropped_frac.item() > 0
    assert torch.isfinite(x.grad).all() and all(torch.isfinite(p.grad).all() for p in layer.parameters())


def test_capacity_drops_are_the_same_on_the_kernel_and_the_loop(monkeypatch):
    # The kernel leaves the dropped rows (past its last offset) unwritten, forward and backward;
    # the loop gives them zeros. Output and every gradient must agree, with no NaN from the tail.
    from model.moe import experts
    moe = MoEConfig(num_experts=4, top_k=2, capacity_factor=0.5)
    x = torch.randn(2, 16, H)
    results = []
    for kernel in (experts._GROUPED_MM, None):
        monkeypatch.setattr(experts, "_GROUPED_MM", kernel)
        monkeypatch.setattr(experts, "_UNSUPPORTED", set())
        layer = _layer(moe)
        xi = x.clone().requires_grad_()
        out, aux = layer(xi)
        (out.square().sum() + load_balancing_losses([aux]).sum()).backward()
        assert aux.dropped_frac.item() > 0.3
        results.append([out, xi.grad] + [p.grad for p in layer.parameters()])
    for a, b in zip(*results):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _ep2_host_syncs(rank, world):
    from model.moe import experts
    from model.parallel.groups import build_groups
    groups = build_groups(ep=2)
    kernel = experts._GROUPED_MM
    for case in ("dropless", "capacity", "deepseek+shared"):
        moe, _ = SYNC_CASES[case]
        for path in ("kernel", "loop"):
            experts._GROUPED_MM = kernel if path == "kernel" else None
            torch.manual_seed(0)
            layer = MoELayer(moe, H, I, groups)
            for p in layer.parameters():
                torch.nn.init.normal_(p, std=0.3)
            x = torch.randn(2, 16, H, generator=torch.Generator().manual_seed(rank), requires_grad=True)
            # One copy per exchange: the send and receive counts together; the loop gets the
            # sizes from it (the backward exchange reuses the host splits).
            got = _forward_backward_syncs(layer, x)
            assert got == [("tolist", "MoELayer._exchange_counts")], (case, path, got)
    experts._GROUPED_MM = kernel


def test_moe_layer_forward_backward_host_syncs_ep2():
    from training.run.spawn import run_ranks
    run_ranks(_ep2_host_syncs, 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_moe_layer_device_syncs_on_gpu(dtype):
    """CUDA's own detector (``set_sync_debug_mode``) counts the synchronizing calls of a training
    forward+backward: none for bf16 on sm 9.x/10.x (the grouped kernel reads the offsets on the
    device), one (the loop's group sizes) for fp32 and on other GPUs."""
    import warnings
    kernel = dtype == torch.bfloat16 and torch.cuda.get_device_capability()[0] in (9, 10)
    for case in sorted(SYNC_CASES):
        layer = _layer(SYNC_CASES[case][0]).to("cuda", dtype).train()
        x = torch.randn(2, 64, H, device="cuda", dtype=dtype, requires_grad=True)
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                out, aux = layer(x)
                (out.float().square().sum() + load_balancing_losses([aux]).sum() + aux.z_loss).backward()
            finally:
                torch.cuda.set_sync_debug_mode(0)
        syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
        assert len(syncs) == (0 if kernel else 1), (case, dtype, syncs)
        assert torch.isfinite(x.grad).all(), case
