"""Tests for training/corpus.py, training/data.py and training/tokenization.py: corpus, split,
packing, sampling, caches.

Small corpora (a ~200 KB slice of the stdlib, a few synthetic documents) keep this file fast.
"""

import json
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from training.corpus import (
    Document,
    cap_documents,
    load_corpus,
    load_documents,
    split_documents,
    stdlib_corpus_files,
    stdlib_documents,
)
from training.data import IGNORE_INDEX, BatchLayout, PackedSampler, encode_texts, tokenize_documents, validation_batches
from training.tokenization import EOS_TOKEN, load_tokenizer, tokenizer_fingerprint

SMALL_BYTES = 200_000


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def small_corpus():
    return load_corpus(max_bytes=SMALL_BYTES)


@pytest.fixture(scope="module")
def tokenizer(small_corpus, cache_dir):
    return load_tokenizer(None, [d.corpus_item() for d in small_corpus.train], 512, cache_dir)


@pytest.fixture(scope="module")
def train_tokens(small_corpus, tokenizer, cache_dir) -> np.ndarray:
    return tokenize_documents(small_corpus.train, tokenizer, cache_dir)


def _text_docs(texts: list[str]) -> list[Document]:
    return [Document(f"doc{i}", len(t.encode()), f"fp{i}:{t}", text=t) for i, t in enumerate(texts)]


# --- corpus and split ------------------------------------------------------------------------


def test_stdlib_corpus_found_and_deterministic():
    files = stdlib_corpus_files()
    assert len(files) > 500
    assert files == stdlib_corpus_files()
    assert all(f.suffix == ".py" for f in files)
    assert not any({"site-packages", "dist-packages"} & set(f.parts) for f in files)
    docs = stdlib_documents()
    keys = [d.key for d in docs]
    assert keys == sorted(keys) and len(set(keys)) == len(keys)
    assert "os.py" in keys and "json/decoder.py" in keys
    assert sum(d.num_bytes for d in docs) > 5_000_000
    assert [d.fingerprint for d in docs] == [d.fingerprint for d in stdlib_documents()]


def test_split_deterministic_disjoint_and_never_empty():
    docs = stdlib_documents()
    split = split_documents(docs, 0.02)
    train_keys, val_keys = {d.key for d in split.train}, {d.key for d in split.val}
    assert not train_keys & val_keys
    assert train_keys | val_keys == {d.key for d in docs}
    assert 0.005 < len(val_keys) / len(docs) < 0.05
    # The side depends on the key alone, not on the list order or anything else in the list.
    shuffled = [docs[i] for i in np.random.default_rng(0).permutation(len(docs))]
    again = split_documents(shuffled, 0.02)
    assert {d.key for d in again.val} == val_keys
    assert [d.key for d in split.val] == sorted(val_keys)  # corpus order is kept
    sub = split_documents(docs[:300], 0.02)
    expected = val_keys & {d.key for d in docs[:300]}
    assert {d.key for d in sub.val} == expected if expected else len(sub.val) == 1
    # Tiny corpora still get both sides.
    for fraction in (0.001, 0.999):
        tiny = split_documents(_text_docs(["a", "b", "c"]), fraction)
        assert tiny.train and tiny.val and len(tiny.train) + len(tiny.val) == 3
    with pytest.raises(ValueError, match=r"data\.val_fraction \(0\.0\)"):
        split_documents(docs, 0.0)
    with pytest.raises(ValueError, match="too few"):
        split_documents(_text_docs(["only one"]), 0.5)


def test_cap_documents_deterministic_and_within_budget():
    docs = stdlib_documents()
    small, large = cap_documents(docs, 100_000), cap_documents(docs, 400_000)
    assert small == cap_documents(docs, 100_000)
    assert 0 < sum(d.num_bytes for d in small) <= 100_000
    assert sum(d.num_bytes for d in large) <= 400_000
    # Spread over the corpus, not just its alphabetically first files.
    assert len({d.key.split("/")[0][0] for d in large}) > 5
    assert len(cap_documents(docs, 1)) == 1
    assert cap_documents(docs, None) == docs


# --- tokenizer -------------------------------------------------------------------------------


def test_tokenizer_trains_caches_reloads_and_round_trips(tokenizer, small_corpus, cache_dir, tmp_path):
    assert 300 < len(tokenizer) <= 512
    for attr in ("eos_token", "bos_token", "pad_token", "unk_token"):
        assert getattr(tokenizer, attr) == EOS_TOKEN
    text = "def f(x):\n    return x  # héllo ✓ 🚀\n"
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.eos_token_id not in ids  # no special tokens added on its own
    assert tokenizer.decode(ids) == text  # byte-level: lossless

    # A second call hits the cache: fast, same tokenizer, one entry and no temporary leftovers.
    items = [d.corpus_item() for d in small_corpus.train]
    start = time.perf_counter()
    again = load_tokenizer(None, items, 512, cache_dir)
    assert time.perf_counter() - start < 1.0
    assert tokenizer_fingerprint(again) == tokenizer_fingerprint(tokenizer)
    entries = sorted(p.name for p in (cache_dir / "tokenizer").iterdir())
    assert len(entries) == 1 and entries[0].startswith("bpe-v1-vocab512-")
    meta = json.loads((cache_dir / "tokenizer" / entries[0] / "meta.json").read_text())
    assert meta["vocab_size"] == len(tokenizer) and meta["vocab_size_requested"] == 512
    # Identity is the content: the same documents given as texts reuse the entry.
    load_tokenizer(None, [d.read() for d in small_corpus.train], 512, cache_dir)
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
    import training.tokenization as tokenization

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


# --- tokenized stream and packing ------------------------------------------------------------


def test_token_stream_packing_and_cache(tmp_path):
    words = ["alpha beta gamma", "delta\nepsilon", "zeta eta", "kappa"] * 5
    texts = [f"{w} number {i}" for i, w in enumerate(words)]
    tok = load_tokenizer(None, texts, 300, tmp_path)
    docs = _text_docs(texts)
    stream = tokenize_documents(docs, tok, tmp_path)
    eos = tok.eos_token_id
    expected = np.concatenate([tok(t)["input_ids"] + [eos] for t in texts])
    np.testing.assert_array_equal(stream, expected)
    assert stream.dtype == np.uint16 and isinstance(stream, np.memmap)
    np.testing.assert_array_equal(encode_texts(texts, tok), expected)
    # Cached: same file, same content; no temporary files left behind.
    again = tokenize_documents(docs, tok, tmp_path)
    assert again.filename == stream.filename
    assert all(not p.name.startswith(".") for p in (tmp_path / "tokens").iterdir())
    # A changed document changes the key.
    changed = _text_docs(texts[:-1] + ["lambda"])
    assert tokenize_documents(changed, tok, tmp_path).filename != stream.filename

    seq = 4
    n = (len(stream) - 1) // seq
    sampler = PackedSampler(stream, seq, BatchLayout(global_batch_size=n, micro_batch_size=1), seed=3)
    order = sampler.global_samples(0)
    assert sorted(order.tolist()) == list(range(n))  # one epoch visits every window once
    assert order.tolist() != list(range(n))  # and shuffled
    batches = sampler.batches_for_step(0)
    assert len(batches) == n
    for index, (inputs, labels) in zip(order, batches):
        assert inputs.dtype == labels.dtype == torch.long and inputs.shape == labels.shape == (1, seq)
        torch.testing.assert_close(labels[0, :-1], inputs[0, 1:])  # labels = inputs shifted by one
        window = stream[index * seq : index * seq + seq + 1]  # windows overlap by one token
        np.testing.assert_array_equal(inputs[0].numpy(), window[:-1])
        np.testing.assert_array_equal(labels[0].numpy(), window[1:])
    # EOS sits between documents in the stream the windows come from.
    assert int((stream == eos).sum()) == len(texts) and stream[-1] == eos


def _global_step_tokens(tokens, layouts_by_rank, step, seq_len=32, seed=7):
    """Concatenates every rank's micro-batches for one step, in rank then micro-batch order."""
    parts = []
    for layout in layouts_by_rank:
        batches = PackedSampler(tokens, seq_len, layout, seed).batches_for_step(step)
        assert len(batches) == layout.grad_accum_steps
        parts += [torch.stack([x, y]) for x, y in batches]
    return torch.cat(parts, dim=1)  # (2, G, seq_len)


def test_step_tokens_do_not_depend_on_micro_accumulation_or_dp(train_tokens):
    g = 4
    layouts = {
        "micro1_acc4_dp1": [BatchLayout(g, 1)],
        "micro4_acc1_dp1": [BatchLayout(g, 4)],
        "micro1_acc2_dp2": [BatchLayout(g, 1, dp_size=2, dp_rank=r) for r in range(2)],
        "micro2_acc1_dp2": [BatchLayout(g, 2, dp_size=2, dp_rank=r) for r in range(2)],
    }
    n = (len(train_tokens) - 1) // 32
    boundary = n // g  # this step straddles the first and second epochs when n % g != 0
    for step in (0, 1, 9, boundary, boundary + 1):
        got = {name: _global_step_tokens(train_tokens, lays, step) for name, lays in layouts.items()}
        reference = got.pop("micro1_acc4_dp1")
        assert reference.shape == (2, g, 32)
        for name, value in got.items():
            assert torch.equal(value, reference), f"{name} differs at step {step}"
    assert not torch.equal(_global_step_tokens(train_tokens, layouts["micro4_acc1_dp1"], 0),
                           _global_step_tokens(train_tokens, layouts["micro4_acc1_dp1"], 1))
    assert not torch.equal(_global_step_tokens(train_tokens, layouts["micro4_acc1_dp1"], 0, seed=8),
                           _global_step_tokens(train_tokens, layouts["micro4_acc1_dp1"], 0))


def test_epochs_reshuffle_and_cover_everything(train_tokens):
    sampler = PackedSampler(train_tokens, 64, BatchLayout(8, 8), seed=1)
    n = sampler.num_samples
    order = np.concatenate([sampler.global_samples(s) for s in range(-(-2 * n // 8))])
    first, second = order[:n], order[n : 2 * n]
    assert sorted(first) == list(range(n)) and sorted(second) == list(range(n))
    assert not np.array_equal(first, second)


def _next_batches(sampler: PackedSampler):
    """One step as the trainer takes it: the step's batches, then the step counter."""
    batches = sampler.batches_for_step(sampler.step)
    sampler.step += 1
    return batches


def test_resume_continues_identically(train_tokens):
    layout = BatchLayout(6, 3, dp_size=2, dp_rank=1)
    straight = PackedSampler(train_tokens, 16, layout, seed=5)
    expected = [_next_batches(straight) for _ in range(8)]
    first = PackedSampler(train_tokens, 16, layout, seed=5)
    for _ in range(3):
        _next_batches(first)
    state = json.loads(json.dumps(first.state_dict()))  # survives a JSON/pickle trip
    assert state["step"] == 3
    resumed = PackedSampler(train_tokens, 16, layout, seed=5)
    resumed.load_state_dict(state)
    for want in expected[3:]:
        got = _next_batches(resumed)
        assert all(torch.equal(a, b) for pair_a, pair_b in zip(got, want) for a, b in zip(pair_a, pair_b))
    with pytest.raises(ValueError, match="seed=5"):
        PackedSampler(train_tokens, 16, layout, seed=6).load_state_dict(state)


def test_batch_layout_validation(train_tokens):
    with pytest.raises(ValueError, match=r"train_batch_size \(6\).*\(1\) x .*\(4\) = 4.*fix"):
        BatchLayout(6, 4)
    with pytest.raises(ValueError, match=r"data-parallel size \(4\)"):
        BatchLayout(8, 4, dp_size=4)
    with pytest.raises(ValueError, match="dp_rank"):
        BatchLayout(8, 2, dp_size=2, dp_rank=2)
    assert BatchLayout(16, 2, dp_size=2).grad_accum_steps == 4
    with pytest.raises(ValueError, match="seq_len"):
        PackedSampler(train_tokens[:10], 32, BatchLayout(1, 1), seed=0)


def test_validation_batches_fixed_and_layout_independent(train_tokens):
    val = train_tokens[:1000]  # any stream works; the real validation split here is tiny
    seq = 16
    single = validation_batches(val, seq, BatchLayout(2, 2), num_windows=7)
    again = validation_batches(val, seq, BatchLayout(2, 2), num_windows=7)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(single, again))
    inputs = torch.cat([x for x, _ in single])
    labels = torch.cat([y for _, y in single])
    assert inputs.shape == (8, seq)  # 7 windows, padded to whole micro-batches
    for i in range(7):  # windows are the stream in order
        np.testing.assert_array_equal(inputs[i].numpy(), val[i * seq : (i + 1) * seq])
        np.testing.assert_array_equal(labels[i].numpy(), val[i * seq + 1 : (i + 1) * seq + 1])
    assert (labels[7] == IGNORE_INDEX).all()
    # Two DP ranks see the same labels between them, and the same number of batches each.
    layouts = [BatchLayout(2, 1, dp_size=2, dp_rank=r) for r in range(2)]
    ranks = [validation_batches(val, seq, layout, num_windows=7) for layout in layouts]
    assert len(ranks[0]) == len(ranks[1]) == 4
    rank_labels = torch.cat([y for r in ranks for _, y in r])
    kept = rank_labels[rank_labels != IGNORE_INDEX]
    torch.testing.assert_close(kept, labels[labels != IGNORE_INDEX])
    # The short tail window is kept, with its missing labels ignored.
    everything = validation_batches(val, seq, BatchLayout(1, 1))
    all_labels = torch.cat([y for _, y in everything])
    assert int((all_labels != IGNORE_INDEX).sum()) == len(val) - 1


# --- user data -------------------------------------------------------------------------------


def test_local_txt_jsonl_parquet_sources(tmp_path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "txt" / "sub").mkdir(parents=True)
    (tmp_path / "txt" / "a.txt").write_text("first text file")
    (tmp_path / "txt" / "sub" / "b.txt").write_text("second text file")
    rows = [{"text": "row one"}, {"text": ""}, {"text": "row three", "meta": 1}]
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    pq.write_table(pa.table({"body": ["pq zero", "pq one"], "id": [0, 1]}), tmp_path / "rows.parquet")
    monkeypatch.chdir(tmp_path)

    docs = load_documents(["txt/**/*.txt", "rows.jsonl"])
    assert [d.key for d in docs] == ["a.txt", "sub/b.txt", "rows.jsonl#0", "rows.jsonl#2"]
    assert [d.read() for d in docs] == ["first text file", "second text file", "row one", "row three"]
    assert docs[0].path is not None and docs[2].path is None
    assert load_documents(["txt/**/*.txt", "txt/a.txt"])[:1] == docs[:1]  # duplicates count once
    pq_docs = load_documents(str(tmp_path / "rows.parquet"), text_field="body")
    assert [d.read() for d in pq_docs] == ["pq zero", "pq one"]
    with pytest.raises(ValueError, match=r"data\.text_field \('text'\).*rows\.parquet"):
        load_documents("rows.parquet")
    with pytest.raises(ValueError, match=r"data\.text_field \('body'\).*rows\.jsonl:1"):
        load_documents("rows.jsonl", text_field="body")
    with pytest.raises(ValueError, match=r"rows\.csv.*not \.txt, \.jsonl or \.parquet"):
        (tmp_path / "rows.csv").write_text("x")
        load_documents("rows.*")


def test_missing_sources_name_the_field(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"data\.source entry 'nope/\*\.txt' matches no files.*fix"):
        load_documents(["nope/*.txt"])
    with pytest.raises(ValueError, match=r"data\.source entry 'missing\.jsonl' matches no files"):
        load_documents("missing.jsonl")
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"data\.source entry 'hf:no-such/dataset'.*offline.*fix") as err:
        load_documents("hf:no-such/dataset")
    assert "\n" not in str(err.value)
    assert time.perf_counter() - start < 10  # offline: no network retries


def test_hf_local_dataset_folder(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")  # keep ~/.cache clean
    folder = tmp_path / "ds"
    folder.mkdir()
    (folder / "train.jsonl").write_text("\n".join(json.dumps({"content": f"hf doc {i}"}) for i in range(3)))
    docs = load_documents(f"hf:{folder}:train", text_field="content")
    assert [d.read() for d in docs] == ["hf doc 0", "hf doc 1", "hf doc 2"]
    assert docs[1].key == f"hf:{folder}:train#1"
    with pytest.raises(ValueError, match=r"data\.text_field \('text'\)"):
        load_documents(f"hf:{folder}")
