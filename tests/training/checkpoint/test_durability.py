"""What is published is on the disk first: a checkpoint's files, the ranks' manifest shares, the
tag folder's entries, ``manifest.json`` and ``latest``, and a prepared shard's ``.bin``, ``.idx``
and ``.json``, each fsynced (and its directory) before the rename or the pointer that publishes
it, so that a power or node crash cannot leave a published name on lost bytes.

The trainer runs under ``_durability_run.py``, which records every ``os.fsync`` (by path) and
``os.replace`` of every rank with a clock the ranks share; preparation runs in this process with
the same two calls recorded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.runs import SMALL

SCRIPT = "tests/training/checkpoint/_durability_run.py"


def _events(prefix: Path, ranks: int) -> list[dict]:
    rows = [json.loads(line) for r in range(ranks) for line in Path(f"{prefix}.{r}.jsonl").read_text().splitlines()]
    return sorted(rows, key=lambda e: e["t"])


def _synced_before(events: list[dict], t: float) -> set[str]:
    return {e["fsync"] for e in events if "fsync" in e and e["t"] <= t}


@pytest.mark.parametrize("background", [True, False])
def test_every_published_checkpoint_file_is_on_the_disk_before_its_manifest_and_latest(
        warm_launcher, tmp_path, background):
    run_dir, log = tmp_path / "run", tmp_path / "events"
    warm_launcher.script(SCRIPT, ["--config", "ds_configs/zero1_fp32.json", "--run-dir", str(run_dir),
                                  "--steps", "4", "--set", *SMALL, "eval.every=0", "train.save_every=2",
                                  "train.keep_last=0", f"train.async_save={str(background).lower()}"],
                         tmp_path / "run.log", extra_env={"DURABILITY_LOG": str(log)})
    events, ckpt = _events(log, 2), run_dir / "checkpoints"
    published = 0
    for e in (e for e in events if "replace" in e):
        src, dst = e["replace"]
        synced = _synced_before(events, e["t"])
        if dst.endswith("/manifest.json"):
            folder = Path(dst).parent
            files = json.loads((folder / "manifest.json").read_text())["files"]
            missing = [n for n in files if str(folder / n) not in synced]
            assert not missing, (dst, missing)                     # every file, by any rank
            assert src in synced and str(folder) in synced, dst     # the manifest itself, the folder
            published += 1
        elif dst == str(ckpt / "latest"):
            assert src in synced and str(ckpt) in synced, dst       # the pointer, the tag's entry
        elif "/manifest.rank" in dst:
            assert src in synced, dst                               # a rank's share
    assert published == 2 and (ckpt / "latest").read_text() == "step00000004"
    latest = [e["t"] for e in events if "replace" in e and e["replace"][1] == str(ckpt / "latest")]
    manifests = [e["t"] for e in events if "replace" in e and e["replace"][1].endswith("/manifest.json")]
    dirs = [e["t"] for e in events if e.get("fsync") == str(ckpt)]
    # Each pointer move comes after its checkpoint's manifest and after a sync of the folder
    # that holds the tag's name.
    for t_latest, t_manifest in zip(sorted(latest), sorted(manifests)):
        assert t_manifest < t_latest and any(t_manifest < t < t_latest for t in dirs)


def test_a_prepared_shard_is_on_the_disk_before_its_names(tmp_path, monkeypatch):
    import os

    from data_pipeline.prepare import prepare_dataset
    from tests.data_pipeline import save_tokenizer
    events = []
    fsync, replace = os.fsync, os.replace

    def recorded_fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def recorded_replace(src, dst, *args, **kwargs):
        replace(src, dst, *args, **kwargs)
        events.append(("replace", os.path.abspath(src), os.path.abspath(dst)))

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("a few words of text\n" * 200)
    monkeypatch.setattr(os, "fsync", recorded_fsync)
    monkeypatch.setattr(os, "replace", recorded_replace)
    out = tmp_path / "out" / "data"
    prepare_dataset([str(corpus)], out, save_tokenizer(tmp_path / "bpe"), progress=False)
    renames = [e for e in events if e[0] == "replace"]
    assert {Path(e[2]).suffix for e in renames} >= {".bin", ".idx", ".json"}, renames
    shards = 0
    for i, event in enumerate(events):
        if event[0] != "replace":
            continue
        before = {e[1] for e in events[:i] if e[0] == "fsync"}
        assert event[1] in before, event                            # the file, before its name
        idx = event[2][:-len(".json")] + ".idx"
        if event[2].endswith(".json") and any(e[0] == "replace" and e[2] == idx for e in events[:i]):
            # A shard's .json publishes it, last: its .bin and .idx names on the disk first.
            after_idx = events[max(j for j, e in enumerate(events[:i]) if e[0] == "replace" and e[2] == idx):i]
            assert ("fsync", str(Path(event[2]).parent)) in after_idx, event
            shards += 1
    assert shards >= 1
