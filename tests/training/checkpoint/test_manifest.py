"""Checkpoint manifests (``training/checkpoint/manifest.py``) and the checkpoint folder rules built on them
(``candidates``, ``_prunable`` in ``training/checkpoint/saving.py``), on small files in one process:
``verify`` runs without a process group (its all-reduce is then a no-op), and the ranks' shares
are exercised by calling each rank's part in turn.
"""

from __future__ import annotations

import json
import time
import zlib

import pytest
import torch

from training.checkpoint import layout, resume
from training.checkpoint import manifest
from training.checkpoint import saving

CPU = torch.device("cpu")
FILES = {"mp_rank_00_model_states.pt": b"m" * 1000,
         "zero_pp_rank_0_mp_rank_00_optim_states.pt": b"a" * 3000,
         "zero_pp_rank_1_mp_rank_00_optim_states.pt": b"b" * 3000,
         "offloaded_tensors/rank0/x.bin": bytes(range(256)) * 4}


def _saved(folder, world=2):
    """``folder`` with FILES and its manifest, as a save leaves it at ``world`` ranks."""
    for name, data in FILES.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    for rank in range(world):
        manifest.write_share(folder, rank, world)
    manifest.merge(folder, 7, {"world_size": world, "dp_world_size": world, "mp_world_size": 1}, world)
    return folder


def test_manifest_lists_every_file_and_verifies(tmp_path):
    folder = _saved(tmp_path / "step00000007")
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        ["manifest.json", "offloaded_tensors", *[n for n in FILES if "/" not in n]])   # shares gone
    written = json.loads((folder / "manifest.json").read_text())
    assert written["step"] == 7 and written["layout"]["world_size"] == 2
    assert {n: e["bytes"] for n, e in written["files"].items()} == {n: len(d) for n, d in FILES.items()}
    assert written["files"]["mp_rank_00_model_states.pt"]["crc32"] == f"{zlib.crc32(b'm' * 1000):08x}"
    assert manifest.verify(folder, 0, 1, CPU) is None


@pytest.mark.parametrize("damage,reason", [
    (lambda f: f.joinpath("offloaded_tensors/rank0/x.bin").write_bytes(
        b"\x01" + FILES["offloaded_tensors/rank0/x.bin"][1:]),
     "has offloaded_tensors/rank0/x.bin with the wrong checksum"),
    (lambda f: f.joinpath("zero_pp_rank_1_mp_rank_00_optim_states.pt").write_bytes(b"b" * 1500),
     "has zero_pp_rank_1_mp_rank_00_optim_states.pt of the wrong size"),
    (lambda f: f.joinpath("mp_rank_00_model_states.pt").unlink(), "is missing mp_rank_00_model_states.pt"),
    (lambda f: f.joinpath("manifest.json").unlink(), "has no manifest.json"),
    (lambda f: f.joinpath("manifest.json").write_text('{"files": [1]}'), "has an unreadable manifest.json"),
], ids=["one_byte", "truncated", "file_missing", "no_manifest", "bad_manifest"])
def test_verification_names_the_damaged_file(tmp_path, damage, reason):
    folder = _saved(tmp_path / "step00000007")
    damage(folder)
    assert manifest.verify(folder, 0, 1, CPU) == reason
    assert manifest.verify(tmp_path / "step00000099", 0, 1, CPU) == "is missing"


def test_each_rank_checks_its_share(tmp_path):
    # Largest first, then by name: the two optimizer files go to different ranks, and rank 1
    # checks zero_pp_rank_1 (index 1) and mp_rank_00 (index 3).
    folder = _saved(tmp_path / "step00000007")
    (folder / "zero_pp_rank_1_mp_rank_00_optim_states.pt").write_bytes(b"B" * 3000)
    assert manifest._check_share(folder, 0, 2) == (0, 0)
    assert manifest._check_share(folder, 1, 2) == (manifest._WRONG_CRC, 1)
    assert manifest.verify(folder, 0, 1, CPU) == (
        "has zero_pp_rank_1_mp_rank_00_optim_states.pt with the wrong checksum")


def test_merge_refuses_a_file_that_changed_after_hashing(tmp_path):
    folder = tmp_path / "step00000007"
    _saved(folder)
    (folder / "manifest.json").unlink()
    for rank in range(2):
        manifest.write_share(folder, rank, 2)
    with open(folder / "mp_rank_00_model_states.pt", "ab") as f:
        f.write(b"late")
    with pytest.raises(ValueError, match=r"step00000007: mp_rank_00_model_states\.pt changed while "
                                         r"the ranks hashed it .*: save to a filesystem every rank shares"):
        manifest.merge(folder, 7, {}, 2)
    assert not (folder / "manifest.json").exists()


def test_resume_candidates_and_pruning(tmp_path):
    ckpt = tmp_path / "checkpoints"
    for step in (3, 6, 9, 12):
        _saved(ckpt / layout.tag_for_step(step), world=1)
    for step in (5, 15):                                  # saves that never got their manifest
        (ckpt / layout.tag_for_step(step)).mkdir()
    (ckpt / "latest").write_text("step00000099")          # a folder that is gone
    assert layout.candidates(ckpt) == ["step00000099", "step00000015", "step00000012",
                                           "step00000009", "step00000006", "step00000005",
                                           "step00000003"]
    # After step 9 was saved (a resume from an older checkpoint): 12 and 15 are newer, kept.
    prune = saving._prunable(ckpt, "step00000009", keep_last=2)
    assert sorted(p.name for p in prune) == ["step00000003", "step00000005"]
    assert saving._prunable(ckpt, "step00000009", keep_last=0) == []
    assert layout.candidates(tmp_path / "none") == []


def test_only_unfinished_saves_start_from_step_0_with_one_warning(tmp_path, capsys):
    """Folders of saves never published (no manifest anywhere, no ``latest``: a kill during the
    first background save) are not checkpoints: the resume starts over and says so. With a
    ``latest`` pointer, or a manifest in any folder, the same folders go through verification
    (``test_train.py`` covers the refusal when none verifies)."""
    class Rank0:
        global_rank = 0

    ckpt = tmp_path / "checkpoints"
    (ckpt / "step00000003").mkdir(parents=True)
    (ckpt / "step00000003" / "mp_rank_00_model_states.pt").write_bytes(b"cut")
    assert resume._verified_tag(Rank0(), ckpt) is None
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"warning: {ckpt} holds only unfinished saves (step00000003: no manifest, never "
                   f"published); starting from step 0"]
    (ckpt / "latest").write_text("step00000003")

    class Unverifiable(Rank0):
        module = torch.nn.Linear(1, 1)
        world_size = 1

    with pytest.raises(ValueError, match="no checkpoint in .* verifies"):
        resume._verified_tag(Unverifiable(), ckpt)


def test_checksum_throughput(tmp_path):
    """Prints the hashing speed docs/checkpoints.md quotes; the bound only catches a pathology
    (e.g. reading byte by byte), it is over 15x below what 2 shared cores gave."""
    path = tmp_path / "big.bin"
    path.write_bytes(torch.randint(0, 256, (256 << 20,), dtype=torch.uint8).numpy().tobytes())
    manifest.checksum(path)                               # in the page cache from here on
    start = time.perf_counter()
    size, _ = manifest.checksum(path)
    rate = size / (time.perf_counter() - start) / 2**30
    print(f"\nchecksum: {size / 2**20:.0f} MiB at {rate:.2f} GiB/s")
    assert rate > 0.15
