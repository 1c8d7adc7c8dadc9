"""data_pipeline/prepare.py and launch/prepare_data.py: what the preparation writes reads back in
megatron-core with exactly the tokenizer's encoding + EOD per document, from every input format;
publishing is atomic, reruns skip finished shards, --shard i/K and worker counts change nothing
in the output, and bad input is one line (exit 2) with nothing written."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from data_pipeline import encoder as encoder_module
from data_pipeline import prepare
from data_pipeline.indexed import open_prepared
from data_pipeline.prepare import prepare_dataset
from data_pipeline.readers import sample_texts
from data_pipeline.sources import STDLIB, plan_shards, stdlib_files, unit_hash
from tests.data_pipeline import megatron_indexed, save_tokenizer, text, write_jsonl

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return save_tokenizer(tmp_path_factory.mktemp("tok") / "bpe")


@pytest.fixture(scope="module")
def tokenizer(tok_dir):
    from data_pipeline.tokenizer import load_local_tokenizer

    return load_local_tokenizer(tok_dir)


def _expected(tokenizer, texts: list[str]) -> list[list[int]]:
    return [tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for t in texts]


def _corpus(root: Path) -> dict[str, list[str]]:
    """Three .jsonl files, one .jsonl.gz, one .parquet and four .txt files, with their texts."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = {}
    for name, first in (("a.jsonl", 0), ("b.jsonl", 40), ("c.jsonl", 80)):
        write_jsonl(root / name, first, 40)
        texts[name] = [text(i) for i in range(first, first + 40)]
    with gzip.open(root / "d.jsonl.gz", "wt") as f:
        texts["d.jsonl.gz"] = [text(i) for i in range(120, 150)]
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts["d.jsonl.gz"])
    texts["e.parquet"] = [text(i) for i in range(150, 190)]
    pq.write_table(pa.table({"text": texts["e.parquet"]}), root / "e.parquet", row_group_size=7)
    for i in range(4):
        (root / "txt" / f"{i}.txt").parent.mkdir(exist_ok=True)
        (root / "txt" / f"{i}.txt").write_text(text(200 + i) * 3)
    return texts


def _files(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir()) if p.is_file()}


def _without_timing(root: Path) -> dict:
    """The files, but each shard's .json without its "seconds" (wall time, which differs between
    two runs of the same preparation) and the manifest's command without the output folder's name
    (each run names its own)."""
    out = {}
    for name, data in _files(root).items():
        if name.endswith("manifest.json"):
            data = data.replace(str(root).encode(), b"OUT")
        elif name.endswith(".json"):
            meta = json.loads(data)
            meta.pop("seconds")
            data = meta
        out[name] = data
    return out


def test_every_format_reads_back_in_megatron_core_as_the_tokenizers_encoding(tmp_path, tok_dir, tokenizer):
    mi = megatron_indexed()
    texts = _corpus(tmp_path / "in")
    inputs = [str(tmp_path / "in" / "*.json*"), str(tmp_path / "in" / "e.parquet"),
              str(tmp_path / "in" / "txt")]
    prefix = prepare_dataset(inputs, tmp_path / "out" / "c", tok_dir, progress=False)
    assert prefix == tmp_path / "out" / "c_text_document"
    ds = open_prepared(prefix)
    sources = [Path(s["source"]).name for s in ds.manifest["shards"]]
    assert sources == ["a.jsonl", "b.jsonl", "c.jsonl", "d.jsonl.gz", "e.parquet", "txt"]
    # The .txt group writes its documents in the hash order of their keys.
    txt_keys = sorted((f"{i}.txt" for i in range(4)), key=lambda k: unit_hash(k, "cap"))
    texts["txt"] = [(tmp_path / "in" / "txt" / k).read_text() for k in txt_keys]
    assert ds.tokenizer_fingerprint == ds.manifest["tokenizer"]["fingerprint"]
    for shard, source in zip(ds.shards, sources):
        theirs = mi.IndexedDataset(str(shard.prefix))
        expected = _expected(tokenizer, texts[source])
        assert len(theirs) == shard.num_documents == len(expected), source
        for i, ids in enumerate(expected):
            assert theirs[i].tolist() == ids == shard[i].tolist(), (source, i)
        meta = json.loads(shard.prefix.with_name(shard.prefix.name + ".json").read_text())
        raw = (tmp_path / "in" / source)
        if raw.is_file():
            import hashlib

            assert meta["source"]["sha256"] == hashlib.sha256(raw.read_bytes()).hexdigest(), source
            assert meta["source"]["bytes"] == raw.stat().st_size
    assert ds.max_token_id == max(max(max(ids) for ids in _expected(tokenizer, t)) for t in texts.values())
    assert ds.shards[0].dtype == np.uint16


def test_hf_datasets_saved_cached_and_streamed(tmp_path, tok_dir, tokenizer, monkeypatch):
    import datasets

    rows = [text(i) for i in range(60)]
    datasets.Dataset.from_dict({"text": rows, "n": list(range(60))}).save_to_disk(
        str(tmp_path / "saved"), num_shards=3)
    write_jsonl(tmp_path / "raw" / "x.jsonl", 0, 25)
    write_jsonl(tmp_path / "raw" / "y.jsonl", 25, 35)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    for entry, shards in ((f"hf:{tmp_path / 'saved'}", 3), (f"hf:{tmp_path / 'raw'}", 1),
                          (f"hf-stream:{tmp_path / 'raw'}", 2)):
        ds = open_prepared(prepare_dataset([entry], tmp_path / "out" / entry[:2], tok_dir, progress=False))
        assert len(ds.shards) == shards, entry
        got = [d.tolist() for s in ds.shards for d in (s[i] for i in range(s.num_documents))]
        assert got == _expected(tokenizer, rows), entry


def test_stdlib_documents_in_hash_order_and_capped_whole(tmp_path, tok_dir):
    plans = plan_shards([STDLIB], max_bytes=300_000)
    assert len(plans) == 1 and plans[0].kind == "files"
    keys = list(plans[0].keys)
    assert keys == sorted(keys, key=lambda k: unit_hash(k, "cap"))
    sizes = {k: p.stat().st_size for p, k in stdlib_files()}
    assert 0.9 * 300_000 < sum(sizes[k] for k in keys) <= 300_000
    assert all(sizes[k] > 0 for k in keys) and not any("site-packages" in k for k in keys)
    # The cap visits the keys in that hash order and keeps what fits: spread over the library.
    assert len({k.split("/")[0][0] for k in keys}) > 5
    ds = open_prepared(prepare_dataset([STDLIB], tmp_path / "std", tok_dir, progress=False, max_bytes=300_000))
    assert ds.shards[0].num_documents == len(keys)


def test_row_caps_take_the_first_rows_of_each_file_in_proportion(tmp_path, tok_dir):
    write_jsonl(tmp_path / "a.jsonl", 0, 200)
    write_jsonl(tmp_path / "b.jsonl", 200, 200)
    total = sum(len(text(i).encode()) for i in range(400))
    ds = open_prepared(prepare_dataset([str(tmp_path / "*.jsonl")], tmp_path / "o", tok_dir,
                                       progress=False, max_bytes=total // 4))
    counts = [s.num_documents for s in ds.shards]
    assert all(35 < c < 65 for c in counts), counts        # about a quarter of each file's 200 rows
    kept = sum(len(text(i).encode()) for i in range(counts[0])) + sum(
        len(text(200 + i).encode()) for i in range(counts[1]))
    assert kept <= total // 4
    sample = sample_texts([str(tmp_path / "*.jsonl")], "text", total // 4)
    assert sample == [text(i) for i in range(counts[0])] + [text(200 + i) for i in range(counts[1])]


def test_killed_run_leaves_no_shard_and_rerun_skips_finished_ones(tmp_path, tok_dir, monkeypatch):
    for i, name in enumerate("abc"):
        write_jsonl(tmp_path / "in" / f"{name}.jsonl", 50 * i, 50)
    inputs, out = [str(tmp_path / "in" / "*.jsonl")], tmp_path / "out" / "k"
    monkeypatch.setattr(prepare, "BATCH_BYTES", 500)          # several batches per shard
    real, calls = encoder_module.encode, []

    def dies_in_the_second_shard(texts):
        calls.append(len(texts))
        if any(t == text(55) for t in texts):
            raise KeyboardInterrupt                            # a kill, mid-shard
        return real(texts)

    monkeypatch.setattr(encoder_module, "encode", dies_in_the_second_shard)
    with pytest.raises(KeyboardInterrupt):
        prepare_dataset(inputs, out, tok_dir, progress=False)
    names = sorted(p.name for p in out.parent.iterdir())
    assert names == ["k_text_document-00000-of-00003.bin", "k_text_document-00000-of-00003.idx",
                     "k_text_document-00000-of-00003.json", "k_text_document.manifest.json"]
    with pytest.raises(ValueError, match=r"2 of 3 shards are not prepared \(shard 1, 2\); fix: finish "
                                         r"them with `python launch/prepare_data.py --input .*\*\.jsonl"):
        open_prepared(tmp_path / "out" / "k_text_document")

    monkeypatch.setattr(encoder_module, "encode", lambda texts: calls.append(len(texts)) or real(texts))
    calls.clear()
    prepare_dataset(inputs, out, tok_dir, progress=False)
    assert sum(calls) == 100                                  # shards 1 and 2 only, once each
    first = _files(out.parent)
    calls.clear()
    prepare_dataset(inputs, out, tok_dir, progress=False)
    assert calls == [] and _files(out.parent) == first        # nothing re-tokenized or rewritten

    # A changed source is prepared again, and only that one.
    write_jsonl(tmp_path / "in" / "b.jsonl", 50, 49)
    os.utime(tmp_path / "in" / "b.jsonl", ns=(1, 1))
    prepare_dataset(inputs, out, tok_dir, progress=False)
    assert sum(calls) == 49 and open_prepared(tmp_path / "out" / "k_text_document").shards[1].num_documents == 49


def test_a_rerun_prepares_a_damaged_shard_again(tmp_path, tok_dir, monkeypatch):
    """A published shard whose .bin or .idx was cut short or lost (a crash, a copy stopped half
    way): the rerun that the trainer's error asks for redoes that shard, bitwise as before, and
    only it; the sizes are checked against its .json, no token is read."""
    for i, name in enumerate("ab"):
        write_jsonl(tmp_path / "in" / f"{name}.jsonl", 50 * i, 50)
    inputs, out = [str(tmp_path / "in" / "*.jsonl")], tmp_path / "out" / "d"
    prepare_dataset(inputs, out, tok_dir, progress=False)
    whole = _without_timing(out.parent)
    real, calls = encoder_module.encode, []
    monkeypatch.setattr(encoder_module, "encode", lambda texts: calls.append(len(texts)) or real(texts))
    for damage in ("d_text_document-00001-of-00002.bin", "d_text_document-00000-of-00002.idx"):
        path = out.parent / damage
        path.write_bytes(path.read_bytes()[:-16])                 # truncated
        with pytest.raises(ValueError):
            open_prepared(tmp_path / "out" / "d_text_document")   # what the trainer reads refuses it
        calls.clear()
        prepare_dataset(inputs, out, tok_dir, progress=False)
        assert sum(calls) == 50 and _without_timing(out.parent) == whole, damage     # that shard, again
    (out.parent / "d_text_document-00000-of-00002.bin").unlink()            # lost
    calls.clear()
    prepare_dataset(inputs, out, tok_dir, progress=False)
    assert sum(calls) == 50 and _without_timing(out.parent) == whole


def test_a_hung_worker_raises_within_the_timeout_and_is_killed(tokenizer, monkeypatch):
    """Both tokenizer workers stopped mid-run (SIGSTOP: a hang that never returns): the wait for
    the next result gives up after RESULT_TIMEOUT_S with one line, and the encoder kills the
    workers instead of waiting for the hung task, so the error leaves within a few seconds."""
    import signal
    import time

    import psutil
    monkeypatch.setattr(encoder_module, "RESULT_TIMEOUT_S", 2.0)
    backend = tokenizer.backend_tokenizer.to_str()
    batches = ([text(i)] * 50 for i in range(1000))
    start = None
    with pytest.raises(TimeoutError, match=r"a tokenizer worker returned nothing for 2 s; fix:"):
        with encoder_module.Encoder(backend, None, "uint16", workers=2) as enc:
            workers = list(enc._pool._processes.values())
            for _ in enc.map(batches):
                if start is None:
                    for proc in workers:
                        os.kill(proc.pid, signal.SIGSTOP)
                    start = time.monotonic()
    took = time.monotonic() - start
    assert took < 2.0 + 4.0, took

    def gone(pid: int) -> bool:
        """Killed: exited or a zombie. (``proc.exitcode`` can still read None here: the
        executor's own thread may be reaping the same process.)"""
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    deadline = time.monotonic() + 5.0
    while not all(gone(proc.pid) for proc in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(gone(proc.pid) for proc in workers)                      # gone, not left stopped


def test_shards_split_over_machines_and_workers_give_identical_bytes(tmp_path, tok_dir, monkeypatch):
    _corpus(tmp_path / "in")
    inputs = [str(tmp_path / "in" / "*.jsonl"), str(tmp_path / "in" / "txt")]
    monkeypatch.setattr(prepare, "BATCH_BYTES", 2_000)        # many batches in flight at 2 workers
    whole = prepare_dataset(inputs, tmp_path / "one" / "c", tok_dir, progress=False)
    for i in range(2):
        prepare_dataset(inputs, tmp_path / "two" / "c", tok_dir, progress=False, shard=(i, 2))
    prepare_dataset(inputs, tmp_path / "workers" / "c", tok_dir, progress=False, workers=2)

    reference = _without_timing(tmp_path / "one")
    assert len(reference) == 4 * 3 + 1 and whole.parent == tmp_path / "one"
    assert _without_timing(tmp_path / "two") == reference
    assert _without_timing(tmp_path / "workers") == reference


def test_bad_input_is_one_line_and_writes_nothing(tmp_path, tok_dir):
    write_jsonl(tmp_path / "good.jsonl", 0, 5)
    (tmp_path / "late.jsonl").write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"body": "x"}) + "\n")
    (tmp_path / "notok").mkdir()
    (tmp_path / "notok" / "config.json").write_text("{}")
    out = tmp_path / "out"
    out.mkdir()
    cases = [
        (dict(inputs=[str(tmp_path / "none*.jsonl")]), r"--input entry '.*none\*\.jsonl' matches no files"),
        (dict(tokenizer_dir=tmp_path / "notok"), r"--tokenizer \('.*notok'\) is not a tokenizer folder "
                                                 r"\(.*\); fix: point it at a folder written by save_pretrained"),
        (dict(tokenizer_dir=tmp_path / "absent"), r"--tokenizer \('.*absent'\) is not a local directory"),
        (dict(json_key="body"), r"--json-keys \('body'\) is missing from .*good\.jsonl:1 \(has: \['id', "
                                r"'text'\]\); fix: set --json-keys"),
        (dict(shard=(2, 2)), r"--shard \(2/2\) must be i/K with 0 <= i < K"),
    ]
    for overrides, match in cases:
        args = {"inputs": [str(tmp_path / "good.jsonl")], "output_prefix": out / "x",
                "tokenizer_dir": tok_dir, "progress": False, **overrides}
        with pytest.raises(ValueError, match=match) as info:
            prepare_dataset(args.pop("inputs"), args.pop("output_prefix"), args.pop("tokenizer_dir"), **args)
        assert "\n" not in str(info.value)
        assert list(out.iterdir()) == [], overrides
    # A row deep in a file without the key: that shard fails, leaving none of it visible.
    with pytest.raises(ValueError, match=r"--json-keys \('text'\) is missing from .*late\.jsonl:2 "):
        prepare_dataset([str(tmp_path / "late.jsonl")], out / "y", tok_dir, progress=False)
    assert [p.name for p in out.iterdir()] == ["y_text_document.manifest.json"]


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "launch" / "prepare_data.py"), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def test_command_line_trains_a_tokenizer_prepares_and_fails_in_one_line(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", 0, 300)
    done = _cli("--input", "a.jsonl", "--train-tokenizer", "tok", "--vocab-size", "300",
                "--sample-bytes", "20000", "--output-prefix", "out/a", "--append-eod", "--workers", "1",
                "--no-progress", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "prepared: out/a_text_document" in done.stdout
    ds = open_prepared(tmp_path / "out" / "a_text_document")
    assert ds.shards[0].num_documents == 300 and ds.manifest["tokenizer"]["vocab_size"] <= 300
    meta = json.loads((tmp_path / "tok" / "meta.json").read_text())
    assert meta["train_bytes"] <= 20_000 and meta["train_documents"] < 300
    for args, match in ((("--train-tokenizer", "tok"), "--train-tokenizer ('tok') already exists; fix:"),
                        (("--tokenizer", "nowhere", "--output-prefix", "o"), "--tokenizer ('nowhere') is "
                                                                             "not a local directory"),
                        (("--tokenizer", "tok"), "--output-prefix is required")):
        bad = _cli("--input", "a.jsonl", *args, cwd=tmp_path)
        assert bad.returncode == 2 and bad.stderr.startswith(f"error: {match}"), bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl", "out", "tok"]


def test_slurm_array_script_runs_one_shard_per_task(tmp_path):
    write_jsonl(tmp_path / "in" / "a.jsonl", 0, 10)
    env = {**os.environ, "SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_COUNT": "4", "SLURM_CPUS_PER_TASK": "3",
           "SLURM_SUBMIT_DIR": str(REPO)}
    done = subprocess.run(["bash", str(REPO / "launch" / "prepare_data_array.sbatch"), "--dry-run",
                           "--input", "in/*.jsonl", "--output-prefix", "out/a", "--tokenizer", "tok"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    line = done.stdout.strip().splitlines()[-1]
    assert line.endswith("launch/prepare_data.py --input 'in/*.jsonl' --output-prefix out/a --tokenizer tok "
                         "--shard 1/4 --workers 3 --no-progress"), line
    from launch.prepare_data import parse_args

    import shlex

    args = parse_args(shlex.split(line)[2:])
    assert args.shard == (1, 4) and args.workers == 3
    bare = {k: v for k, v in env.items() if not k.startswith("SLURM_ARRAY")}
    script = str(REPO / "launch" / "prepare_data_array.sbatch")
    dry = subprocess.run(["bash", script, "--dry-run", "--input", "x"], env=bare, capture_output=True,
                         text=True, timeout=60)
    assert dry.returncode == 0 and "--shard 0/64 " in dry.stdout, dry.stderr     # the file's --array=0-63
    run = subprocess.run(["bash", script, "--input", "x"], env=bare, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "SLURM_ARRAY_TASK_ID" in run.stderr and not (tmp_path / "out").exists()
    shutil.rmtree(tmp_path / "in")
