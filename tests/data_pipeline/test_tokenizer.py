"""data_pipeline/tokenizer.py: the byte-level BPE trained once and cached (safe under concurrent
ranks), a local HF tokenizer folder, and their one-line errors; training/data/batches.py's in-memory
``encode_texts``."""

import json
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from data_pipeline.readers import sample_texts
from data_pipeline.sources import STDLIB
from data_pipeline.tokenizer import EOS_TOKEN, load_local_tokenizer, load_tokenizer, tokenizer_fingerprint
from training.data.batches import encode_texts


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def small_sample() -> list[str]:
    return sample_texts([STDLIB], "text", 200_000)


@pytest.fixture(scope="module")
def tokenizer(small_sample, cache_dir):
    return load_tokenizer(None, small_sample, 512, cache_dir)


def test_tokenizer_trains_caches_reloads_and_round_trips(tokenizer, small_sample, cache_dir, tmp_path):
    assert 300 < len(tokenizer) <= 512
    for attr in ("eos_token", "bos_token", "pad_token", "unk_token"):
        assert getattr(tokenizer, attr) == EOS_TOKEN
    text = "def f(x):\n    return x  # héllo ✓ 🚀\n"
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.eos_token_id not in ids  # no special tokens added on its own
    assert tokenizer.decode(ids) == text  # byte-level: lossless

    # A second call hits the cache: fast, same tokenizer, one entry and no temporary leftovers.
    items = small_sample
    start = time.perf_counter()
    again = load_tokenizer(None, items, 512, cache_dir)
    assert time.perf_counter() - start < 1.0
    assert tokenizer_fingerprint(again) == tokenizer_fingerprint(tokenizer)
    entries = sorted(p.name for p in (cache_dir / "tokenizer").iterdir())
    assert len(entries) == 1 and entries[0].startswith("bpe-v1-vocab512-")
    meta = json.loads((cache_dir / "tokenizer" / entries[0] / "meta.json").read_text())
    assert meta["vocab_size"] == len(tokenizer) and meta["vocab_size_requested"] == 512
    # Identity is the content: the same texts again reuse the entry.
    load_tokenizer(None, list(small_sample), 512, cache_dir)
    assert len(list((cache_dir / "tokenizer").iterdir())) == 1

    # Training is deterministic: a fresh cache gets the very same tokenizer.
    fresh = load_tokenizer(None, items, 512, tmp_path / "fresh")
    assert tokenizer_fingerprint(fresh) == tokenizer_fingerprint(tokenizer)
    # A different vocabulary is a different entry.
    other = load_tokenizer(None, items, 400, tmp_path / "fresh")
    assert len(other) <= 400 and len(list((tmp_path / "fresh" / "tokenizer").iterdir())) == 2

    # save_pretrained -> AutoTokenizer, and the same directory as tokenizer.path.
    tokenizer.save_pretrained(tmp_path / "export")
    exported = tmp_path / "export"
    for loaded in (AutoTokenizer.from_pretrained(exported), load_tokenizer(str(exported), [], 0, cache_dir)):
        assert loaded(text)["input_ids"] == ids
        assert loaded.eos_token == loaded.pad_token == EOS_TOKEN
        assert loaded.eos_token_id == tokenizer.eos_token_id


def test_tokenizer_cache_survives_a_concurrent_writer(tmp_path, monkeypatch):
    import data_pipeline.tokenizer as tokenization

    texts = [f"line {i}: " + "spam eggs " * (i % 7) for i in range(200)]
    winner = load_tokenizer(None, texts, 300, tmp_path / "other")
    entry = next((tmp_path / "other" / "tokenizer").iterdir())
    real_train = tokenization.train_bpe_tokenizer

    def train_while_another_rank_finishes_first(*args, **kwargs):
        tokenizer = real_train(*args, **kwargs)
        shutil.copytree(entry, tmp_path / "mine" / "tokenizer" / entry.name)
        return tokenizer

    monkeypatch.setattr(tokenization, "train_bpe_tokenizer", train_while_another_rank_finishes_first)
    mine = load_tokenizer(None, texts, 300, tmp_path / "mine")
    assert tokenizer_fingerprint(mine) == tokenizer_fingerprint(winner)
    assert [p.name for p in (tmp_path / "mine" / "tokenizer").iterdir()] == [entry.name]  # no temp dirs left


def test_tokenizer_errors(tmp_path):
    with pytest.raises(ValueError, match=r"tokenizer\.path \('/no/such/dir'\).*fix"):
        load_tokenizer("/no/such/dir", [], 512, tmp_path)
    with pytest.raises(ValueError, match=r"tokenizer\.vocab_size \(100\)"):
        load_tokenizer(None, ["some text"], 100, tmp_path)


def test_tokenizer_max_train_bytes_caps_deterministically(tmp_path):
    texts = [f"document {i} " + "word " * (i % 50) for i in range(400)]
    a = load_tokenizer(None, texts, 300, tmp_path, max_train_bytes=2_000)
    meta = json.loads(next((tmp_path / "tokenizer").iterdir()).joinpath("meta.json").read_text())
    assert meta["train_bytes"] <= 2_000 and meta["train_documents"] < 400
    b = load_tokenizer(None, texts, 300, tmp_path / "b", max_train_bytes=2_000)
    assert tokenizer_fingerprint(a) == tokenizer_fingerprint(b)



def test_a_folder_that_is_not_a_tokenizer_is_one_line_naming_the_field(tmp_path):
    (tmp_path / "notes.txt").write_text("not a tokenizer")
    with pytest.raises(ValueError) as err:
        load_local_tokenizer(tmp_path)
    assert str(err.value).startswith(f"tokenizer.path ({str(tmp_path)!r}) is not a tokenizer folder")
    assert "\n" not in str(err.value)


def test_encode_texts_appends_eos_after_every_text(tokenizer):
    texts = ["alpha beta", "gamma\ndelta", "x"]
    expected = np.concatenate([tokenizer(t)["input_ids"] + [tokenizer.eos_token_id] for t in texts])
    got = encode_texts(texts, tokenizer)
    assert got.dtype == np.uint16 and np.array_equal(got, expected)
