"""``launch/analyze_router.py`` and ``analysis/router_report.py``.

On a real run (one tiny Mixtral run of ``launch/train.py``, 1 process, 10 steps, checkpoints at
steps 5 and 10): the tool's per-layer counts sum to top_k x tokens and equal an independent
recount (the routers' inputs captured and routed again by hand, one window per forward), its
entropy equals the recomputed one, co-selection is symmetric with the counts on its diagonal,
``--checkpoints all`` gives one entry per checkpoint, the PNGs are valid, and bad input is one
line with exit code 2.

On constructed routing: a model whose expert biases send every token to experts 0 and 1 gets
exactly that count, the other experts and every layer listed as collapsed, and the drops its
capacities imply; a hand-made routing gets the lifts worked out below.
"""

from __future__ import annotations

import json
import math
import subprocess

import pytest
import torch

from analysis import router_report as router
from launch import analyze_router
from tests.runs import REPO, python, shared_launcher

TEXT = REPO / "model" / "moe" / "router.py"     # Python source, like the training corpus
MAX_TOKENS = 1500
PNG = b"\x89PNG\r\n\x1a\n"


def _tool(*args: str) -> subprocess.CompletedProcess:
    return python("launch/analyze_router.py", *args)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("router")
    shared_launcher().launch(tmp / "mixtral", "ds_configs/zero1_fp32.json", nproc=1, extra=["train.save_every=5"])
    return tmp / "mixtral"


@pytest.fixture(scope="module")
def report(run):
    out = run.parent / "report"
    proc = _tool("--run-dir", str(run), "--text-file", str(TEXT), "--out", str(out),
                 "--checkpoints", "all", "--max-tokens", str(MAX_TOKENS))
    assert proc.returncode == 0, proc.stderr
    names = ["router_report.json", "router_load.png", "router_vs_step.png",
             "router_co_selection.png", "router_classes.png"]
    assert proc.stdout.split() == [str(out / n) for n in names]
    import matplotlib.image
    for name in names[1:]:
        assert (out / name).read_bytes()[:8] == PNG, name
        height, width, _ = matplotlib.image.imread(out / name).shape
        assert width >= 300 and height >= 200, (name, width, height)
    return json.loads((out / "router_report.json").read_text())


def test_one_entry_per_checkpoint_and_counts_sum_to_k_tokens(report):
    assert [e["step"] for e in report["checkpoints"]] == [5, 10]
    assert report["step"] == 10 and report["layers"] == report["checkpoints"][-1]["layers"]
    assert report["tokens"] == MAX_TOKENS and report["top_k"] == 2
    for entry in report["checkpoints"]:
        assert [L["block"] for L in entry["layers"]] == [0, 1]           # SMALL: 2 Mixtral blocks
        for L in entry["layers"]:
            counts, co = L["tokens_per_expert"], L["co_selection"]
            assert len(counts) == 8 and sum(counts) == 2 * MAX_TOKENS
            assert L["dropped_frac_train_cf"] == L["dropped_frac_eval_cf"] == 0.0   # dropless
            assert all(co[i][j] == co[j][i] for i in range(8) for j in range(8))
            assert [co[i][i] for i in range(8)] == counts
            assert [sum(row) for row in co] == [2 * c for c in counts]     # each token picks 2
            assert L["load_max_over_mean"] == pytest.approx(max(counts) / (sum(counts) / 8))
            shares = [x["share_of_uniform"] for x in L["experts"]]
            assert shares == pytest.approx([c * 8 / (2 * MAX_TOKENS) for c in counts])
    assert report["thresholds"]["expert_share_of_uniform"] == router.EXPERT_COLLAPSE


def test_counts_and_entropy_equal_an_independent_recount(run, report):
    from interop.consolidate import load_run_model
    from training.data import batches

    model, cfg, tokenizer = load_run_model(run, "step00000010")
    ids = torch.as_tensor(batches.encode_texts([TEXT.read_text()], tokenizer)[:MAX_TOKENS].astype("int64"))
    inputs = {}
    hooks = [layer.mlp.gate.register_forward_pre_hook(
        lambda m, args, i=i: inputs.setdefault(i, []).append(args[0])) for i, layer in enumerate(model.layers)]
    with torch.no_grad():
        for window in ids.split(64):                                       # data.seq_len=64
            model(window[None])
    for h in hooks:
        h.remove()
    for L in report["layers"]:
        gate = model.layers[L["block"]].mlp.gate
        x = torch.cat(inputs[L["block"]])                                  # (T, H)
        probs = torch.softmax(x.float() @ gate.weight.float().T, dim=-1)   # (T, E)
        chosen = probs.topk(2, dim=-1).indices
        assert torch.bincount(chosen.flatten(), minlength=8).tolist() == L["tokens_per_expert"]
        entropy = -(probs * probs.log()).sum(-1).mean().item()
        assert L["router_entropy"] == pytest.approx(entropy, rel=1e-5)


def test_single_checkpoint_by_step_matches_all(run, report, tmp_path, capsys):
    assert analyze_router.main(["--run-dir", str(run), "--text-file", str(TEXT), "--out",
                                str(tmp_path), "--checkpoints", "5",
                                "--max-tokens", str(MAX_TOKENS)]) == 0
    assert str(tmp_path / "router_report.json") in capsys.readouterr().out.split()
    one = json.loads((tmp_path / "router_report.json").read_text())
    assert [e["tag"] for e in one["checkpoints"]] == ["step00000005"]
    # Counts exactly; floats to 1e-6: this process reduces with 2 threads, the report's
    # subprocess with OMP_NUM_THREADS=1, so float32 sums differ in the last bits.
    _assert_same(one["layers"], report["checkpoints"][0]["layers"])


def _assert_same(a, b):
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    elif isinstance(a, float):
        assert a == pytest.approx(b, rel=1e-6, abs=1e-9)
    else:
        assert a == b


def _model(capacity_factor, eval_capacity_factor):
    from model import Transformer
    from model.config import MixtralConfig, MoEConfig
    moe = MoEConfig(num_experts=8, top_k=2, capacity_factor=capacity_factor,
                    eval_capacity_factor=eval_capacity_factor, expert_bias_update_rate=1e-3)
    cfg = MixtralConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                        ffn_hidden_size=32, max_seq_len=16, moe=moe).validate()
    model = Transformer(cfg, init_seed=0)
    for layer in model.layers:     # choice = softmax score + bias: experts 0, 1 for every token
        layer.mlp.gate.e_score_correction_bias.copy_(torch.tensor([10.0, 9.0, 0, 0, 0, 0, 0, 0]))
    return model


def test_router_sending_every_token_to_experts_0_and_1():
    ids = torch.randint(64, (100,), generator=torch.Generator().manual_seed(0))
    batches = router.windows(ids, 16, 3)           # 2 forwards of 3 x 16 tokens, then 1 x 4
    assert [tuple(b.shape) for b in batches] == [(3, 16), (3, 16), (1, 4)]
    vocab = [f" w{i}" for i in range(64)]
    result = router.analyze_model(_model(1.0, 2.0), batches, vocab)
    assert result["tokens"] == 100
    for L in result["layers"]:
        assert L["tokens_per_expert"] == [100, 100, 0, 0, 0, 0, 0, 0]
        assert L["co_selection"][0][1] == L["co_selection"][1][0] == 100
        assert L["load_max_over_mean"] == pytest.approx(4.0)
        assert L["load_entropy"] == pytest.approx(math.log(2))
        # Train capacity ceil(2*48/8*1.0) = 12 per 48-token forward drops 36 of each of the
        # two experts' 48 assignments, ceil(2*4/8) = 1 of the 4-token one drops 3 each:
        # (2*36 + 2*36 + 2*3) / 200; eval capacity 24 and 2: (2*24 + 2*24 + 2*2) / 200.
        assert L["dropped_frac_train_cf"] == pytest.approx(150 / 200)
        assert L["dropped_frac_eval_cf"] == pytest.approx(100 / 200)
    assert result["collapsed"]["experts"] == [
        {"block": b, "expert": e, "share_of_uniform": 0.0} for b in (0, 1) for e in range(2, 8)]
    assert [c["block"] for c in result["collapsed"]["layers"]] == [0, 1]
    assert result["collapsed"]["layers"][0]["load_entropy_ratio"] == pytest.approx(1 / 3)
    dropless = router.analyze_model(_model(None, None), batches, vocab)["layers"][0]
    assert dropless["dropped_frac_train_cf"] == dropless["dropped_frac_eval_cf"] == 0.0


def test_a_spread_router_flags_nothing():
    """The converse: routers that spread the tokens (no bias, weights N(0, 1), random tokens)
    leave both collapsed lists empty, every expert well above a tenth of its uniform share."""
    model = _model(None, None)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in model.layers:
            layer.mlp.gate.e_score_correction_bias.zero_()
            layer.mlp.gate.weight.copy_(torch.randn(layer.mlp.gate.weight.shape, generator=g))
    ids = torch.randint(64, (960,), generator=torch.Generator().manual_seed(0))
    result = router.analyze_model(model, router.windows(ids, 16, 4), [f" w{i}" for i in range(64)])
    assert result["collapsed"] == {**result["collapsed"], "experts": [], "layers": []}
    for L in result["layers"]:
        assert sum(L["tokens_per_expert"]) == 2 * 960 and min(L["tokens_per_expert"]) > 0.1 * 240
        assert L["load_max_over_mean"] < 2.0


def test_lift_of_a_hand_made_routing(monkeypatch):
    from model.config import MoEConfig
    monkeypatch.setattr(router, "MIN_TEXT_COUNT", 1)
    vocab = [" the", "The", "42", ","]        # space_word, capitalized, digit, punctuation
    # Text ids 0 0 0 1 | 0 1 2 3: expert 0 takes the first four, expert 1 the rest.
    # Text shares: id0 4/8, id1 2/8, id2 1/8, id3 1/8.
    # Expert 0: id0 3/4 -> lift 1.5, id1 1/4 -> 1.0.  Expert 1: id0 1/4 -> 0.5, id1 -> 1.0,
    # id2 1/4 -> 2.0, id3 -> 2.0.  Classes follow the ids one to one.
    stats = router.LayerStats(MoEConfig(num_experts=2, top_k=1), vocab_size=4)
    stats.add(torch.tensor([0, 0, 0, 1, 0, 1, 2, 3]), torch.full((8, 2), 0.5),
              torch.tensor([[0]] * 4 + [[1]] * 4))
    L = stats.summary(3, vocab)
    e0, e1 = L["experts"]
    assert [(t["id"], t["count"], t["lift"]) for t in e0["top_tokens"]] == [(0, 3, 1.5), (1, 1, 1.0)]
    assert {t["id"]: t["lift"] for t in e1["top_tokens"]} == {0: 0.5, 1: 1.0, 2: 2.0, 3: 2.0}
    assert [t["id"] for t in e1["distinctive_tokens"]] == [2, 3, 1, 0]
    assert {c: v["lift"] for c, v in e0["classes"].items()} == {
        "digit": 0.0, "punctuation": 0.0, "capitalized": 1.0, "space_word": 1.5}
    assert e1["classes"]["punctuation"] == {"share": 0.25, "text_share": 0.125, "lift": 2.0}
    assert L["router_entropy"] == pytest.approx(math.log(2))
    assert L["co_selection"] == [[4, 0], [0, 4]] and L["tokens_per_expert"] == [4, 4]


def test_token_classes():
    cases = {"\n    ": "whitespace", " 42": "digit", "):": "punctuation", " None": "capitalized",
             "Error": "capitalized", " return": "space_word", "_name": "other", "ing": "other"}
    assert {s: router.token_class(s) for s in cases} == cases


def test_bad_input_is_one_line_and_exit_2(run, tmp_path, capsys):
    config = json.loads((run / "config.json").read_text())
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text(json.dumps(config))
    import yaml
    dense = dict(config, recipe=dict(config["recipe"], model=yaml.safe_load(
        (REPO / "recipes" / "tiny_dense.yaml").read_text())["model"]))
    (tmp_path / "dense").mkdir()
    (tmp_path / "dense" / "config.json").write_text(json.dumps(dense))
    cases = [((tmp_path / "missing", TEXT, "latest"), "no such directory"),
             ((tmp_path / "empty", TEXT, "latest"), "no complete checkpoint"),
             ((tmp_path / "dense", TEXT, "latest"), "has no router; pass an MoE run"),
             ((run, tmp_path / "nothing.txt", "latest"), "file not found"),
             ((run, TEXT, "7"), "no checkpoint step00000007")]
    for (run_dir, text, which), message in cases:          # in process: a traceback would raise
        code = analyze_router.main(["--run-dir", str(run_dir), "--text-file", str(text),
                                    "--out", str(tmp_path / "out"), "--checkpoints", which])
        captured = capsys.readouterr()
        assert code == 2 and not captured.out, captured
        line, = captured.err.strip().splitlines()
        assert line.startswith("error: ") and message in line, line
    assert not (tmp_path / "out").exists()
    proc = _tool("--run-dir", str(tmp_path / "missing"), "--text-file", str(TEXT), "--out",
                 str(tmp_path / "out"))                    # and as a user runs it
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
