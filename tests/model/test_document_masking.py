"""Document masking, single process: the document ids and positions written out, a document's
logits inside a packed window against its logits alone, the flex kernel against SDPA's mask,
the unmasked path unchanged, and the config / recipe / interop surface.

Tolerance: fp32. A document inside a window and alone computes the same sums over the same
keys; the window's masked attention adds exact zeros for the keys it hides but runs another
SDPA kernel (masked, not ``is_causal``) over a longer row, so sums differ in order only:
measured at most 2.3e-6 on logits of magnitude up to 4.3; 1e-5 is the stated bound.
Gradients compare the window's loss with the sum of the documents' losses alone (labels kept
inside each document), fp32 summation order again: 1e-5 on a loss averaged over the window's
targets. RoPE makes q.k depend on distances only, so these checks cannot see the positions'
restart; the written-out table and the RoPE-table check below do.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from model import DenseConfig, MixtralConfig, Transformer
from model import document_mask as dm
from model.config import MoEConfig, config_from_dict

SEP = 3           # the separator token (not 0, so that no test passes because ids start at 0)
SIZES = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
             ffn_hidden_size=48, max_seq_len=32, init_std=0.2)
TOL = dict(rtol=1e-5, atol=1e-5)
# Document lengths per row of a (2, 32) window, separator included; each row's last document is
# cut by the window's end (no separator). Row 0 holds an empty document (a separator alone).
ROWS = ([5, 9, 1, 13, 4], [16, 16])


def configs() -> dict:
    """Tiny fp32 models of each attention variant, masking on (``document_separator_id=SEP``).
    MoE routing dropless and without jitter: a token's expert choice is its own, so a document
    routes the same inside a window and alone."""
    moe = MoEConfig(num_experts=4, top_k=2, capacity_factor=None, eval_capacity_factor=None)
    return {
        "dense": DenseConfig(**SIZES, document_separator_id=SEP).validate(),
        "dense_tied_1kv": DenseConfig(**{**SIZES, "num_kv_heads": 1}, tie_embeddings=True,
                                      document_separator_id=SEP).validate(),
        "mixtral": MixtralConfig(**SIZES, moe=moe, document_separator_id=SEP).validate(),
        "qwen3": MixtralConfig(**SIZES, moe=moe, attn_head_dim=16, qk_norm=True, qkv_bias=True,
                               document_separator_id=SEP).validate(),
        # DeepSeek's multi-head latent attention (model/mla.py) with a query latent and YaRN.
        "mla": MixtralConfig(**{**SIZES, "num_kv_heads": 4}, moe=moe, attention="mla", q_lora_rank=12,
                             kv_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5,
                             rope_scaling="yarn", rope_factor=2.0, rope_original_max_seq_len=8,
                             yarn_mscale_all_dim=1.0, document_separator_id=SEP).validate(),
    }


def packed_window(cfg, rows=ROWS, seed: int = 0):
    """(B, S) token ids packing documents of the given lengths, each but a row's last ended by
    ``SEP``, with labels kept inside each document (-100 where the next token is another
    document's), and the documents as (row, start, length)."""
    gen = torch.Generator().manual_seed(seed)
    ids, docs = [], []
    for r, lengths in enumerate(rows):
        row, start = [], 0
        for i, n in enumerate(lengths):
            toks = torch.randint(0, cfg.vocab_size - 1, (n,), generator=gen)
            toks[toks >= SEP] += 1                                      # no separator inside
            if i < len(lengths) - 1:
                toks[-1] = SEP
            row.append(toks)
            docs.append((r, start, n))
            start += n
        ids.append(torch.cat(row))
    ids = torch.stack(ids)
    labels = torch.full_like(ids, -100)
    for r, s, n in docs:
        labels[r, s:s + n - 1] = ids[r, s + 1:s + n]
    return ids, labels, docs


def alone(model, ids, labels, doc):
    """The model's output on one document alone (a (1, n) batch)."""
    r, s, n = doc
    return model(ids[r:r + 1, s:s + n], labels[r:r + 1, s:s + n])


def test_document_ids_and_positions_written_out():
    #            tokens:  5  3  7  8  3  3  9  1      (3 ends a document; the next starts after it)
    ids = torch.tensor([[5, 3, 7, 8, 3, 3, 9, 1],
                        [3, 3, 3, 4, 4, 4, 4, 4]])
    assert dm.document_ids(ids, 3).tolist() == [[0, 0, 1, 1, 1, 2, 3, 3],
                                                [0, 1, 2, 3, 3, 3, 3, 3]]
    assert dm.document_positions(dm.document_ids(ids, 3)).tolist() == [[0, 1, 0, 1, 2, 0, 0, 1],
                                                                       [0, 0, 0, 0, 1, 2, 3, 4]]
    assert dm.document_ids(ids, 3).dtype == torch.int32
    # Query t sees key s: s <= t, same document. Row 0 of the ids above, first 5 tokens:
    mask = dm.attention_mask(dm.document_ids(ids[:1, :5], 3), "sdpa")
    assert mask.shape == (1, 1, 5, 5) and mask.int()[0, 0].tolist() == [[1, 0, 0, 0, 0],
                                                                       [1, 1, 0, 0, 0],
                                                                       [0, 0, 1, 0, 0],
                                                                       [0, 0, 1, 1, 0],
                                                                       [0, 0, 1, 1, 1]]
    with pytest.raises(ValueError, match="attention kernel 'varlen' must be one of sdpa, flex"):
        dm.attention_mask(dm.document_ids(ids, 3), "varlen")


def _check_packed_equals_alone(cfg, policy="none"):
    model = Transformer(cfg, init_seed=7)
    model.set_activation_checkpointing(policy)
    ids, labels, docs = packed_window(cfg)
    targets = (labels != -100).sum()
    out = model(ids, labels)
    (out.ce_sum / targets).backward()          # O(1) loss: mean over the window's targets
    packed = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    for doc in docs:
        one = alone(model, ids, labels, doc)
        r, s, n = doc
        torch.testing.assert_close(out.logits[r, s:s + n], one.logits[0].detach(), **TOL,
                                   msg=f"{doc} logits")
        (one.ce_sum / targets).backward()      # gradients add up over the documents
    for name, p in model.named_parameters():
        torch.testing.assert_close(packed[name], p.grad, **TOL, msg=f"grad {name}")
    return out


@pytest.mark.parametrize("name", list(configs()))
def test_a_documents_logits_and_gradients_in_a_window_equal_it_alone(name):
    out = _check_packed_equals_alone(configs()[name])
    # Not vacuous: without masking the same window's later documents see the earlier ones.
    cfg = dataclasses.replace(configs()[name], document_separator_id=None)
    ids, labels, docs = packed_window(cfg)
    model = Transformer(cfg, init_seed=7)
    r, s, n = docs[1]
    gap = (model(ids).logits[r, s:s + n] - out.logits[r, s:s + n]).abs().max().item()
    assert gap > 1e-2, gap


@pytest.mark.parametrize("policy", ["full", "attention"])
def test_masking_under_activation_checkpointing(policy):
    _check_packed_equals_alone(configs()["mixtral"], policy)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@torch.no_grad()
def test_flex_kernel_matches_the_sdpa_mask(monkeypatch):
    """The kernel CUDA runs (``flex_attention`` with a ``BlockMask``), here eager on the CPU,
    forward only (torch has no flex backward on the CPU; on a GPU see the ``-m gpu`` test
    below): the window's logits equal SDPA's with the bool mask, and each document's alone."""
    cfg = configs()["qwen3"]
    model = Transformer(cfg, init_seed=7)
    ids, labels, docs = packed_window(cfg)
    sdpa = model(ids).logits
    monkeypatch.setattr(dm, "default_kernel", lambda device: "flex")
    seen, real = [], dm.attend
    monkeypatch.setattr("model.block.attend",
                        lambda q, k, v, mask, *a: seen.append(type(mask).__name__) or real(q, k, v, mask, *a))
    flex = model(ids).logits
    assert seen == ["BlockMask"] * cfg.num_layers
    torch.testing.assert_close(flex, sdpa, **TOL)
    for doc in docs:
        r, s, n = doc
        torch.testing.assert_close(flex[r, s:s + n], alone(model, ids, labels, doc).logits[0],
                                   **TOL, msg=str(doc))


def test_masking_off_is_the_causal_path(monkeypatch):
    """Without a separator, attention is SDPA's ``is_causal`` with no mask and RoPE the (S, hd)
    tables of positions 0..S-1: the code every run used before masking existed (checked bitwise
    against it when masking was added). With masking on and no separator in the window, the
    positions are the same (RoPE tables bitwise) and the logits equal to 1e-5; with
    separators, each document's tables restart at position 0."""
    calls = []
    sdpa = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append((kwargs.get("is_causal"), kwargs.get("attn_mask")))
        return sdpa(*args, **kwargs)
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    on = configs()["dense"]
    off = dataclasses.replace(on, document_separator_id=None)
    ids = torch.randint(4, 64, (2, 32), generator=torch.Generator().manual_seed(1))    # no SEP
    ref = Transformer(off, init_seed=7)(ids).logits
    assert calls == [(True, None)] * off.num_layers
    calls.clear()
    got = Transformer(on, init_seed=7)(ids).logits
    assert [c[0] for c in calls] == [None] * on.num_layers and calls[0][1].shape == (2, 1, 32, 32)
    torch.testing.assert_close(got, ref, **TOL)
    rotary = Transformer(off).rotary
    plain = rotary(32, ids.device, torch.float32)
    per_doc = rotary(32, ids.device, torch.float32, dm.document_positions(dm.document_ids(ids, SEP)))
    for a, b in zip(plain, per_doc):
        assert a.shape == (32, 8) and b.shape == (2, 1, 32, 8)         # head width 32 / 4
        assert torch.equal(b, a.expand_as(b))
    # In a packed window each document's tables are those of positions 0.. (bitwise).
    ids, _, docs = packed_window(on)
    cos, sin = rotary(32, ids.device, torch.float32, dm.document_positions(dm.document_ids(ids, SEP)))
    for r, s, n in docs:
        assert torch.equal(cos[r, 0, s:s + n], plain[0][:n]) and torch.equal(sin[r, 0, s:s + n], plain[1][:n])


@pytest.mark.parametrize("value, message", [
    (-1, r"model\.document_separator_id \(-1\) must be an integer >= 0 or null"),
    (True, r"model\.document_separator_id \(True\) must be an integer"),
    (64, r"model\.document_separator_id \(64\) is not a token id of model\.vocab_size \(64\)"),
])
def test_separator_must_be_a_token_id(value, message):
    with pytest.raises(ValueError, match=message):
        DenseConfig(**SIZES, document_separator_id=value).validate()


def test_config_field_round_trips_and_hf_interop_exports_the_default(tmp_path):
    from interop import hf
    cfg = configs()["mixtral"]
    assert config_from_dict(cfg.to_dict()) == cfg
    legacy = {k: v for k, v in cfg.to_dict().items() if k != "document_separator_id"}
    assert config_from_dict(legacy).document_separator_id is None     # files written before it
    # HF models do not pack: the export leaves the field out, the import gives the default.
    back = hf.from_hf_config(hf.to_hf_config(cfg))
    assert back.document_separator_id is None
    assert back == dataclasses.replace(cfg, document_separator_id=None)
    model = Transformer(cfg, init_seed=1)
    hf.save_init_dir(tmp_path, cfg, model.state_dict())
    assert hf.load_init_dir(tmp_path)[0] == cfg


def test_recipe_key_turns_masking_on_with_the_tokenizers_eos():
    from model.parallel.groups import ParallelGroups
    from training.config.recipe import load_recipe
    from training.engine.build import build_model
    small = ["model.hidden_size=32", "model.num_layers=1", "model.ffn_hidden_size=32",
             "model.max_seq_len=32", "data.seq_len=32"]
    off = load_recipe("recipes/tiny_dense.yaml", small)
    assert off.data.document_masking is False
    assert build_model(off, None, ParallelGroups(), eos_token_id=0).cfg.document_separator_id is None
    on = load_recipe("recipes/tiny_dense.yaml", small + ["data.document_masking=true"])
    model = build_model(on, None, ParallelGroups(), eos_token_id=5)
    assert model.cfg.document_separator_id == 5
    assert on.model.document_separator_id is None                  # the recipe is unchanged
    with pytest.raises(ValueError, match="data.document_masking is true but build_model got no eos"):
        build_model(on, None, ParallelGroups())
    with pytest.raises(ValueError, match=r"data\.document_masking"):
        load_recipe("recipes/tiny_dense.yaml", small + ["data.document_masking=3"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_flex_on_the_gpu_keeps_documents_apart():
    """On CUDA the default kernel is compiled ``flex_attention``; fp32 (no TF32: torch's default
    for matmuls), the same 1e-5 as on the CPU."""
    torch.manual_seed(0)
    cfg = configs()["mixtral"]
    model = Transformer(cfg, init_seed=7).cuda()
    ids, labels, docs = packed_window(cfg)
    ids, labels = ids.cuda(), labels.cuda()
    assert dm.default_kernel(ids.device) == "flex"
    out = model(ids, labels)
    for doc in docs:
        r, s, n = doc
        torch.testing.assert_close(out.logits[r, s:s + n], alone(model, ids, labels, doc).logits[0],
                                   **TOL, msg=str(doc))
