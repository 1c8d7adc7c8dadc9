"""Multi-token prediction (model/mtp.py): targets, document boundaries, the objective, training
only, and bad input. The layouts (TP2, TP2 + SP, EP2, TP2 x EP2 + SP) are in
tests/parallel/test_model_parallel.py and, trained, tests/parallel/test_train_layouts.py.

Tolerance 1e-5 on fp32 sums of O(1) cross-entropies: a document's window and its lone copy run
the same products over different lengths (SDPA's masked path vs its causal one), ~1e-7 relative
per op; a target crossing a document or a depth reading the wrong token moves them by O(1).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from model import MixtralConfig, Transformer
from model.config import MoEConfig
from model.mtp import depth_targets, shifted
from tests.model.test_document_masking import SEP, packed_window

TOL = dict(rtol=1e-5, atol=1e-5)
CFG = MixtralConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=4,
                    ffn_hidden_size=48, max_seq_len=32, init_std=0.2, attention="mla", q_lora_rank=12,
                    kv_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5, mtp_depth=2,
                    moe=MoEConfig(num_experts=4, top_k=2, capacity_factor=None, eval_capacity_factor=None,
                                  first_k_dense=1))


def test_depth_targets_written_out():
    labels = torch.tensor([[1, 2, 3, 4, 5, -100]])          # token t+1 at position t
    assert shifted(labels, 2, -100).tolist() == [[3, 4, 5, -100, -100, -100]]
    assert depth_targets(labels, 1, None).tolist() == [[2, 3, 4, 5, -100, -100]]
    # Documents [0 0 0][1 1 1]: position i keeps labels[i + k] only if token i + k + 1 is in i's document.
    docs = torch.tensor([[0, 0, 0, 1, 1, 1]])
    assert depth_targets(labels, 1, docs).tolist() == [[2, -100, -100, 5, -100, -100]]
    assert depth_targets(labels, 2, docs).tolist() == [[-100, -100, -100, -100, -100, -100]]


def test_a_documents_mtp_losses_in_a_window_equal_it_alone():
    """With document masking each MTP depth's loss summed over the packed window's documents is
    the sum of each document's loss alone: no target and no attention crosses a document."""
    cfg = dataclasses.replace(CFG, document_separator_id=SEP).validate()
    torch.manual_seed(0)
    model = Transformer(cfg, init_seed=3).train()
    ids, labels, docs = packed_window(cfg)
    window = model(ids, labels)
    alone = [model(ids[r:r + 1, s:s + n], labels[r:r + 1, s:s + n]) for r, s, n in docs]
    for k in range(cfg.mtp_depth):
        torch.testing.assert_close(window.mtp_ce_sum[k], sum(o.mtp_ce_sum[k] for o in alone), **TOL)
        assert window.mtp_target_tokens[k] == sum(o.mtp_target_tokens[k] for o in alone)
    assert window.mtp_target_tokens[1] < window.mtp_target_tokens[0] < window.num_target_tokens


def test_objective_trains_the_modules_and_only_in_training():
    torch.manual_seed(0)
    model = Transformer(CFG, init_seed=3).train()
    ids = torch.randint(0, CFG.vocab_size, (2, 16))
    labels = torch.cat((ids[:, 1:], torch.full_like(ids[:, :1], -100)), dim=1)
    out = model(ids, labels)
    assert [int(n) for n in out.mtp_target_tokens] == [28, 26]         # 15 - k targets per row
    assert len(out.moe_aux) == CFG.num_moe_layers == 3                 # block 1 and both depths
    want = CFG.mtp_loss_coef / 2 * (out.mtp_ce_sum[0] + out.mtp_ce_sum[1])
    torch.testing.assert_close(model.mtp_objective(out), want)
    model.mtp_objective(out).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.mtp.parameters())
    assert model.embed_tokens.weight.grad.abs().sum() > 0             # the shared embedding
    assert CFG.num_params() == sum(p.numel() for p in model.parameters())
    model.eval()
    assert model(ids, labels).mtp_ce_sum == [] and model.mtp_objective(model(ids, labels)) == 0.0
    model.mtp_in_eval = True
    assert len(model(ids, labels).mtp_ce_sum) == 2


def test_mtp_blocks_are_numbered_after_the_model_as_deepseek_does():
    """Depth d's block is block ``num_layers + d - 1`` (DeepSeek-V3's layer 61 after layers
    0..60): with an MoE block every second layer (1 and 3 of 0..4), the first depth's block (5)
    is MoE and the second's (6) dense, as ``moe_block_ids`` (the router statistics' rows) says."""
    moe = dataclasses.replace(CFG.moe, first_k_dense=0, moe_layer_freq=2)
    cfg = dataclasses.replace(CFG, num_layers=5, moe=moe).validate()
    model = Transformer(cfg, init_seed=3).train()
    assert cfg.moe_block_ids == [1, 3, 5] and [m.block.is_moe for m in model.mtp] == [True, False]
    ids = torch.randint(0, cfg.vocab_size, (1, 8))
    assert len(model(ids, ids).moe_aux) == cfg.num_moe_layers == len(model._moe_layers()) == 3


def test_mtp_bad_input_is_one_line():
    with pytest.raises(ValueError, match=r"^model.mtp_depth \(-1\) must be an integer >= 0"):
        dataclasses.replace(CFG, mtp_depth=-1).validate()
    with pytest.raises(ValueError, match=r"^model.mtp_loss_coef \(-0.1\) must be a finite number >= 0"):
        dataclasses.replace(CFG, mtp_loss_coef=-0.1).validate()
