"""Muon's pieces (``training/optim/muon.py``) against torch.optim.Muon, per expert, per tp shard,
which parameter goes where, and the settings it refuses. The layouts against the single-process
run are in ``tests/parallel/test_train_layouts.py``."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from model import Transformer, TransformerConfig
from model.moe.config import MoEConfig
from model.parallel.groups import ParallelGroups
from training.config.ds_checks import validate_ds_config
from training.optim import muon, muon_update
from training.optim.optimizers import param_groups


def _fake_engine(model, optimizer):
    return SimpleNamespace(module=model, basic_optimizer=optimizer, optimizer=optimizer,
                           bfloat16_enabled=lambda: False)


def test_three_steps_equal_torch_optim_muon_up_to_its_bf16_newton_schulz():
    """One 48 x 32 matrix, three steps with decay, nesterov momentum and Moonlight's lr rule,
    against torch.optim.Muon (adjust_lr_fn="match_rms_adamw"). torch runs Newton-Schulz in bf16
    (8 mantissa bits), ours in fp32: each step's weight change agrees to 3% in Frobenius norm
    (measured 1.3-1.6%; bf16 against bf16 with other rounding points differs by 3.5-3.8%). A
    wrong lr ratio is off by 39% (0.2 sqrt(48) = 1.39), no decay or another momentum rule too."""
    torch.manual_seed(0)
    w0 = torch.randn(48, 32) * 0.02
    grads = [torch.randn(48, 32) for _ in range(3)]
    lin = torch.nn.Linear(32, 48, bias=False)
    lin.weight.data.copy_(w0)
    ref = torch.nn.Parameter(w0.clone())
    torch_muon = torch.optim.Muon([ref], lr=0.01, weight_decay=0.1, momentum=0.95, nesterov=True,
                                  adjust_lr_fn="match_rms_adamw")
    settings = muon.MuonSettings(lr=0.01, weight_decay=0.1)
    groups = muon.param_groups(lin, [{"params": [lin.weight], "weight_decay": 0.1, "name": "decay"}])
    ours = muon.MuonAdamW(groups, settings)
    update = muon_update.MuonUpdate(_fake_engine(lin, ours), settings, 0.0, None, whole_grads=True)
    assert [m.ratio for m in update.matrices] == [pytest.approx(0.2 * math.sqrt(48))]
    for g in grads:
        before_ref, before_ours = ref.detach().clone(), lin.weight.detach().clone()
        ref.grad, lin.weight.grad = g.clone(), g.clone()
        torch_muon.step()
        update.apply(norm=1.0)
        ours.step()
        theirs = ref.detach() - before_ref
        assert ((lin.weight.detach() - before_ours) - theirs).norm() / theirs.norm() < 3e-2
    moved = ref.detach() - w0
    assert (lin.weight.detach() - ref.detach()).norm() / moved.norm() < 3e-2 and moved.norm() > 0.1 * w0.norm()


def test_newton_schulz_is_torch_optim_muons_iteration_in_fp32():
    """torch.optim.Muon's ``_zeropower_via_newtonschulz`` runs only in bf16: ours in fp32 agrees
    with it to its bf16 rounding (2.0% in Frobenius norm measured, 3% allowed; another matrix
    or coefficient set is O(1) off) and with itself in float64 to 1e-5 (measured 4e-6 absolute),
    so an fp32 run's update does not depend on the machine's half-precision support; and it
    orthogonalises (singular values in Keller Jordan's band, about 0.7-1.2)."""
    from torch.optim._muon import _zeropower_via_newtonschulz
    torch.manual_seed(1)
    g = torch.randn(64, 24)
    ours = muon_update.newton_schulz(g, 5, torch.float32)
    ref = _zeropower_via_newtonschulz(g, muon_update.NS_COEFFICIENTS, 5, muon_update.NS_EPS).float()
    assert (ours - ref).norm() / ref.norm() < 3e-2
    torch.testing.assert_close(ours, muon_update.newton_schulz(g.double(), 5, torch.float64).float(), rtol=1e-5, atol=1e-5)
    s = torch.linalg.svdvals(ours)
    assert 0.6 < s.min() and s.max() < 1.25


def test_an_expert_stack_is_orthogonalised_per_expert():
    """(E, H, I) is E matrices: each expert's update is the Newton-Schulz of its own gradient,
    not a slice of one over the stack (which differs by tens of percent)."""
    torch.manual_seed(2)
    g = torch.randn(4, 32, 48)
    batched = muon_update.newton_schulz(g, 5)
    for e in range(4):
        torch.testing.assert_close(batched[e], muon_update.newton_schulz(g[e], 5), rtol=1e-5, atol=1e-6)
    as_one = muon_update.newton_schulz(g.reshape(4 * 32, 48), 5).reshape(4, 32, 48)
    assert (as_one - batched).norm() / batched.norm() > 0.3


def _model(tp: int = 1, tp_rank: int = 0):
    cfg = TransformerConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                            ffn_hidden_size=48, max_seq_len=32, attention="mla", q_lora_rank=16,
                            kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, mtp_depth=1,
                            moe=MoEConfig(num_experts=4, top_k=2, num_shared_experts=1, first_k_dense=1,
                                          shared_expert_gate=True, expert_ffn_hidden_size=64))
    with torch.device("meta"):
        return Transformer(cfg, ParallelGroups(tp=tp, tp_rank=tp_rank), init_seed=None)


def test_which_parameters_go_to_muon():
    """Hidden matrices (MLA's projections, dense and shared-expert MLPs, expert stacks, MTP's
    eh_proj) on Muon; embeddings, the head, norms, the router and the one-row shared-expert
    gate on AdamW."""
    model = _model()
    groups = muon.param_groups(model, param_groups(model, 0.1))
    kinds = {g["name"]: {muon._kind(n) for n, p in model.named_parameters() if any(p is q for q in g["params"])}
             for g in groups}
    assert kinds["decay-muon"] == {
        "self_attn.q_a_proj.weight", "self_attn.q_b_proj.weight", "self_attn.kv_a_proj_with_mqa.weight",
        "self_attn.kv_b_proj.weight", "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
        "mlp.down_proj.weight", "mlp.experts.gate_proj", "mlp.experts.up_proj", "mlp.experts.down_proj",
        "mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight",
        "mlp.shared_experts.down_proj.weight", "eh_proj.weight"}
    assert kinds["decay-adam"] == {"lm_head.weight", "mlp.gate.weight", "mlp.shared_expert_gate.weight"}
    assert "embed_tokens.weight" in kinds["no_decay-adam"] and all(
        k == "embed_tokens.weight" or k.endswith("norm.weight") for k in kinds["no_decay-adam"])


def test_expert_stacks_take_the_lr_ratio_of_one_expert_as_x_at_w():
    """An expert stack is used as x @ W: gate/up (E, H, I) map H -> I, down (E, I, H) maps I -> H,
    so Keller Jordan's sqrt(max(1, fan_out / fan_in)) is sqrt(I / H) for gate/up and 1 for down
    (DeepSpeed's rows/cols rule reads (H, I) as (out, in) and gives gate/up 1); a Linear weight is
    (out, in). Moonlight's 0.2 sqrt(max(A, B)) is the same either way."""
    model = _model()
    params = dict(model.named_parameters())
    for rule, want in (("original", {"mlp.experts.gate_proj": math.sqrt(64 / 32), "mlp.experts.down_proj": 1.0,
                                     "mlp.gate_proj.weight": math.sqrt(48 / 32)}),
                       ("match_rms_adamw", {"mlp.experts.gate_proj": 0.2 * 8, "mlp.experts.down_proj": 0.2 * 8,
                                            "mlp.gate_proj.weight": 0.2 * math.sqrt(48)})):
        for kind, ratio in want.items():
            layer = "layers.1." if "experts" in kind else "layers.0."
            assert muon_update._matrix(layer + kind, params[layer + kind], rule, None).ratio == pytest.approx(ratio)


def test_newton_schulz_of_a_tensor_parallel_shard_is_not_the_matrixs():
    """The column-parallel gate_proj of the MLP at TP2: rank 0's rows of the whole matrix's
    Newton-Schulz (what the trainer computes, gathering the shards) and the Newton-Schulz of rank
    0's rows alone differ by ~20% here, 10,000x the 1e-5 of the layout comparison: an update
    made per shard would fail it at the first step."""
    torch.manual_seed(3)
    full = _model().layers[0].mlp.gate_proj.weight
    shard = _model(tp=2, tp_rank=0).layers[0].mlp.gate_proj.weight
    (dim, rows), = shard.shard_spec
    assert dim == 0 and len(rows) == full.shape[0] // 2
    g = torch.randn(full.shape)
    whole = muon_update.newton_schulz(g, 5)[rows]
    alone = muon_update.newton_schulz(g[rows], 5)
    assert (alone - whole).norm() / whole.norm() > 0.1


def _muon_ds(**changes) -> dict:
    cfg = json.loads(open("ds_configs/muon.json").read())
    cfg["optimizer"]["params"].update(changes.pop("params", {}))
    return {**cfg, **changes}


@pytest.mark.parametrize("cfg, message", [
    (_muon_ds(params={"nesterov_momentum": True}), r"optimizer\.params\.nesterov_momentum: .* not a Muon parameter"),
    (_muon_ds(params={"ns_method": "gram"}), r"optimizer\.params\.ns_method: 'gram' is not run here"),
    (_muon_ds(params={"adjust_lr_fn": "spectral"}), r"adjust_lr_fn: 'spectral' is not a rule"),
    (_muon_ds(params={"momentum": 1.0}), r"optimizer\.params\.momentum: 1\.0 must be a number in \[0, 1\)"),
    (_muon_ds(bf16={"enabled": False}, fp16={"enabled": True}), r"optimizer\.type: 'Muon' is not run under fp16"),
    (_muon_ds(zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu"}}),
     r"offload_optimizer\.device: 'cpu' is not run with Muon"),
])
def test_muon_json_refusals(cfg, message):
    with pytest.raises(ValueError, match=message) as e:
        validate_ds_config(cfg, 1)
    assert "\n" not in str(e.value)


def test_the_shipped_muon_json_is_valid_and_the_plain_one_runs_through_the_builder():
    """ds_configs/muon.json validates; {"type": "Muon", "params": {lr, weight_decay}} alone builds
    our optimizer (no FusedAdam), with DeepSpeed's clipping handed over and ZeRO told to accept it."""
    validate_ds_config(_muon_ds(), 1)
    model = _model()
    with torch.device("cpu"):
        real = Transformer(model.cfg, None, init_seed=0)
    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 1.0, "zero_optimization": {"stage": 2},
          "optimizer": {"type": "Muon", "params": {"lr": 0.02, "weight_decay": 0.1}}}
    opt, out = muon.build_optimizer(validate_ds_config(ds, 1), real, param_groups(real, 0.1))
    assert isinstance(opt, muon.MuonAdamW) and "optimizer" not in out
    assert out["gradient_clipping"] == 0.0 and out["zero_allow_untested_optimizer"] is True
    assert len(opt.group_lines) == len(opt.param_groups) == 3


@pytest.mark.parametrize("extra, message", [
    (["model.mup_base_hidden_size=32"], r"model\.mup_base_hidden_size with ds_config\.optimizer\.type Muon"),
    (["parallel.grad_compression=powersgd"], r"parallel\.grad_compression powersgd with ds_config\.optimizer\.type Muon"),
])
def test_muon_refuses_recipe_keys_it_does_not_compose_with(extra, message, tmp_path, monkeypatch, capsys):
    from launch import train
    monkeypatch.setenv("WORLD_SIZE", "2")
    rc = train.main(["--config", "ds_configs/muon.json", "--run-dir", str(tmp_path / "run"), "--set", *extra])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert __import__("re").search(message, err), err
    assert not (tmp_path / "run").exists()


def test_momentum_saved_by_another_number_of_ranks_is_gathered_per_matrix():
    """A data-parallel size change (fp32 ZeRO-0 resumes without conversion): every rank keeps
    every matrix's momentum, taken from whichever saved rank held it; a matrix no rank saved, or
    one of another shape (another tp layout), is refused in one line."""
    lin = torch.nn.Sequential(torch.nn.Linear(8, 6, bias=False), torch.nn.Linear(6, 4, bias=False))
    settings = muon.MuonSettings(lr=0.01)
    groups = muon.param_groups(lin, [{"params": list(lin.parameters()), "weight_decay": 0.0, "name": "decay"}])
    update = muon_update.MuonUpdate(_fake_engine(lin, muon.MuonAdamW(groups, settings)), settings, 0.0, None, True)
    saved = [{"momentum": {"0.weight": torch.full((6, 8), 1.0)}}, {"momentum": {"1.weight": torch.full((4, 6), 2.0)}}]
    note = update.load_other_world(lambda r: saved[r], 2, 1)
    assert "2 matrices" in note
    assert update.momentum["0.weight"].eq(1.0).all() and update.momentum["1.weight"].eq(2.0).all()
    with pytest.raises(ValueError, match=r"has no 1\.weight") as e:
        update.load_other_world(lambda r: saved[r], 1, 1)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"momentum of 0\.weight is \(3, 8\), this rank holds \(6, 8\)"):
        update.load_state_dict({"momentum": {"0.weight": torch.zeros(3, 8), "1.weight": torch.zeros(4, 6)}})


def test_the_estimator_counts_one_momentum_and_the_newton_schulz_step():
    """Muon's memory and step in ``launch/estimate_memory.py`` on Moonlight's recipe at 64 GPUs,
    ZeRO-2: the optimizer states are AdamW's with each Muon element's two moments (8 bytes over
    dp) replaced by one momentum (4 over dp); the step adds the owners' Newton-Schulz and the
    reduce and broadcast of every Muon matrix in fp32 (2 x 4 bytes x (dp - 1) / dp an element)."""
    from planning.estimator import estimate
    from planning.muon_cost import muon_step_terms
    from training.config.recipe import REPO_ROOT, load_recipe
    recipe = load_recipe(REPO_ROOT / "recipes" / "moonlight_16b_a3b.yaml")
    muon_ds = json.loads(open("ds_configs/muon_moonlight.json").read())
    adamw_ds = {**muon_ds, "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1}}}
    ours, theirs = estimate(recipe, muon_ds, 64), estimate(recipe, adamw_ds, 64)
    mu = ours["muon"]["params"]
    assert 0.9 * ours["worst"]["params"]["total"] < mu < ours["worst"]["params"]["total"]
    saved = theirs["worst"]["states"]["optimizer"] - ours["worst"]["states"]["optimizer"]
    assert saved == pytest.approx(4 * mu / 64)
    terms = muon_step_terms(ours)
    assert terms["muon_comm_bytes"] == pytest.approx(2 * 4 * mu * 63 / 64)
    assert terms["muon_ns_flops"] == pytest.approx(ours["muon"]["ns_flops"] / 64)
    assert muon_step_terms(theirs) == {}
