"""data_pipeline/indexed.py: the .bin/.idx pair against megatron-core (the reference) both ways,
byte for byte; every malformed file is one DataFormatError line; prepared datasets open whole or
say what is missing."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from data_pipeline.indexed import (DataFormatError, IndexedDataset, IndexedWriter, open_prepared,
                                   optimal_dtype)
from tests.data_pipeline import megatron_indexed


def _documents(seed: int, count: int, high: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    # Lengths from 0 (an empty document) to 60 tokens.
    return [rng.integers(0, high, rng.integers(0, 61)) for _ in range(count)]


def _write(prefix, docs, dtype) -> None:
    with IndexedWriter(prefix, dtype) as w:
        for d in docs:
            w.add_document(d)


def test_optimal_dtype_is_megatrons_rule():
    assert optimal_dtype(65499) == np.uint16 and optimal_dtype(65500) == np.int32
    assert optimal_dtype(50304) == np.uint16 and optimal_dtype(128256) == np.int32


@pytest.mark.parametrize("dtype,high", [(np.uint16, 65_000), (np.int32, 200_000)])
def test_megatron_core_reads_ours_and_we_read_megatron_core(tmp_path, dtype, high):
    import torch

    mi = megatron_indexed()
    docs = _documents(0, 200, high)
    _write(tmp_path / "ours", docs, dtype)
    builder = mi.IndexedDatasetBuilder(str(tmp_path / "ref.bin"), dtype=dtype)
    for d in docs:
        builder.add_document(torch.from_numpy(d.astype(np.int64)), [len(d)])
    builder.finalize(str(tmp_path / "ref.idx"))

    # Same bytes as megatron-core's writer: the format is exactly its format.
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"ours{suffix}").read_bytes() == (tmp_path / f"ref{suffix}").read_bytes()
    theirs = mi.IndexedDataset(str(tmp_path / "ours"))
    ours = IndexedDataset(tmp_path / "ref")
    assert len(theirs) == ours.num_documents == 200
    assert ours.dtype == dtype and ours.num_tokens == sum(len(d) for d in docs)
    for i, d in enumerate(docs):
        assert np.array_equal(theirs[i], d) and np.array_equal(ours[i], d), i
    starts, ends = ours.document_bounds(np.arange(200))
    assert np.array_equal(ends - starts, [len(d) for d in docs])
    assert ours.document_bounds(199) == (int(starts[-1]), ours.num_tokens)


def test_megatron_sentence_split_documents_read_as_whole_documents(tmp_path):
    """Megatron's --split-sentences writes several sequences per document; a document's tokens
    are still one contiguous range."""
    import torch

    mi = megatron_indexed()
    builder = mi.IndexedDatasetBuilder(str(tmp_path / "s.bin"), dtype=np.uint16)
    builder.add_document(torch.tensor([1, 2, 3, 4, 5]), [2, 3])
    builder.add_document(torch.tensor([], dtype=torch.int64), [])
    builder.add_document(torch.tensor([6, 7]), [1, 1])
    builder.finalize(str(tmp_path / "s.idx"))
    ds = IndexedDataset(tmp_path / "s")
    assert ds.num_documents == 3 and len(ds.sequence_lengths) == 4
    assert [ds[i].tolist() for i in range(3)] == [[1, 2, 3, 4, 5], [], [6, 7]]


def test_writer_publishes_only_on_a_clean_exit(tmp_path):
    _write(tmp_path / "a", [np.arange(5)], np.uint16)
    with pytest.raises(RuntimeError, match="boom"):
        with IndexedWriter(tmp_path / "a", np.uint16) as w:
            w.add_document(np.arange(50))
            raise RuntimeError("boom")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bin", "a.idx"]   # no temporaries
    assert IndexedDataset(tmp_path / "a")[0].tolist() == list(range(5))        # the old pair, intact
    _write(tmp_path / "e", [], np.int32)
    empty = IndexedDataset(tmp_path / "e")
    assert empty.num_documents == 0 and empty.num_tokens == 0 and len(empty.tokens) == 0


def _corrupt(path, offset: int, data: bytes) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset:offset + len(data)] = data
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("fault,match", [
    ("magic", r"ref\.idx: not an indexed-dataset index \(no MMIDIDX header\); fix:"),
    ("version", r"ref\.idx: index version 2, only version 1 is read; fix:"),
    ("dtype", r"ref\.idx: unknown dtype code 9 .*; fix:"),
    ("truncated_idx", r"ref\.idx: \d+ bytes, but its counts \(30 sequences, 30 documents\) need \d+: "
                      r"truncated"),
    ("truncated_bin", r"ref\.bin: \d+ bytes, but its \.idx describes \d+ uint16 tokens .*truncated"),
    ("pointers", r"ref\.idx: sequence pointers do not follow the sequence lengths; fix:"),
    ("documents", r"ref\.idx: document indices run from 0 to 29, not 0 to the sequence count 30"),
    ("missing_bin", r"ref\.bin does not exist; fix:"),
    ("text", r"ref\.idx: not an indexed-dataset index"),
])
def test_malformed_pairs_are_one_line(tmp_path, fault, match):
    docs = _documents(1, 30, 1000)
    _write(tmp_path / "ref", docs, np.uint16)
    idx, bin_ = tmp_path / "ref.idx", tmp_path / "ref.bin"
    n = 30
    if fault == "magic":
        _corrupt(idx, 0, b"NOTANIDX!")
    elif fault == "version":
        _corrupt(idx, 9, struct.pack("<Q", 2))
    elif fault == "dtype":
        _corrupt(idx, 17, struct.pack("<B", 9))
    elif fault == "truncated_idx":
        idx.write_bytes(idx.read_bytes()[:-5])
    elif fault == "truncated_bin":
        bin_.write_bytes(bin_.read_bytes()[:-2])
    elif fault == "pointers":
        _corrupt(idx, 34 + 4 * n + 8 * 3, struct.pack("<q", 1))
    elif fault == "documents":
        _corrupt(idx, 34 + 12 * n + 8 * n, struct.pack("<q", n - 1))
    elif fault == "missing_bin":
        bin_.unlink()
    elif fault == "text":
        idx.write_text('{"not": "an index"}' * 5)
    with pytest.raises(DataFormatError, match=match) as info:
        IndexedDataset(tmp_path / "ref")
    assert "\n" not in str(info.value)


def test_open_prepared_finds_a_bare_pair_and_names_what_is_missing(tmp_path):
    _write(tmp_path / "mega", _documents(2, 10, 100), np.uint16)
    ds = open_prepared(tmp_path / "mega")
    assert ds.manifest is None and ds.tokenizer_fingerprint is None and ds.max_token_id is None
    assert len(ds.shards) == 1 and ds.shards[0].num_documents == 10

    with pytest.raises(DataFormatError, match=r"no prepared dataset at .*nothing \(expected "
                                              r"nothing\.manifest\.json from launch/prepare_data\.py, "
                                              r"or a Megatron nothing\.bin/nothing\.idx pair\)"):
        open_prepared(tmp_path / "nothing")

    # A manifest whose second shard has no .json yet: how many are missing and how to finish.
    for i in range(2):
        _write(tmp_path / f"p_text_document-0000{i}-of-00002", _documents(i, 4, 100), np.uint16)
    shard0 = {"documents": 4, "tokens": int(sum(len(d) for d in _documents(0, 4, 100))),
              "max_token_id": 99, "tokenizer_fingerprint": "f"}
    (tmp_path / "p_text_document-00000-of-00002.json").write_text(json.dumps(shard0))
    manifest = {"tokenizer": {"fingerprint": "f"}, "command": "python launch/prepare_data.py --input x",
                "shards": [{"prefix": f"p_text_document-0000{i}-of-00002"} for i in range(2)]}
    (tmp_path / "p_text_document.manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataFormatError, match=r"1 of 2 shards are not prepared \(shard 1\); fix: finish "
                                              r"them with `python launch/prepare_data.py --input x`.*--shard"):
        open_prepared(tmp_path / "p_text_document")
    with pytest.raises(DataFormatError, match=r"did you mean .*p_text_document\?"):
        open_prepared(tmp_path / "p")
    (tmp_path / "p_text_document-00001-of-00002.json").write_text(json.dumps({**shard0, "documents": 5}))
    with pytest.raises(DataFormatError, match=r"00001-of-00002\.idx: 4 documents / \d+ tokens, but its "
                                              r"\.json says 5"):
        open_prepared(tmp_path / "p_text_document")
