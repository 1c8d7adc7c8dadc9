"""data_pipeline/sources.py and readers.py: how inputs become shards (groups of .txt files, one
shard per row file, HF datasets), what each reader yields, and their one-line errors."""

from __future__ import annotations

import json

import pytest

from data_pipeline import sources
from data_pipeline.readers import ShardReader, check_fields, sample_texts
from data_pipeline.sources import Fields, plan_shards, unit_hash
from tests.data_pipeline import text, write_jsonl


def _texts(plan, key="text", fields=Fields()) -> list[str]:
    return [t for batch in ShardReader(plan, key, fields).batches(1_000) for t in batch]


def test_txt_files_group_by_size_in_path_order_documents_in_hash_order(tmp_path, monkeypatch):
    for i in range(10):
        (tmp_path / "d" / f"{i:02d}.txt").parent.mkdir(exist_ok=True)
        (tmp_path / "d" / f"{i:02d}.txt").write_text("x" * 100 + str(i))
    (tmp_path / "d" / "empty.txt").write_text("")
    monkeypatch.setattr(sources, "TXT_SHARD_BYTES", 350)           # 3 files of 101 bytes per group
    plans = plan_shards([str(tmp_path / "d" / "*.txt")])
    groups = [sorted(p.keys) for p in plans]
    assert groups == [["00.txt", "01.txt", "02.txt"], ["03.txt", "04.txt", "05.txt"],
                      ["06.txt", "07.txt", "08.txt"], ["09.txt"]]       # the empty file left out
    for p in plans:
        assert list(p.keys) == sorted(p.keys, key=lambda k: unit_hash(k, "cap"))
        assert _texts(p) == [(tmp_path / "d" / k).read_text() for k in p.keys]
    # Keys are relative to the glob's fixed part: the same corpus elsewhere plans the same.
    again = plan_shards([str(tmp_path / "d")])
    assert [p.keys for p in again] == [p.keys for p in plans]
    assert [p.stat_key for p in again] == [p.stat_key for p in plans]
    (tmp_path / "d" / "04.txt").write_text("changed")
    assert plan_shards([str(tmp_path / "d")])[1].stat_key != plans[1].stat_key


def test_row_files_one_shard_each_and_files_matched_twice_count_once(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", 0, 3)
    write_jsonl(tmp_path / "b.jsonl", 3, 2)
    (tmp_path / "blank.jsonl").write_text("\n" + json.dumps({"text": ""}) + "\n" + json.dumps({"text": "x"}) + "\n")
    plans = plan_shards([str(tmp_path / "a.jsonl"), str(tmp_path / "*.jsonl")])
    assert [p.source.rsplit("/", 1)[-1] for p in plans] == ["a.jsonl", "b.jsonl", "blank.jsonl"]
    assert _texts(plans[0]) == [text(i) for i in range(3)]
    assert _texts(plans[2]) == ["x"]                                   # blank lines and empty texts skipped


def test_zstandard_jsonl_reads_or_says_what_is_missing(tmp_path):
    try:
        import zstandard
    except ImportError:
        zstandard = None
    path = tmp_path / "a.jsonl.zst"
    rows = b"".join(json.dumps({"text": text(i)}).encode() + b"\n" for i in range(5))
    if zstandard is None:
        path.write_bytes(b"\x28\xb5\x2f\xfd" + rows)   # the frame magic; never decompressed
        with pytest.raises(ValueError, match=r"a\.jsonl\.zst is zstandard-compressed and the zstandard "
                                             r"module is missing; fix: pip install zstandard"):
            _texts(plan_shards([str(path)])[0])
    else:
        path.write_bytes(zstandard.ZstdCompressor().compress(rows))
        assert _texts(plan_shards([str(path)])[0]) == [text(i) for i in range(5)]


def test_sample_texts_spreads_over_the_input_deterministically(tmp_path):
    for i in range(40):
        (tmp_path / f"{i:02d}.txt").write_text(f"file {i} " * 50)
    sample = sample_texts([str(tmp_path / "*.txt")], "text", 2_000)
    assert sample == sample_texts([str(tmp_path / "*.txt")], "text", 2_000)
    assert 1_500 < sum(len(t) for t in sample) <= 2_000
    picked = sorted(int(t.split()[1]) for t in sample)
    assert picked != list(range(len(picked))) and picked[-1] >= 20    # not the first files


def test_bad_inputs_are_one_line(tmp_path, monkeypatch):
    (tmp_path / "x.csv").write_text("a,b\n")
    (tmp_path / "array.json").write_text('[\n {"text": "a"}\n]\n')
    (tmp_path / "num.jsonl").write_text(json.dumps({"text": 3}) + "\n")
    fields = Fields(input="data.source", json_key="data.text_field")
    cases = [
        ([str(tmp_path / "*.csv")], r"data\.source entry '.*\*\.csv' matched .*x\.csv, which is not \.txt, "
                                    r"\.jsonl\(\.gz/\.zst\), \.json or \.parquet; fix:"),
        ([str(tmp_path / "array.json")], r"array\.json:1 is not a JSON object on one line .*; fix: write one "
                                         r"JSON object per line"),
        ([str(tmp_path / "num.jsonl")], r"data\.text_field \('text'\) in .*num\.jsonl:1 is int, not a string"),
        ([], r"data\.source \(\[\]\) must be a non-empty list of inputs"),
        ([f"hf:{tmp_path / 'no_such_dataset'}"], r"data\.source entry 'hf:.*no_such_dataset': cannot open the "
                                                 r"HF dataset offline \(.*\); fix: cache it beforehand"),
    ]
    for inputs, match in cases:
        with pytest.raises(ValueError, match=match) as info:
            check_fields(plan_shards(inputs, "text", fields=fields), "text", fields)    # caught when planned
        assert "\n" not in str(info.value), inputs
    with pytest.raises(ValueError, match=r"data\.text_field \('body'\) is missing from .*num\.jsonl:1"):
        check_fields(plan_shards([str(tmp_path / "num.jsonl")], "body", fields=fields), "body", fields)
    # Without the check, planning opens no file; the reader says the same line.
    plans = plan_shards([str(tmp_path / "num.jsonl")], "text", fields=fields)
    with pytest.raises(ValueError, match=r"data\.text_field \('text'\) in .*num\.jsonl:1 is int"):
        _texts(plans[0], "text", fields)
