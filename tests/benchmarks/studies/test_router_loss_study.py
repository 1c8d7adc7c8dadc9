"""The router loss studies short (``benchmarks/studies/router_loss_study.py``, one seed each, packed in
one test):

* ``--loss z`` (tiny Mixtral at 10x the JSON's lr, z_loss_coef 0 and 1e-2, 40 steps): without
  the z-loss the router's logits grow larger than with it. After 40 steps the mean log-sum-exp
  (what the z-loss squares) is above 2.5 without and below 1.0 with it (measured 2.94 and
  0.36); the study's own run separates them by far more than its seed spread
  (docs/load-balancing.md). The single largest logit is no such early signal.
* ``--loss aux`` (tiny Switch, aux_loss_coef 0 and 1e-2, 60 steps): without the aux loss the
  experts are loaded more unevenly (the worst layer's max/mean load) than with it.

And the router's precision (``model.moe.router_dtype``, ``--study precision``): a bf16 router
computes its logits, softmax and combine weights in bf16 (equal bit for bit to the same ops by
hand in bf16, off the fp32 ones by a bf16 rounding); the default is the fp32 router, bit for bit
the fp32 ops; the study's short mode (fp32 and bf16, z-loss 0, one seed, 6 steps) writes its
summary, and the two runs differ (the setting reaches the trainer).
"""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F

from model.config import MoEConfig, SwitchConfig
from model.moe.layer import MoELayer
from model.moe.losses import router_z_loss
from model.moe.router import TopKRouter
from tests.runs import python

T, H, E = 64, 32, 8


def _study(tmp_path, loss: str, steps: int, coefs: list[str]) -> dict:
    out = tmp_path / loss
    done = python("-m", "benchmarks.studies.router_loss_study", "--loss", loss, "--out", str(out), "--results",
                  str(out), "--figures", str(out), "--steps", str(steps), "--coefs", *coefs, "--seeds", "1",
                  timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert (out / f"router_{loss}_loss.png").stat().st_size > 10_000
    return json.loads((out / f"router_{loss}_loss.json").read_text())["summary"]


def test_the_router_losses_move_what_they_should(tmp_path):
    z = _study(tmp_path, "z", 40, ["0", "1e-2"])
    assert z["0"]["final_router_lse"]["mean"] > 2.5 > 1.0 > z["0.01"]["final_router_lse"]["mean"], z
    aux = _study(tmp_path, "aux", 60, ["0", "1e-2"])
    without, with_aux = (aux[c]["final_expert_load_max_over_mean"]["mean"] for c in ("0", "0.01"))
    assert without > with_aux, aux


def _router(**moe) -> TopKRouter:
    torch.manual_seed(0)
    router = TopKRouter(H, MoEConfig(num_experts=E, top_k=2, router_jitter=0.0, **moe))
    torch.nn.init.normal_(router.weight, std=0.5)
    return router


def _hand(logits: torch.Tensor):
    """Softmax, top-2 and renormalization in ``logits``' dtype, as ``route`` does them."""
    probs = torch.softmax(logits, dim=-1)
    weights, idx = probs.topk(2, dim=-1)
    return probs, idx, weights / weights.sum(dim=-1, keepdim=True).clamp_min(1e-20)


def test_a_bf16_router_computes_in_bf16():
    router = _router(router_dtype="bf16")
    x = torch.randn(T, H)
    logits, probs, idx, weights = router(x)
    assert logits.dtype == probs.dtype == weights.dtype == torch.float32    # fp32 containers
    hand = F.linear(x.bfloat16(), router.weight.bfloat16())                # (T, E) bf16
    hand_probs, hand_idx, hand_weights = _hand(hand)
    assert torch.equal(logits, hand.float()) and torch.equal(probs, hand_probs.float())
    assert torch.equal(idx, hand_idx) and torch.equal(weights, hand_weights.float())
    # Off the fp32 logits by a bf16 rounding: within the bound of rounding x, w (2^-9 each) and
    # the result (2^-9), and far above fp32's own round-off.
    ref = F.linear(x, router.weight)
    bound = 2.0 ** -7 * F.linear(x.abs(), router.weight.abs())
    err = (logits - ref).abs()
    assert (err <= bound).all() and (err / ref.abs().clamp_min(1e-3)).median() > 1e-4, err.max()
    # The backward runs through the bf16 ops into the fp32 parameter.
    (weights.sum() + probs.square().sum()).backward()
    assert router.weight.grad.dtype == torch.float32 and router.weight.grad.abs().sum() > 0
    # In a layer: the z-loss is the fp32 z-loss of the bf16 logits.
    layer = MoELayer(MoEConfig(num_experts=E, top_k=2, router_jitter=0.0, router_dtype="bf16"), H, 16)
    _, aux = layer(x.view(2, T // 2, H))
    hand = F.linear(x.bfloat16(), layer.gate.weight.bfloat16()).float()
    assert torch.equal(aux.z_loss, router_z_loss(hand, T))


def test_b_the_fp32_router_is_the_default_and_unchanged():
    assert MoEConfig().router_dtype == "fp32" and SwitchConfig().moe.router_dtype == "fp32"
    default, explicit = _router(), _router(router_dtype="fp32")
    for dtype in (torch.float32, torch.bfloat16):                           # model dtype
        x = torch.randn(T, H, dtype=dtype)
        out = default.to(dtype)(x)
        hand = F.linear(x.float(), default.weight.float())                  # fp32, whatever dtype
        assert torch.equal(out[0], hand)
        assert all(torch.equal(a, b) for a, b in zip(out[1:], _hand(hand)))
        assert all(torch.equal(a, b) for a, b in zip(out, explicit.to(dtype)(x)))
    try:
        SwitchConfig(moe=MoEConfig(router_dtype="fp16")).validate()
    except ValueError as err:
        assert "router_dtype" in str(err)
    else:
        raise AssertionError("router_dtype fp16 was accepted")


def test_c_the_precision_study_runs_short(tmp_path):
    out = tmp_path / "precision"
    done = python("-m", "benchmarks.studies.router_loss_study", "--study", "precision", "--out", str(out),
                  "--results", str(out), "--figures", str(out), "--steps", "6", "--also", "0", "--seeds", "1",
                  timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert (out / "router_precision.png").stat().st_size > 10_000
    written = json.loads((out / "router_precision.json").read_text())
    assert written["grid"] == {"model.moe.router_dtype": ["fp32", "bf16"], "model.moe.z_loss_coef": ["0"]}
    summary = written["summary"]
    assert list(summary) == ["fp32 z=0", "bf16 z=0"], summary
    keys = {f"{w}_{m}" for w in ("final", "peak")
            for m in ("router_lse", "router_logit_max", "dropped_frac", "grad_norm")} | {"final_loss", "spikes"}
    for point in summary.values():
        assert keys == set(point), point
    fp32, bf16 = (written["runs"][f"{p}-seed1"] for p in summary)
    assert fp32["final_router_lse"] != bf16["final_router_lse"], (fp32, bf16)   # the setting applied
    paired = written["paired"]["bf16 - fp32 z=0"]["final_router_lse"]
    assert paired["per_seed"] == [bf16["final_router_lse"] - fp32["final_router_lse"]], paired
