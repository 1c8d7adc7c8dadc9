"""Recipe parsing: shipped recipes, published parameter counts, --set overrides, error messages."""

from __future__ import annotations

import ast
import dataclasses
import json
import re
from pathlib import Path

import pytest

from training.config import schema
from training.config.recipe import DEFAULT_RECIPE, REPO_ROOT, Recipe, load_recipe, recipe_from_dict
from model.config import DenseConfig, MixtralConfig, SwitchConfig

RECIPES = sorted((REPO_ROOT / "recipes").glob("*.yaml"))
TINY = ("tiny_dense.yaml", "tiny_switch.yaml", "tiny_mixtral.yaml", "tiny_qwen3_moe.yaml",
        "tiny_deepseek_moe.yaml", "tiny_deepseek_v3.yaml")
EXPECTED = {*TINY, "dense_125m.yaml", "dense_1p3b.yaml", "dense_7b.yaml", "switch_base_8.yaml",
            "switch_base_128.yaml", "mixtral_8x7b.yaml", "mixtral_8x22b.yaml", "qwen3_30b_a3b.yaml",
            "deepseek_v3_style.yaml", "deepseek_v3.yaml", "kimi_k2.yaml", "moonlight_16b_a3b.yaml",
            "long_context_7b.yaml"}
MULTINODE_SCRIPTS = ("launch/multinode_hostfile.sh", "launch/slurm_8x8.sbatch")


def _tiny(name: str = "tiny_mixtral.yaml", *overrides: str) -> Recipe:
    return load_recipe(REPO_ROOT / "recipes" / name, overrides)


def _header(path: Path) -> str:
    lines = path.read_text().splitlines()
    return "\n".join(line for line in lines[:next(i for i, l in enumerate(lines)
                                                    if not l.startswith("#"))])


# ----------------------------------------------------------------------------- shipped recipes


def test_all_named_recipes_exist():
    assert EXPECTED <= {p.name for p in RECIPES}


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_recipe_loads_validates_and_round_trips(path):
    r = load_recipe(path)
    assert r.name == path.stem.replace("_", "-")
    assert r.model.moe is None if r.model.family == "dense" else r.model.moe is not None
    assert r.seq_len <= r.model.max_seq_len
    # JSON and back gives an equal, frozen recipe.
    assert recipe_from_dict(json.loads(json.dumps(r.to_dict()))) == r


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_recipe_opens_with_cluster_launch_command_and_sensitivities(path):
    header = _header(path)
    assert re.search(r"^# Cluster:", header, re.M), "name the target cluster"
    assert re.search(r"^# Critical:", header, re.M) and re.search(r"^# Robust:", header, re.M)
    launch = re.search(r"deepspeed (--\S+ \S+ )*launch/train\.py --config ds_configs/(zero[0-3]|muon_\w+)"
                       r"\.json --recipe recipes/" + re.escape(path.name) + r"$", header, re.M)
    assert launch, f"{path.name}: no exact deepspeed launch command for this file"
    nodes = re.search(r"--num_nodes (\d+)", launch.group(0))
    if nodes and int(nodes.group(1)) > 1:
        assert any(s in header for s in MULTINODE_SCRIPTS), "multi-node recipes name their script"


def test_default_recipe_is_tiny_mixtral():
    r = load_recipe(None)
    assert DEFAULT_RECIPE.name == "tiny_mixtral.yaml"
    assert r == _tiny() and isinstance(r.model, MixtralConfig)


@pytest.mark.parametrize("name", TINY)
def test_tiny_recipes_are_cpu_sized_with_comparable_active_params(name):
    r, dense = _tiny(name), _tiny("tiny_dense.yaml")
    assert r.data.source == "stdlib" and not r.tracking.wandb
    assert r.tokenizer_vocab_size == 4096 and r.seq_len == 128
    assert (r.train.steps, r.train.save_every, r.eval.every) == (300, 100, 100)
    assert r.model.num_params() < 5_000_000
    # Experts are sized so that a token meets the same FFN width in every family.
    assert r.model.num_params(active=True) == pytest.approx(dense.model.num_params(), rel=0.01)


# Published totals (Llama-2 paper / HF configs; Mistral AI's 46.7B/12.9B and 141B/39B) and the
# GPT-3 size classes. 1% for exact architectures, 3% for the "class" sizes.
PUBLISHED = [
    ("dense_125m.yaml", 125e6, 125e6, 0.03),
    ("dense_1p3b.yaml", 1.3e9, 1.3e9, 0.03),
    ("dense_7b.yaml", 6.74e9, 6.74e9, 0.01),
    ("long_context_7b.yaml", 6.74e9, 6.74e9, 0.01),   # the same model at 32K (RoPE base only)
    ("mixtral_8x7b.yaml", 46.7e9, 12.9e9, 0.01),
    ("mixtral_8x22b.yaml", 141e9, 39e9, 0.01),
    ("qwen3_30b_a3b.yaml", 30.5e9, 3.3e9, 0.02),       # Qwen3 model card: 30.5B / 3.3B
    ("deepseek_v3.yaml", 685e9, 37e9, 0.02),          # DeepSeek-V3 report: 671B / 37B, 685B with its
                                                      # MTP module (ours 682.6B: its module shares the
                                                      # embedding and head the checkpoint copies; 37.6B
                                                      # active counts the output head: 36.6B without)
    ("kimi_k2.yaml", 1.04e12, 32e9, 0.03),            # Kimi K2 card: 1.04T / 32B
    ("moonlight_16b_a3b.yaml", 16e9, 3e9, 0.03),      # Moonlight card: 16B / 3B
]


@pytest.mark.parametrize("name,total,active,tol", PUBLISHED, ids=lambda v: str(v))
def test_published_parameter_counts(name, total, active, tol):
    m = load_recipe(REPO_ROOT / "recipes" / name).model
    assert m.num_params() == pytest.approx(total, rel=tol)
    assert m.num_params(active=True) == pytest.approx(active, rel=tol)


def test_exact_hf_parameter_counts():
    # The sums of the tensors in the HF checkpoints of these architectures.
    assert load_recipe(REPO_ROOT / "recipes/dense_7b.yaml").model.num_params() == 6_738_415_616
    assert load_recipe(REPO_ROOT / "recipes/mixtral_8x7b.yaml").model.num_params() == 46_702_792_704
    # Qwen3-30B-A3B: q/k norms (2 x 128 per block) and head_dim 128 included.
    assert load_recipe(REPO_ROOT / "recipes/qwen3_30b_a3b.yaml").model.num_params() == 30_532_122_624


@pytest.mark.parametrize("name,experts", [("switch_base_8.yaml", 8), ("switch_base_128.yaml", 128)])
def test_switch_base_counts_by_hand(name, experts):
    # No published count for a decoder-only Switch-Base: recompute it from the architecture.
    h, f, layers, vocab = 768, 3072, 12, 32128
    attn = 4 * h * h + 2 * h            # q, k, v, o (12 heads, no GQA) + two RMSNorm weights
    mlp = 3 * h * f                     # SwiGLU gate, up, down
    moe_layers = layers // 2            # every other block
    embed = 2 * vocab * h + h           # untied embedding and head + final norm
    total = embed + layers * attn + (layers - moe_layers) * mlp + moe_layers * (experts * mlp
                                                                                 + h * experts)
    active = total - moe_layers * (experts - 1) * mlp
    r = load_recipe(REPO_ROOT / "recipes" / name)
    moe = r.model.moe
    assert (moe.top_k, moe.capacity_factor, moe.eval_capacity_factor, moe.router_jitter,
            moe.normalize_top_k, r.model.num_moe_layers) == (1, 1.25, 2.0, 0.01, False, 6)
    assert (r.model.num_params(), r.model.num_params(active=True)) == (total, active)


# ----------------------------------------------------------------------------- --set overrides


def test_overrides_int_float_bool_null_list_choice():
    r = _tiny("tiny_switch.yaml", "train.steps=7", "model.moe.aux_loss_coef=0.1",
              "model.rope_theta=500000", "tracking.wandb=true", "model.moe.capacity_factor=null",
              "data.seq_len=null", "tracking.tags=[a, b]",
              "train.activation_checkpointing=every_k:2",
              "model.moe.z_loss_coef=1e-4", "data.source=[corpus/*.txt]")
    assert r.train.steps == 7 and r.model.moe.aux_loss_coef == 0.1
    assert r.model.rope_theta == 500000.0 and isinstance(r.model.rope_theta, float)
    assert r.tracking.wandb is True and r.model.moe.capacity_factor is None
    assert r.data.seq_len is None and r.seq_len == 128
    assert r.tracking.tags == ("a", "b") and r.train.checkpointing.every_k == 2
    assert r.model.moe.z_loss_coef == 1e-4  # YAML 1.1 reads 1e-4 as a string; floats accept it
    assert r.data.source == ("corpus/*.txt",)
    # Untouched moe keys keep the recipe's values.
    assert r.model.moe.eval_capacity_factor == 2.0 and r.model.moe.top_k == 1


def test_nested_moe_override_keeps_the_other_moe_keys():
    r = _tiny("tiny_mixtral.yaml", "model.moe.num_experts=4", "parallel.expert_parallel_size=4")
    assert r.model.moe.num_experts == 4 and r.model.moe.top_k == 2
    assert r.model.moe.z_loss_coef == 0.001


def test_family_override_switches_the_config_class():
    r = _tiny("tiny_mixtral.yaml", "model.family=switch")
    assert isinstance(r.model, SwitchConfig)
    assert r.model.moe.top_k == 2 and r.model.hidden_size == 128  # the recipe's explicit keys
    r = _tiny("tiny_dense.yaml", "model.family=mixtral")
    assert isinstance(r.model, MixtralConfig) and r.model.moe == MixtralConfig().moe
    r = _tiny("tiny_mixtral.yaml", "model.family=dense", "model.moe=null")
    assert isinstance(r.model, DenseConfig) and r.model.moe is None


def test_kv_heads_replicated_when_they_divide_tp():
    r = _tiny("tiny_mixtral.yaml", "parallel.tensor_parallel_size=4")  # 4 heads, 2 KV heads
    assert r.parallel.tensor_parallel_size == 4


def test_sections_are_frozen():
    r = _tiny()
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.train.steps = 3  # type: ignore[misc]


# ----------------------------------------------------------------------------- errors

ERRORS = [
    (["model.hiden_size=64"], r"unknown recipe key 'model\.hiden_size' \(did you mean "
                              r"'model\.hidden_size'\?\)"),
    (["model.moe.num_expert=4"], r"unknown recipe key 'model\.moe\.num_expert' \(did you mean "
                                 r"'model\.moe\.num_experts'\?\)"),
    (["trian.steps=3"], r"unknown recipe key 'trian' \(did you mean 'train'\?\)"),
    (["train.zzz=3"], r"unknown recipe key 'train\.zzz' \(valid keys under train: steps, "),
    (["train.steps=abc"], r"^recipe key train\.steps: expected int, got str 'abc'$"),
    (["train.steps=true"], r"recipe key train\.steps: expected int, got bool True"),
    (["train.steps=1.5"], r"recipe key train\.steps: expected int, got float 1\.5"),
    (["train.steps=null"], r"recipe key train\.steps: expected int, got null"),
    (["model.moe.top_k=null"], r"recipe key model\.moe\.top_k: expected int, got null"),
    (["data.max_bytes=lots"], r"recipe key data\.max_bytes: expected int or null, got str"),
    (["tracking.tags=[1, 2]"], r"recipe key tracking\.tags: expected list of str, got list"),
    (["train.spike_action=skp"], r"train\.spike_action: expected one of log\|skip\|stop, got str "
                                 r"'skp' \(did you mean 'skip'\?\)"),
    (["train.activation_checkpointing=ful"], r"train\.activation_checkpointing \('ful'\) is not "
                                             r"one of .* \(did you mean 'full'\?\)"),
    (["train.activation_checkpointing=every_k:9"], r"every_k:9\) exceeds model\.num_layers \(4\)"),
    (["model.family=mixtrl"], r"model\.family: expected one of dense\|switch\|mixtral, got str "
                              r"'mixtrl' \(did you mean 'mixtral'\?\)"),
    (["model.family=dense"], r"model\.moe is set but model\.family is dense: .*model\.moe=null"),
    (["parallel.tensor_parallel_size=3"], r"^parallel\.tensor_parallel_size \(3\) does not divide "
                                          r"model\.num_heads \(4\): choose a divisor of 4$"),
    (["model.hidden_size=192", "model.num_heads=12", "model.num_kv_heads=4",
      "parallel.tensor_parallel_size=6"], r"parallel\.tensor_parallel_size \(6\) and "
                                          r"model\.num_kv_heads \(4\) must divide one another"),
    (["parallel.expert_parallel_size=3"], r"parallel\.expert_parallel_size \(3\) does not divide "
                                          r"model\.moe\.num_experts \(8\): choose a divisor of 8"),
    (["parallel.pipeline_parallel_size=5"], r"parallel\.pipeline_parallel_size \(5\) exceeds "
                                            r"model\.num_layers \(4\)"),
    (["parallel.tensor_parallel_size=0"], r"parallel\.tensor_parallel_size \(0\) must be an "
                                          r"integer >= 1"),
    (["train.steps=0"], r"train\.steps \(0\) must be an integer >= 1"),
    (["train.save_every=-1"], r"train\.save_every \(-1\) must be an integer >= 0"),
    (["data.seq_len=256"], r"data\.seq_len \(256\) exceeds model\.max_seq_len \(128\)"),
    (["tokenizer.vocab_size=8192"], r"tokenizer\.vocab_size \(8192\) exceeds model\.vocab_size "
                                    r"\(4096\)"),
    (["model.moe.top_k=9"], r"model\.moe\.top_k \(9\) exceeds model\.moe\.num_experts \(8\)"),
    (["train.steps"], r"--set 'train\.steps': expected dotted\.key=value"),
    (["train.steps.x=1"], r"recipe key train\.steps is a value, not a section"),
    (["train=5"], r"recipe key train: expected a mapping of keys, got int 5"),
]


@pytest.mark.parametrize("overrides,message", ERRORS, ids=lambda v: str(v)[:50])
def test_errors_are_one_line_and_name_the_key(overrides, message):
    with pytest.raises(ValueError, match=message) as info:
        _tiny("tiny_mixtral.yaml", *overrides)
    assert "\n" not in str(info.value)


def test_expert_parallel_must_be_one_for_dense():
    with pytest.raises(ValueError, match=r"expert_parallel_size \(2\) must be 1 for model\.family "
                                         r"dense"):
        _tiny("tiny_dense.yaml", "parallel.expert_parallel_size=2")


def test_missing_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ValueError, match=re.escape(f"--recipe: file not found: {missing} (pass a "
                                                   f"YAML from recipes/)")):
        load_recipe(missing)


@pytest.mark.parametrize("text,message", [
    ("name: x\nmodel:\n  family: dense\n   hidden_size: 64\n", r"line 4"),
    ("name: x\nmodel: {family: dense\n", r"line 3"),
    ("name: x\nmodel:\n  family: dense\nname: y\n", r"line 4 .*duplicate key 'name'"),
])
def test_broken_yaml_names_file_and_line(tmp_path, text, message):
    path = tmp_path / "broken.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=rf"--recipe: invalid YAML in {re.escape(str(path))} "
                                         rf"{message}") as info:
        load_recipe(path)
    assert "\n" not in str(info.value)


def test_unknown_key_and_missing_family_in_a_file(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("name: x\nmodel: {family: dense, hidden_size: 64, num_heads: 4}\n"
                    "train: {steps: 3, save_evry: 1}\n")
    with pytest.raises(ValueError, match=r"'train\.save_evry' \(did you mean 'train\.save_every'"):
        load_recipe(path)
    path.write_text("name: x\nmodel: {hidden_size: 64}\n")
    with pytest.raises(ValueError, match=r"model\.family is missing: set it to one of dense"):
        load_recipe(path)


def test_every_dataclass_field_has_a_one_line_docstring():
    """Every recipe section's fields, and the model's (``model.*`` and ``model.moe.*`` keys; the
    family subclasses only override defaults)."""
    from model import config as model_config
    from model.moe import config as moe_config
    trees = [(ast.parse(Path(schema.__file__).read_text()), None),
             (ast.parse(Path(model_config.__file__).read_text()), {"TransformerConfig"}),
             (ast.parse(Path(moe_config.__file__).read_text()), {"MoEConfig"})]
    classes = [n for tree, names in trees for n in tree.body
               if isinstance(n, ast.ClassDef) and (names is None or n.name in names)]
    assert {"MoEConfig", "TransformerConfig"} <= {c.name for c in classes}
    for cls in classes:
        body = cls.body
        for i, stmt in enumerate(body):
            if isinstance(stmt, ast.AnnAssign) and "ClassVar" not in ast.unparse(stmt.annotation):
                doc = body[i + 1] if i + 1 < len(body) else None
                assert isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant), (
                    f"{cls.name}.{stmt.target.id} has no docstring")
                assert "\n" not in doc.value.value, f"{cls.name}.{stmt.target.id}: one line"
