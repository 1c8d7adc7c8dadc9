"""Bad inputs to the command-line tools: exit code 2, one clear line on stderr, no traceback.

Each case changes one thing in a shipped DeepSpeed JSON / recipe (or one argument) and checks
that ``launch/train.py`` refuses it in ``prepare()`` with one ``error: ...`` line naming the
field or argument, the value and the fix, and that an existing run directory passed as
``--run-dir`` is left exactly as it was (names, sizes, contents, mtimes). Validation runs before
DeepSpeed is imported, so the in-process cases take milliseconds; two cases also run as real
subprocesses. ``evaluate.py`` and ``convert_hf.py export`` get the same treatment.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from launch import convert_hf, evaluate, train
from training.config.recipe import load_recipe

REPO = Path(__file__).resolve().parents[2]
DS_JSON = REPO / "ds_configs" / "zero2_fp32.json"
RECIPE_YAML = REPO / "recipes" / "tiny_mixtral.yaml"
LATEST_TAG = "step00000010"


# ----------------------------------------------------------------------------- the run directory


def _snapshot(root: Path) -> dict:
    """Every entry under ``root`` (and root itself): kind, size, sha256, mtime."""
    out = {}
    for path in [root, *sorted(root.rglob("*"))]:
        st = path.stat()
        digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None
        out[path.relative_to(root).as_posix()] = (path.is_dir(), st.st_size, digest, st.st_mtime_ns)
    return out


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A run directory of the default recipe with a (fake) checkpoint, as a resume would find it."""
    run = tmp_path_factory.mktemp("cli_errors") / "run"
    (run / "checkpoints" / LATEST_TAG).mkdir(parents=True)
    ds = json.loads(DS_JSON.read_text())
    ds["zero_optimization"] = {"stage": 0}      # offline loading then needs no DeepSpeed import
    resolved = {"recipe": load_recipe(None).to_dict(), "ds_config": ds}
    (run / "config.json").write_text(json.dumps(resolved, indent=2) + "\n")
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 8.3}\n{"step": 2, "loss": 8.1}\n')
    (run / "checkpoints" / "latest").write_text(LATEST_TAG)
    (run / "checkpoints" / LATEST_TAG / "mp_rank_00_model_states.pt").write_bytes(b"not a pickle")
    return run


@pytest.fixture(scope="module")
def pristine(run_dir) -> dict:
    return _snapshot(run_dir)


# ----------------------------------------------------------------------------- building bad inputs


class Inputs:
    """Writes one-change variants of the shipped JSON and recipe into a scratch directory."""

    def __init__(self, root: Path, run: Path):
        self.root, self.run = root, run
        self.ds = json.loads(DS_JSON.read_text())
        self.recipe = yaml.safe_load(RECIPE_YAML.read_text())
        self.good = self.json(lambda d: None, "good.json")

    def path(self, name: str) -> str:
        return str(self.root / name)

    def text(self, name: str, content: str | bytes) -> str:
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
        return str(path)

    def json(self, change, name: str = "bad.json") -> str:
        ds = copy.deepcopy(self.ds)
        change(ds)
        return self.text(name, json.dumps(ds, indent=2) + "\n")

    def yaml(self, change, name: str = "bad.yaml") -> str:
        recipe = copy.deepcopy(self.recipe)
        change(recipe)
        return self.text(name, yaml.safe_dump(recipe, sort_keys=False))

    def run_copy(self, name: str, change) -> str:
        """A copy of the run directory with one file changed."""
        for src in self.run.rglob("*"):
            if src.is_file():
                self.text(f"{name}/{src.relative_to(self.run).as_posix()}", src.read_bytes())
        change(self.root / name)
        return self.path(name)


def _set(section: str, **values):
    return lambda d: d[section].update(values)


def _broken_json(w: Inputs) -> list[str]:
    text = json.dumps(w.ds, indent=2).replace("{\n", "{\n  // a comment\n", 1)
    return ["--config", w.text("broken.json", text)]


def _broken_yaml(w: Inputs) -> list[str]:
    lines = RECIPE_YAML.read_text().splitlines(keepends=True)
    i = next(i for i, line in enumerate(lines) if line.startswith("  num_heads:"))
    lines[i] = "\t" + lines[i].lstrip()
    return ["--config", w.good, "--recipe", w.text("broken.yaml", "".join(lines))]


def _expected_broken_yaml_line() -> int:
    lines = RECIPE_YAML.read_text().splitlines()
    return next(i for i, line in enumerate(lines) if line.startswith("  num_heads:")) + 1


def _wrong_batch(w: Inputs) -> list[str]:
    derived = w.ds["train_micro_batch_size_per_gpu"] * w.ds.get("gradient_accumulation_steps", 1)
    return ["--config", w.json(lambda d: d.update(train_batch_size=derived + 1))]


def _bad_init_dir(w: Inputs) -> list[str]:
    w.text("bad_init/model.safetensors", "x")
    w.text("bad_init/model_config.json", "{oops")
    return ["--config", w.good, "--init-from", w.path("bad_init")]


def _heads(w: Inputs) -> int:
    return w.recipe["model"]["num_heads"]


def _experts(w: Inputs) -> int:
    return w.recipe["model"]["moe"]["num_experts"]


# (id, argv builder, regex the error line must match after "error: ")
TRAIN_CASES = [
    ("broken_json", _broken_json,
     r"ds_config \S+broken\.json: invalid JSON at line 2 column 3: Expecting property name .*"
     r"\(fix the syntax there; JSON allows no comments or trailing commas\)"),
    ("missing_config", lambda w: ["--config", w.path("nope.json")],
     r"ds_config \S+nope\.json: file not found \(pass an existing JSON file, e\.g\. ds_configs/zero3\.json\)"),
    ("missing_recipe", lambda w: ["--config", w.good, "--recipe", w.path("nope.yaml")],
     r"--recipe: file not found: \S+nope\.yaml \(pass a YAML from recipes/\)"),
    ("broken_yaml", _broken_yaml,
     rf"--recipe: invalid YAML in \S+broken\.yaml line {_expected_broken_yaml_line()} column 1: "
     r"found character '\\t' .*\(fix the syntax there\)"),
    ("batch_mismatch", _wrong_batch,
     r"ds_config\.train_batch_size: (\d+) != train_micro_batch_size_per_gpu \d+ x "
     r"gradient_accumulation_steps \d+ x data-parallel size 1 = \d+ \(delete train_batch_size so it "
     r"is derived, or set it to \d+\)"),
    ("grad_accum_0", lambda w: ["--config", w.json(lambda d: d.update(gradient_accumulation_steps=0))],
     r"ds_config\.gradient_accumulation_steps: 0 must be an integer >= 1 \(use 1 for no accumulation\)"),
    ("micro_batch_0", lambda w: ["--config", w.json(lambda d: d.update(train_micro_batch_size_per_gpu=0))],
     r"ds_config\.train_micro_batch_size_per_gpu: 0 must be an integer >= 1 \(set e\.g\. 4\)"),
    ("unknown_recipe_key", lambda w: ["--config", w.good, "--recipe", w.yaml(_set("train", stepz=3))],
     r"unknown recipe key 'train\.stepz' \(did you mean 'train\.steps'\?\)"),
    ("unknown_section", lambda w: ["--config", w.good, "--set", "trian.steps=3"],
     r"unknown recipe key 'trian' \(did you mean 'train'\?\)"),
    ("set_wrong_type", lambda w: ["--config", w.good, "--set", "train.steps=abc"],
     r"recipe key train\.steps: expected int, got str 'abc'"),
    ("set_no_equals", lambda w: ["--config", w.good, "--set", "train.steps"],
     r"--set 'train\.steps': expected dotted\.key=value, e\.g\. train\.steps=50"),
    ("set_below_value", lambda w: ["--config", w.good, "--set", "train.steps.max=5"],
     r"--set 'train\.steps\.max=5': recipe key train\.steps is a value, not a section: set it directly"),
    ("negative_lr", lambda w: ["--config", w.json(lambda d: d["optimizer"]["params"].update(lr=-1e-3))],
     r"ds_config\.optimizer\.params\.lr: -0\.001 must be > 0 \(set a positive learning rate\)"),
    ("fp16_and_bf16", lambda w: ["--config", w.json(lambda d: d.update(fp16={"enabled": True},
                                                                        bf16={"enabled": True}))],
     r"ds_config\.fp16\.enabled: True and bf16\.enabled are both true \(enable only one of them\)"),
    ("fp16_without_a_gpu", lambda w: ["--config", w.json(lambda d: d.update(fp16={"enabled": True},
                                                                              bf16={"enabled": False}))],
     r"fp16\.enabled: \S+bad\.json asks for fp16, which needs a GPU, and this machine has none: use "
     r"bf16 or fp32 on a CPU \(e\.g\. ds_configs/zero2\.json or ds_configs/zero2_fp32\.json\)"),
    ("removed_amp", lambda w: ["--config", w.json(lambda d: d.update(amp={"enabled": True}))],
     r"ds_config\.amp: \{'enabled': True\} was removed in DeepSpeed 0\.19\.8: Apex AMP was removed; "
     r"use \"bf16\" or \"fp16\" \(delete \"amp\"\)"),
    ("unknown_optimizer", lambda w: ["--config", w.json(lambda d: d["optimizer"].update(type="AdamQ"))],
     r"ds_config\.optimizer\.type: 'AdamQ' is not a DeepSpeed or torch\.optim optimizer \(use one of "
     r"\[.*'adamw'.*\] or a torch\.optim class name\)"),
    ("unknown_scheduler", lambda w: ["--config", w.json(lambda d: d["scheduler"].update(type="Cosine"))],
     r"ds_config\.scheduler\.type: 'Cosine' is not a known scheduler \(use one of \[.*'WarmupCosineLR'.*\] "
     r"or a torch\.optim\.lr_scheduler class that takes only numbers\)"),
    ("missing_data_file", lambda w: ["--config", w.good, "--set", "data.source=[/nonexistent/x.txt]"],
     r"data\.source entry '/nonexistent/x\.txt' matches no files .*; fix: give an existing "
     r"\.txt/\.jsonl/\.parquet file, directory or glob, .*'stdlib', or the prefix of prepared data "
     r"\(/nonexistent/x\.txt\.bin/\.idx\)"),
    ("tp_not_dividing_heads", lambda w: ["--config", w.good, "--set",
                                         f"parallel.tensor_parallel_size={_heads(w) + 1}"],
     r"parallel\.tensor_parallel_size \((\d+)\) does not divide model\.num_heads \(\d+\): "
     r"choose a divisor of \d+"),
    ("ep_not_dividing_experts", lambda w: ["--config", w.good, "--set",
                                           f"parallel.expert_parallel_size={_experts(w) + 1}"],
     r"parallel\.expert_parallel_size \(\d+\) does not divide model\.moe\.num_experts \(\d+\): "
     r"choose a divisor of \d+"),
    ("sp_seq_len_not_dividing", lambda w: ["--config", w.good, "--set", "parallel.tensor_parallel_size=2",
                                           "parallel.sequence_parallel=true", "data.seq_len=63"],
     r"data\.seq_len \(63\) is not divisible by parallel\.tensor_parallel_size \(2\): sequence "
     r"parallelism splits every sequence over the tensor-parallel ranks; use a multiple of 2"),
    ("cp_not_dividing_heads", lambda w: ["--config", w.good, "--set", "data.seq_len=96",
                                         f"parallel.context_parallel_size={_heads(w) - 1}"],
     r"parallel\.context_parallel_size \((\d+)\) does not divide the query heads per tp rank "
     r"\(model\.num_heads \d+ / tp 1\) for parallel\.cp_comm a2a: use cp_comm allgather or p2p, "
     r"or a cp that divides them"),
    ("cp_seq_len", lambda w: ["--config", w.good, "--set", "parallel.context_parallel_size=2",
                              "data.seq_len=66", "model.max_seq_len=66"],
     r"data\.seq_len \(66\) is not divisible by 4 for parallel\.context_parallel_size \(2\) \(2 x cp "
     r"chunks\): use a multiple of 4"),
    ("steps_0", lambda w: ["--config", w.good, "--steps", "0"],
     r"--steps: 0 must be >= 1"),
    ("init_from_missing", lambda w: ["--config", w.good, "--init-from", w.path("no_init")],
     r"--init-from \S+no_init: not an init dir \(expected model_config\.json and model\.safetensors; "
     r"make one with `python launch/convert_hf\.py import`\)"),
    ("init_from_bad_json", _bad_init_dir,
     r"--init-from \S+bad_init: model_config\.json is invalid \(JSONDecodeError: .*\); re-create the "
     r"init dir with `python launch/convert_hf\.py import`"),
    ("seq_len_over_max", lambda w: ["--config", w.good, "--set",
                                    f"data.seq_len={2 * w.recipe['model']['max_seq_len']}"],
     r"data\.seq_len \(\d+\) exceeds model\.max_seq_len \(\d+\): lower it or raise model\.max_seq_len"),
    ("unknown_family", lambda w: ["--config", w.good, "--set", "model.family=mixtrall"],
     r"recipe key model\.family: expected one of dense\|switch\|mixtral, got str 'mixtrall' "
     r"\(did you mean 'mixtral'\?\)"),
    ("top_k_over_experts", lambda w: ["--config", w.good, "--set", f"model.moe.top_k={_experts(w) + 1}"],
     r"model\.moe\.top_k \(\d+\) exceeds model\.moe\.num_experts \(\d+\): choose top_k <= num_experts"),
    ("run_dir_is_file", lambda w: ["--config", w.good, "--run-dir", w.text("a_file", "x")],
     r"--run-dir \S+a_file: exists and is not a directory \(choose another path\)"),
    ("run_dir_under_file", lambda w: ["--config", w.good, "--run-dir", w.text("b_file", "x") + "/run"],
     r"--run-dir \S+b_file/run: \S+b_file is a file, not a directory \(choose another path\)"),
    ("run_dir_other_model", lambda w: ["--config", w.good, "--set", "model.num_layers=2"],
     r"--run-dir \S+run: holds checkpoints of a different model; resume with the original recipe or "
     r"choose a new --run-dir"),
    ("run_dir_bad_config_json", lambda w: ["--config", w.good, "--run-dir", w.run_copy(
        "run_bad_cfg", lambda r: (r / "config.json").write_text("{not json"))],
     r"--run-dir \S+run_bad_cfg: config\.json is not one launch/train\.py wrote \(.*\); restore it or "
     r"choose another run directory"),
    ("json_not_utf8", lambda w: ["--config", w.text("latin1.json", '{"x": "caf\xe9"}'.encode("latin-1"))],
     r"ds_config \S+latin1\.json: not UTF-8 text \(invalid .* at byte \d+\) \(save the file as UTF-8\)"),
    ("yaml_not_utf8", lambda w: ["--config", w.good, "--recipe", w.text(
        "latin1.yaml", "name: caf\xe9\n".encode("latin-1"))],
     r"--recipe: \S+latin1\.yaml is not UTF-8 text \(invalid .* at byte \d+\): save it as UTF-8"),
    ("optimizer_not_object", lambda w: ["--config", w.json(lambda d: d.update(optimizer="AdamW"))],
     r"ds_config\.optimizer: 'AdamW' must be an object \(write \{\"key\": value, \.\.\.\}\)"),
    ("bf16_not_object", lambda w: ["--config", w.json(lambda d: d.update(bf16=True))],
     r"ds_config\.bf16: True must be an object \(write \{\"key\": value, \.\.\.\}\)"),
    ("offload_not_object", lambda w: ["--config", w.json(
        lambda d: d["zero_optimization"].update(offload_optimizer="cpu"))],
     r"ds_config\.zero_optimization\.offload_optimizer: 'cpu' must be an object \(write \{\"key\": value, \.\.\.\}\)"),
    ("warmup_over_total", lambda w: ["--config", w.json(
        lambda d: d["scheduler"]["params"].update(warmup_num_steps=500)), "--steps", "10"],
     r"ds_config\.scheduler\.params\.warmup_num_steps: 500 exceeds total_num_steps 10 \(shorten the warmup\)"),
    ("duplicate_json_key", lambda w: ["--config", w.text("dup.json", '{"gradient_clipping": 1.0, '
                                                                     '"gradient_clipping": 0.5}')],
     r"ds_config \S+dup\.json: duplicate key 'gradient_clipping' \(keep one of them\)"),
    ("tokenizer_vocab_over_model", lambda w: ["--config", w.good, "--set", "model.vocab_size=1000"],
     r"tokenizer\.vocab_size \(\d+\) exceeds model\.vocab_size \(1000\): .*lower it or raise "
     r"model\.vocab_size"),
]


def _one_line(err: str, prefix: str = "error: ") -> str:
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].strip(), f"expected one line on stderr, got {err!r}"
    assert lines[0].startswith(prefix), lines[0]
    return lines[0][len(prefix):]


def test_cases_are_distinct():
    assert len(TRAIN_CASES) >= 20
    assert len({case[0] for case in TRAIN_CASES}) == len(TRAIN_CASES)


@pytest.mark.parametrize("builder,pattern", [c[1:] for c in TRAIN_CASES], ids=[c[0] for c in TRAIN_CASES])
def test_train_refuses(builder, pattern, tmp_path, run_dir, pristine, capsys, monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)    # the cases name a CPU machine
    argv = ["--run-dir", str(run_dir), *builder(Inputs(tmp_path, run_dir))]  # a later --run-dir wins
    capsys.readouterr()
    rc = train.main(argv)
    out, err = capsys.readouterr()
    assert rc == 2, err
    message = _one_line(err)
    assert re.fullmatch(pattern, message), message
    assert out == ""
    assert _snapshot(run_dir) == pristine


# ----------------------------------------------------------------------------- evaluate.py, convert_hf.py


def test_evaluate_missing_text_file(tmp_path, run_dir, pristine, capsys):
    rc = evaluate.main(["--run-dir", str(run_dir), "--text-file", str(tmp_path / "nope.txt")])
    err = capsys.readouterr().err
    assert rc == 2
    assert re.fullmatch(r"--text-file \S+nope\.txt: file not found", _one_line(err))
    assert _snapshot(run_dir) == pristine


@pytest.mark.parametrize("setup,pattern", [
    (lambda d: None,
     r"--run-dir \S+: no config\.json \(is this a run directory made by launch/train\.py\?\)"),
    (lambda d: (d / "config.json").write_text('{"foo": 1}'),
     r"--run-dir \S+: config\.json is not one launch/train\.py wrote \(missing key 'recipe'\); "
     r"restore it or choose another run directory"),
], ids=["no_config_json", "config_json_without_recipe"])
def test_evaluate_not_a_run_dir(setup, pattern, tmp_path, capsys):
    (tmp_path / "text.txt").write_text("def f(x):\n    return x\n")
    (tmp_path / "not_a_run").mkdir()
    setup(tmp_path / "not_a_run")
    rc = evaluate.main(["--run-dir", str(tmp_path / "not_a_run"), "--text-file", str(tmp_path / "text.txt")])
    err = capsys.readouterr().err
    assert rc == 2
    assert re.fullmatch(pattern, _one_line(err)), err


def test_evaluate_corrupted_checkpoint(tmp_path, run_dir, pristine, capsys):
    (tmp_path / "text.txt").write_text("def f(x):\n    return x\n")
    rc = evaluate.main(["--run-dir", str(run_dir), "--text-file", str(tmp_path / "text.txt")])
    err = capsys.readouterr().err
    assert rc == 2
    assert re.fullmatch(rf"--run-dir \S+run: checkpoint \S+{LATEST_TAG} cannot be read \(UnpicklingError: .*\); "
                        r"restore it, or delete it and point \S+latest at an older tag", _one_line(err))
    assert _snapshot(run_dir) == pristine


@pytest.mark.parametrize("make,pattern", [
    (lambda d: d.mkdir(),
     r"--run-dir \S+: no config\.json \(is this a run directory made by launch/train\.py\?\)"),
    (lambda d: None, r"--run-dir \S+: no such directory"),
], ids=["dir_without_config_json", "missing_dir"])
def test_convert_hf_export_not_a_run_dir(make, pattern, tmp_path, capsys):
    make(tmp_path / "not_a_run")
    rc = convert_hf.main(["export", "--run-dir", str(tmp_path / "not_a_run"), "--out", str(tmp_path / "hf")])
    err = capsys.readouterr().err
    assert rc == 2
    assert re.fullmatch(pattern, _one_line(err, "convert_hf.py export: error: ")), err
    assert not (tmp_path / "hf").exists()


def test_argparse_errors_exit_2_without_traceback(capsys):
    """argparse's own refusals: its usage line, then one line naming the argument and value."""
    with pytest.raises(SystemExit) as exc:
        train.main(["--config", "x.json", "--steps", "abc"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.splitlines()[0].startswith("usage: ")
    assert re.search(r"error: argument --steps: invalid int value: 'abc'$", err.splitlines()[-1])


# ----------------------------------------------------------------------------- end to end


def test_subprocess_exit_code_and_no_traceback(tmp_path, run_dir, pristine):
    """Two cases through `python launch/train.py`, run side by side: exit 2, one line, no traceback."""
    w = Inputs(tmp_path, run_dir)
    cases = [
        (["--config", w.path("nope.json")], r"ds_config \S+nope\.json: file not found"),
        (["--config", w.json(lambda d: d.update(fp16={"enabled": True}, bf16={"enabled": True})),
          "--set", "train.steps=3"], r"ds_config\.fp16\.enabled: True and bf16\.enabled are both true"),
    ]
    procs = [subprocess.Popen([sys.executable, "launch/train.py", "--run-dir", str(run_dir), *argv],
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for argv, _ in cases]
    try:
        results = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for proc, (out, err), (_, pattern) in zip(procs, results, cases):
        assert proc.returncode == 2, err
        assert re.match(pattern, _one_line(err)), err
        assert out == ""
    assert _snapshot(run_dir) == pristine
