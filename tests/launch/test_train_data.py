"""The trainer on prepared data (``data.source`` naming ``.bin``/``.idx`` prefixes and blends).

- A dataset megatron-core wrote (no manifest) trains here, and the tokens the trainer reads are
  megatron-core's own reader's, document for document.
- A 0.7 / 0.3 blend of it and a dataset ``launch/prepare_data.py`` wrote: the sample order is
  bitwise the same on 1 and 2 data-parallel ranks, every metrics row carries
  ``tokens_by_source``, and a run killed and resumed logs the uninterrupted run's rows.
- Bad data is one ``error:`` line, exit code 2, and an existing run directory stays as it was.

megatron-core (in requirements.txt) is the reference: imported here, never skipped.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.runs import REPO, SMALL, env, kill_after_step, launch, python, rows

STDLIB_FILES = ["json/decoder.py", "json/encoder.py", "csv.py", "textwrap.py", "string.py",
                "fnmatch.py", "glob.py", "shlex.py", "heapq.py", "bisect.py"]


def _stdlib_texts() -> list[str]:
    import sysconfig
    root = Path(sysconfig.get_paths()["stdlib"])
    return [(root / f).read_text(encoding="utf-8") for f in STDLIB_FILES]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict:
    """A tokenizer, a Megatron dataset megatron-core wrote with it, and one prepare_data.py wrote."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from data_pipeline.tokenizer import train_tokenizer
    tmp = tmp_path_factory.mktemp("prepared")
    texts = _stdlib_texts()
    tokenizer = train_tokenizer(texts, 1024, tmp / "tokenizer")
    eos = tokenizer.eos_token_id
    mega = tmp / "megatron_text_document"
    builder = IndexedDatasetBuilder(str(mega) + ".bin", dtype=np.uint16)
    docs = []
    for text in texts[:6]:
        for part in text.split("\n\n"):                  # many short documents
            if part.strip():
                ids = tokenizer(part, add_special_tokens=False)["input_ids"] + [eos]
                docs.append(ids)
                builder.add_item(torch.tensor(ids, dtype=torch.int64))
                builder.end_document()
    builder.finalize(str(mega) + ".idx")
    jsonl = tmp / "rows.jsonl"
    jsonl.write_text("".join(json.dumps({"text": p}) + "\n" for t in texts[6:] for p in t.split("\n\n") if p.strip()))
    out = subprocess.run([sys.executable, "launch/prepare_data.py", "--input", str(jsonl), "--output-prefix",
                          str(tmp / "ours"), "--tokenizer", str(tmp / "tokenizer"), "--append-eod",
                          "--workers", "2"], cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return {"tmp": tmp, "tokenizer": str(tmp / "tokenizer"), "megatron": str(mega), "docs": docs,
            "ours": str(tmp / "ours_text_document"), "eos": eos}


def _sets(data, source) -> list[str]:
    return [*SMALL, f"data.source={json.dumps(source)}", f"tokenizer.path={data['tokenizer']}",
            "model.moe.router_jitter=0.0"]


def test_a_megatron_core_dataset_is_read_token_for_token(data):
    from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronDataset

    from training.data import streams
    from training.config.recipe import load_recipe
    ref = MegatronDataset(data["megatron"], multimodal=False, mmap=True)
    assert len(ref) == len(data["docs"]) and all(np.array_equal(ref[i], d) for i, d in enumerate(data["docs"]))
    recipe = load_recipe(None, _sets(data, [data["megatron"]]))
    train, _ = streams.open_sources(recipe.data, {}, recipe.model.vocab_size, None)
    (source,) = train
    whole = np.concatenate([source.train.read(np.arange(source.train.num_tokens)),
                            source.val.read(np.arange(source.val.num_tokens))])
    assert np.array_equal(whole, np.concatenate([ref[i] for i in range(len(ref))]))
    # The held-out tail is whole documents: the validation stream starts at a document start.
    n_val = max(1, int(len(ref) * recipe.data.val_fraction))
    assert np.array_equal(source.val.read(np.arange(source.val.num_tokens)),
                          np.concatenate([ref[i] for i in range(len(ref) - n_val, len(ref))]))


def _order(warm, tmp: Path, name: str, nproc: int, sets: list[str], steps: int = 6) -> list[dict]:
    out = tmp / name
    warm.script("tests/training/data/_data_order_run.py",
                [str(out), str(steps), "--config", "ds_configs/zero1_fp32.json", "--run-dir",
                 str(tmp / f"run-{name}"), "--set", *sets], tmp / f"{name}.log", nproc=nproc)
    return [dict(np.load(f"{out}.rank{r}.npz")) for r in range(nproc)]


def test_a_blend_has_the_same_order_on_one_and_two_data_parallel_ranks(warm_launcher, data, tmp_path):
    blend = [0.7, data["megatron"], 0.3, data["ours"]]
    # The same global batch (16): one rank accumulating 2 micro-batches of 8, or two ranks of 8.
    one = _order(warm_launcher, tmp_path, "dp1", 1, _sets(data, blend) + ["ds.gradient_accumulation_steps=2"])[0]
    two = sorted(_order(warm_launcher, tmp_path, "dp2", 2, _sets(data, blend)), key=lambda r: int(r["dp_rank"]))
    # Each step's samples: rank 0 holds the first half, rank 1 the second, bitwise.
    assert np.array_equal(np.concatenate([two[0]["ids"], two[1]["ids"]], axis=1), one["ids"])
    assert np.array_equal(np.concatenate([two[0]["val"], two[1]["val"]])[: len(one["val"])], one["val"])
    seen = json.loads(str(one["seen"]))
    assert seen == json.loads(str(two[0]["seen"])) == json.loads(str(two[1]["seen"]))
    assert set(seen[-1]) == {data["megatron"], data["ours"]}
    share = seen[-1][data["megatron"]] / sum(seen[-1].values())
    assert abs(share - 0.7) < 0.05, seen[-1]          # 6 steps x 16 samples: a few samples' rounding


def test_a_blended_run_logs_tokens_by_source_and_resumes_exactly(warm_launcher, data, tmp_path):
    blend = [0.7, data["megatron"], 0.3, data["ours"]]
    extra = [f"data.source={json.dumps(blend)}", f"tokenizer.path={data['tokenizer']}",
             "model.moe.router_jitter=0.0", "train.save_every=3", "eval.every=0"]
    full, run = tmp_path / "full", tmp_path / "run"
    warm_launcher.launch(full, "ds_configs/zero1_fp32.json", extra=extra)
    kill_after_step(launch(run, "ds_configs/zero1_fp32.json", extra=extra, wait=False), run, 7)
    warm_launcher.launch(run, "ds_configs/zero1_fp32.json", extra=extra)     # the same command again
    ref, got = rows(full), rows(run)
    assert [r["step"] for r in got] == list(range(1, 11))
    for a, b in zip(ref, got):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6), a["step"]
        assert b["tokens_by_source"] == a["tokens_by_source"]
        assert sum(b["tokens_by_source"].values()) == b["tokens"]
    assert set(ref[-1]["tokens_by_source"]) == {data["megatron"], data["ours"]}


# ----------------------------------------------------------------------------- bad data


def _snapshot(root: Path) -> dict:
    return {p.relative_to(root).as_posix(): (p.is_dir(), p.stat().st_size, p.stat().st_mtime_ns,
            hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None)
            for p in [root, *sorted(root.rglob("*"))]}


def _copy_pair(src: str, dst: Path) -> str:
    for suffix in (".bin", ".idx"):
        dst.with_name(dst.name + suffix).write_bytes(Path(src + suffix).read_bytes())
    return str(dst)


def _not_an_idx(data, tmp: Path) -> list[str]:
    prefix = _copy_pair(data["megatron"], tmp / "garbage")
    Path(prefix + ".idx").write_bytes(b"this is not an index file at all")
    return [f"data.source={json.dumps([prefix])}"]


def _truncated_bin(data, tmp: Path) -> list[str]:
    prefix = _copy_pair(data["megatron"], tmp / "short")
    raw = Path(prefix + ".bin").read_bytes()
    Path(prefix + ".bin").write_bytes(raw[: len(raw) // 2])
    return [f"data.source={json.dumps([prefix])}"]


def _ids_above_the_vocabulary(data, tmp: Path) -> list[str]:
    from data_pipeline.indexed import IndexedWriter
    prefix = tmp / "big_ids"
    with IndexedWriter(prefix, np.uint16) as writer:
        for doc in data["docs"][:20]:
            writer.add_document(np.asarray(doc))
        writer.add_document(np.array([5000, 7, data["eos"]]))        # above the recipe's 4096
    return [f"data.source={json.dumps([str(prefix)])}"]


def _other_tokenizer(data, tmp: Path) -> list[str]:
    from data_pipeline.tokenizer import train_tokenizer
    other = tmp / "other-tokenizer"
    train_tokenizer([t[::-1] for t in _stdlib_texts()], 700, other)
    return [f"data.source={json.dumps([data['ours']])}", f"tokenizer.path={other}"]


CASES = [
    ("not_an_idx", _not_an_idx, r"garbage\.idx"),
    ("truncated_bin", _truncated_bin, r"short\.bin"),
    ("weight_zero", lambda d, t: [f"data.source={json.dumps([0, d['ours'], 1, d['megatron']])}"],
     r"data\.source: the weight of .* is 0"),
    ("weight_not_a_number", lambda d, t: [f"data.source={json.dumps(['x', d['ours'], 1, d['megatron']])}"],
     r"data\.source .* mixes entries and numbers"),
    ("missing_prefix", lambda d, t: [f"data.source={json.dumps([0.5, d['ours'], 0.5, str(t / 'nowhere')])}"],
     r"data\.source entry '.*nowhere'"),
    ("tokenizer_not_a_tokenizer", lambda d, t: [f"tokenizer.path={t}"], r"tokenizer\.path \(.*\) is not a tokenizer"),
    ("ids_above_the_vocabulary", _ids_above_the_vocabulary, r"token id 5000, not below model\.vocab_size \(4096\)"),
    ("other_tokenizer", _other_tokenizer, r"prepared with another tokenizer"),
]


@pytest.mark.parametrize("build, pattern", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_data_is_one_line_and_leaves_the_run_directory_alone(data, tmp_path, build, pattern):
    import re
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 8.3}\n')
    before = _snapshot(run)
    sets = [*_sets(data, [data["ours"]]), *build(data, tmp_path)]
    out = python("launch/train.py", "--config", "ds_configs/zero1_fp32.json", "--run-dir", str(run),
                 "--steps", "2", "--set", *sets)
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert len(errors) == 1 and re.search(pattern, errors[0]), out.stderr[-3000:]
    assert _snapshot(run) == before


def test_a_run_with_document_masking_trains_and_reloads_masked(warm_launcher, data, tmp_path):
    """``data.document_masking`` through the real entry point on short documents; the offline
    reader (``load_run_model``, behind evaluate.py and the exports) rebuilds the model with the
    run's EOS as the separator, as the trainer built it."""
    from interop.consolidate import load_run_model
    run = tmp_path / "masked"
    warm_launcher.launch(run, "ds_configs/zero1_fp32.json", nproc=1, steps=2,
           extra=[f"data.source={json.dumps([data['megatron']])}", f"tokenizer.path={data['tokenizer']}",
                  "model.moe.router_jitter=0.0", "data.document_masking=true"])
    assert [r["step"] for r in rows(run)] == [1, 2]
    model, cfg, tokenizer = load_run_model(run)
    assert cfg.document_separator_id == tokenizer.eos_token_id == data["eos"]


def test_val_source_holds_out_a_dataset_of_its_own(data):
    """With ``data.val_source`` the training entries keep every document and validation reads the
    named dataset from its start; the validation windows are the same at any data-parallel size."""
    from data_pipeline.indexed import open_prepared
    from training.data import batches as data_lib
    from training.data import streams
    from training.config.recipe import load_recipe
    recipe = load_recipe(None, _sets(data, [data["megatron"]]) + [f"data.val_source={json.dumps([data['ours']])}"])
    train, val = streams.open_sources(recipe.data, {}, recipe.model.vocab_size, None)
    mega, ours = open_prepared(data["megatron"]), open_prepared(data["ours"])
    assert train[0].train.num_tokens == sum(s.num_tokens for s in mega.shards) and train[0].val is None
    assert [v.name for v in val] == [data["ours"]] and val[0].train.num_tokens == sum(s.num_tokens for s in ours.shards)
    windows = data_lib.blended_validation_windows([v.train for v in val], None, 64, 5)
    stream = np.concatenate([s.tokens for s in ours.shards]).astype(np.int64)
    assert np.array_equal(windows[0], stream[:65]) and np.array_equal(windows[4], stream[256:321])
