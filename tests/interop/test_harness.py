"""``interop/harness.py``: lm-evaluation-harness on our model in memory equals lm-eval's own
``hf`` backend on the export of the same weights.

Two local tasks written into the test's folder (lm-eval's ``include_path``, data from local
JSON files, nothing downloaded): a multiple-choice task (log-likelihood of each choice; one
context longer than the model's 64 tokens, so left truncation is exercised) and a rolling
log-likelihood task (perplexity; one document of several 64-token windows). A dense and a
Mixtral model with O(1) random weights (``tests/interop/test_convert_hf._randomize``), exported by
``interop/hf_files.export_hf``; lm-eval runs ``HarnessModel`` on ours and ``HFLM`` on the export.

Tolerance: every per-document log-likelihood within relative 1e-5 (fp32, the same tokens; HF's
attention and expert loops sum in another order), and the same accuracy and greedy flags.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.interop.test_convert_hf import _randomize, _tiny_tokenizer

LINES = ["def f(x): return x + 1", "hello world, hello there", "the quick brown fox jumps over the lazy dog",
         "def g(y): return y * 2", "hello there, the lazy fox"]


def _write_tasks(folder) -> None:
    folder.mkdir()
    mc = [{"context": a, "choices": [b, c, d], "label": i % 3}
          for i, (a, b, c, d) in enumerate(zip(LINES, LINES[1:] + LINES[:1], LINES[2:] + LINES[:2],
                                                LINES[3:] + LINES[:3]))]
    mc.append({"context": " ".join(LINES * 3), "choices": [LINES[0], LINES[2]], "label": 1})   # > 64 tokens
    ppl = [{"text": line} for line in LINES] + [{"text": "\n".join(LINES * 4)}]                # several windows
    for name, docs in (("mc", mc), ("ppl", ppl)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (folder / "tiny_mc.yaml").write_text(
        f"task: tiny_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder / 'mc.jsonl'}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: \"{{context}}\"\n"
        "doc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{label}}\"\nmetric_list:\n  - metric: acc\n")
    (folder / "tiny_ppl.yaml").write_text(
        f"task: tiny_ppl\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder / 'ppl.jsonl'}\n"
        "test_split: test\noutput_type: loglikelihood_rolling\ndoc_to_text: \"\"\ndoc_to_target: \"{{text}}\"\n"
        "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n")


def _evaluate(model, folder) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager
    manager = TaskManager(include_defaults=False, include_path=str(folder))    # the local tasks only
    return lm_eval.simple_evaluate(model=model, tasks=["tiny_mc", "tiny_ppl"], log_samples=True,
                                   task_manager=manager, bootstrap_iters=0)


def _per_doc(out: dict, task: str) -> list:
    return [s["filtered_resps"] for s in sorted(out["samples"][task], key=lambda s: s["doc_id"])]


@pytest.mark.parametrize("family", ["dense", "mixtral"])
def test_the_in_memory_model_equals_lm_evals_hf_backend_on_the_export(family, tmp_path):
    from lm_eval.models.huggingface import HFLM
    from interop.harness import HarnessModel
    from interop.hf_files import export_hf
    from model import Transformer
    from model.config import DenseConfig, MixtralConfig, MoEConfig
    tiny = dict(vocab_size=300, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                ffn_hidden_size=96, max_seq_len=64)
    cfg = (DenseConfig(**tiny) if family == "dense"
           else MixtralConfig(**tiny, moe=MoEConfig(num_experts=4, top_k=2, router_jitter=0.0)))
    torch.manual_seed(0)
    model = Transformer(cfg)
    _randomize(model, seed=2)
    tokenizer = _tiny_tokenizer()
    export_hf(model, cfg, tokenizer, tmp_path / "hf")
    _write_tasks(tmp_path / "tasks")
    ours = _evaluate(HarnessModel(model, tokenizer, batch_size=4), tmp_path / "tasks")
    theirs = _evaluate(HFLM(pretrained=str(tmp_path / "hf"), batch_size=4, device="cpu", dtype="float32"),
                       tmp_path / "tasks")
    for task in ("tiny_mc", "tiny_ppl"):
        a, b = _per_doc(ours, task), _per_doc(theirs, task)
        assert len(a) == len(b) > 0
        for doc_a, doc_b in zip(a, b):
            for x, y in zip(doc_a, doc_b):
                x, y = (x, y) if task == "tiny_ppl" else (x[0], y[0])
                assert x == pytest.approx(y, rel=1e-5), (task, doc_a, doc_b)
    assert ours["results"]["tiny_mc"]["acc,none"] == theirs["results"]["tiny_mc"]["acc,none"]
    greedy = [[c[1] for c in doc] for doc in _per_doc(ours, "tiny_mc")]
    assert greedy == [[c[1] for c in doc] for doc in _per_doc(theirs, "tiny_mc")]
    assert len({round(doc[0], 3) for doc in _per_doc(ours, "tiny_ppl")}) > 1          # not vacuous


def test_evaluate_tasks_writes_a_new_results_file_and_bad_input_is_one_line(tmp_path, monkeypatch, capsys):
    """``launch/evaluate.py --tasks`` on a run (its model stood in for, as the export tests do):
    lm-eval's table on stdout, a new ``eval/lm_eval_<step>_<time>.json`` per call (never one
    overwritten); an unknown task or ``--limit 0`` is one line, exit 2, the run directory as it was."""
    import sys
    import types
    from launch import evaluate
    from model import Transformer
    from model.config import DenseConfig
    cfg = DenseConfig(vocab_size=300, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                      ffn_hidden_size=96, max_seq_len=64)
    model, tokenizer = Transformer(cfg), _tiny_tokenizer()
    fake = types.ModuleType("interop.consolidate")
    fake.load_run_model = lambda run_dir, tag=None: (model, cfg, tokenizer)
    monkeypatch.setitem(sys.modules, "interop.consolidate", fake)
    run = tmp_path / "run"
    (run / "checkpoints" / "step00000007").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("step00000007")
    _write_tasks(tmp_path / "tasks")
    args = ["--run-dir", str(run), "--tasks", "tiny_mc", "--include-path", str(tmp_path / "tasks"), "--limit", "3"]
    for bad, expected in ((["--tasks", "no_such_task"], "unknown task 'no_such_task'"), (["--limit", "0"], "--limit: 0")):
        before = sorted(p.name for p in run.rglob("*"))
        assert evaluate.main(args + bad) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and expected in err[0], err
        assert sorted(p.name for p in run.rglob("*")) == before
    for _ in range(2):
        assert evaluate.main(args) == 0
        assert "tiny_mc" in capsys.readouterr().out
    files = sorted((run / "eval").glob("lm_eval_00000007_*.json"))
    assert len(files) == 2
    results = json.loads(files[0].read_text())["results"]["tiny_mc"]
    assert 0.0 <= results["acc,none"] <= 1.0
