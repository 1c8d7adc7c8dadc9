"""Document masking under context parallelism: a document's logits inside a packed window whose
tokens are split over cp ranks equal its logits alone, on one process.

Every model variant of tests/model/test_document_masking.py (dense, one kv head with tied
embeddings, Mixtral, Qwen3's q/k norms and biases, MLA with YaRN) at CP2 with each exchange
(a2a where cp divides the heads, allgather, p2p) and at CP4 (allgather, p2p: 4 ranks hold 8
tokens each of the 32-token window, so documents of 1 to 16 tokens span up to 3 ranks and
chunks), fp32. Each rank holds its load-balanced S/cp tokens; the window's logits are gathered
back into natural order (``gather_from_cp``) and each document's rows compared.

Tolerance 1e-5 (as test_document_masking.py: the window and the lone document run the same
products over different lengths, ~1e-7 relative per op); a token attending across a document or
at a wrong RoPE position moves its logits by O(init_std) = 0.2.
"""

from __future__ import annotations

import pytest
import torch

from model import Transformer
from model.parallel.cp_layout import gather_from_cp
from model.parallel.groups import build_groups
from training.run.spawn import run_ranks
from tests.model.test_document_masking import TOL, alone, configs, packed_window

MODES = {2: ("a2a", "allgather", "p2p"), 4: ("allgather", "p2p")}


def _ranks(rank: int, world: int, path: str) -> None:
    torch.set_num_threads(1)
    out = {}
    for name, cfg in configs().items():
        ids, labels, docs = packed_window(cfg)
        for mode in MODES[world]:
            if mode == "a2a" and cfg.num_heads % world:
                continue
            groups = build_groups(cp=world, cp_comm=mode)
            model = Transformer(cfg, groups, init_seed=3).eval()
            with torch.no_grad():
                logits = gather_from_cp(model(ids, labels).logits, groups.cp_group)   # (B, S, V)
            out[(world, name, mode)] = logits
    if rank == 0:                  # a file, not a queue: the parent reads after the ranks exit
        torch.save(out, path)


@pytest.fixture(scope="module")
def windows(tmp_path_factory):
    got = {}
    for cp in MODES:
        path = tmp_path_factory.mktemp("cp") / f"cp{cp}.pt"
        run_ranks(_ranks, cp, str(path), timeout=600.0)
        got.update(torch.load(path))
    return got


@pytest.mark.parametrize("name", list(configs()))
def test_a_documents_logits_in_a_cp_window_equal_it_alone(name, windows):
    cfg = configs()[name]
    model = Transformer(cfg, init_seed=3).eval()
    ids, labels, docs = packed_window(cfg)
    with torch.no_grad():
        lone = [alone(model, ids, labels, doc).logits[0] for doc in docs]
    cases = [key for key in windows if key[1] == name]
    assert len(cases) == (5 if cfg.num_heads % 2 == 0 else 4)       # every exchange at CP2 and CP4
    for key in cases:
        for (r, s, n), want in zip(docs, lone):
            torch.testing.assert_close(windows[key][r, s:s + n], want, **TOL, msg=f"{key} doc {(r, s, n)}")
