"""A Qwen MoE or DeepSeek-V3 from transformers through the whole repository: tiny random
``Qwen3MoeForCausalLM`` (16 experts, top-4, q/k norms, renormalized top-k),
``Qwen2MoeForCausalLM`` (a gated shared expert, q/k/v biases) and ``DeepseekV3ForCausalLM``
(multi-head latent attention, YaRN, sigmoid group-limited routing, as in
tests/interop/test_hf_deepseek_v3.py) with a tokenizer, ``convert_hf.py import``,
``launch/train.py --init-from`` for 3 optimizer steps, ``convert_hf.py export`` of the run:

- the export, imported again, reproduces every tensor of the trained run exactly;
- ``launch/evaluate.py`` on the run gives transformers' loss of the exported model on the same
  text in the same windows (fp32, relative 1e-5: both compute in fp32 with different but
  equivalent op orders, as in ``test_hf_qwen_moe.py``, whose comments give the reasoning).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
import yaml
from transformers import AutoModelForCausalLM

from interop import hf as hf_interop
from interop.consolidate import load_run_model
from tests.interop.test_convert_hf import _randomize, _tiny_tokenizer
from tests.interop.test_hf_deepseek_v3 import _hf_tiny as _deepseek_tiny
from tests.interop.test_hf_qwen_moe import HF_COMMON, HF_KINDS
from tests.runs import REPO, python

TOL = 1e-5
EXTRA = {"qwen3_moe": dict(num_experts=16, num_experts_per_tok=4, norm_topk_prob=True),
         "qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
                           qkv_bias=True, shared_expert_intermediate_size=48)}
TEXT = "\n".join(f"def f{i}(x):\n    return x + {i}  # the quick brown fox" for i in range(40))


class _HFAsOurs(torch.nn.Module):
    """transformers' model behind our ``(ids, labels) -> ce_sum, num_target_tokens`` interface,
    so that ``launch/evaluate.py``'s own windowing and sums compute its loss."""

    def __init__(self, hf):
        super().__init__()
        self.hf = hf

    def forward(self, ids, labels):
        logits = self.hf(ids).logits.float()
        keep = labels != -100
        return SimpleNamespace(ce_sum=F.cross_entropy(logits[keep], labels[keep], reduction="sum"),
                               num_target_tokens=keep.sum())


def _run(script, *args):
    """``python script args`` as a user runs it (forked from the warm launcher's server)."""
    return python(script, *args, timeout=600, check=True).stdout


def _hf_model(kind: str):
    if kind == "deepseek_v3":          # MLA, YaRN, sigmoid group-limited routing, a shared expert
        return _deepseek_tiny(vocab_size=320)
    cls, config_cls, extra = HF_KINDS[kind]
    torch.manual_seed(0)
    hf = cls(config_cls(**{**HF_COMMON, **extra, "vocab_size": 320, **EXTRA[kind]}))
    _randomize(hf, seed=3)
    return hf


@pytest.mark.parametrize("kind", [*sorted(HF_KINDS), "deepseek_v3"])
def test_import_train_export_evaluate(tmp_path, kind):
    from launch.evaluate import evaluate_text

    hf = _hf_model(kind)
    cls = type(hf)
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    _tiny_tokenizer().save_pretrained(tmp_path / "hf")
    _run("launch/convert_hf.py", "import", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "init"))

    recipe = yaml.safe_load((REPO / "recipes" / "tiny_qwen3_moe.yaml").read_text())
    recipe["model"] = json.loads((tmp_path / "init" / "model_config.json").read_text())
    recipe["data"].update(seq_len=32, max_bytes=60000)
    recipe["tokenizer"].update(vocab_size=None)
    recipe["eval"].update(every=0)
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    run = tmp_path / "run"
    _run("launch/train.py", "--config", "ds_configs/zero1_fp32.json", "--recipe", str(tmp_path / "recipe.yaml"),
         "--run-dir", str(run), "--steps", "3", "--init-from", str(tmp_path / "init"),
         "--set", "train.save_every=3", "ds.scheduler.params.warmup_num_steps=1")
    _run("launch/convert_hf.py", "export", "--run-dir", str(run), "--out", str(tmp_path / "hf2"))
    _run("launch/convert_hf.py", "import", "--hf", str(tmp_path / "hf2"), "--out", str(tmp_path / "init2"))

    trained, cfg, tokenizer = load_run_model(run)
    cfg2, sd2, _ = hf_interop.load_init_dir(tmp_path / "init2")
    assert cfg2 == cfg
    start = hf_interop.load_init_dir(tmp_path / "init")[1]
    changed = 0
    for name, tensor in trained.state_dict().items():
        assert torch.equal(tensor, sd2[name]), name
        changed += not torch.equal(tensor, start[name])
    assert changed > 0                          # the steps trained: not a copy of the import

    (tmp_path / "text.txt").write_text(TEXT)
    printed = _run("launch/evaluate.py", "--run-dir", str(run), "--text-file", str(tmp_path / "text.txt"))
    ours = json.loads(printed.strip().splitlines()[-1])       # DeepSpeed may log a line before
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf2", local_files_only=True).eval()
    assert type(exported) is cls
    theirs = evaluate_text(_HFAsOurs(exported), tokenizer, TEXT, recipe["data"]["seq_len"])
    assert ours["tokens"] == theirs["tokens"] > 100
    assert abs(ours["loss"] - theirs["loss"]) <= TOL * theirs["loss"], (ours, theirs)
