"""Context-parallel attention (``model/parallel/context.py``) against one process's attention.

Spawned on 4 gloo ranks once: CP4 over all of them and CP2 over the groups {0, 2} and {1, 3}
(not neighbours, so that a cp rank mistaken for a global rank shows). For each exchange (a2a,
allgather, p2p), dense heads and GQA (kv heads a multiple of cp, fewer than cp, neither), plain
causal and document-masked, with SDPA's and a given scale: each rank's output and the gradients
of its q, k and v shards equal the load-balanced split of the single-process causal attention's
(``F.scaled_dot_product_attention`` on the whole window) and of its gradients.

Tolerance: fp32, relative 1e-5 (absolute 1e-6 on values of order 1). Every exchange computes the
same sums of the same products: a2a runs the single-process SDPA call on whole rows of fewer
heads (its kv gradients summed over repeated heads and ranks in another order); allgather runs
SDPA over a key prefix, the masked keys' exact zeros left out; p2p sums each row's softmax in cp
blocks merged by their log-sum-exp, and its gradients add the ranks' parts in another order.
Only the order of fp32 additions differs; measured at most 9e-8 (a2a), 3.7e-7 (allgather) and
4.4e-7 (p2p) relative to the largest entry.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from model import document_mask as dm
from model.parallel import context as cpx
from training.run.spawn import run_ranks

TOL = dict(rtol=1e-5, atol=1e-6)
B, S, HD = 2, 32, 8
# (query heads, kv heads): dense; GQA with kv heads a multiple of cp (CP2); fewer than cp (CP4:
# repeated for a2a); MQA; 3 kv heads, neither divisor nor multiple of cp (repeated to lcm).
HEADS = [(4, 4), (8, 2), (4, 1), (12, 3)]
# Document lengths of each row: boundaries inside and across the 2cp chunks of 4 tokens (CP4)
# and 8 (CP2), and a one-token document.
DOCS = ([5, 9, 1, 13, 4], [8, 3, 21])


def _doc_ids() -> torch.Tensor:
    return torch.stack([torch.repeat_interleave(torch.arange(len(r), dtype=torch.int32), torch.tensor(r))
                        for r in DOCS])                                     # (B, S)


def _inputs(nh: int, nkv: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, n, S, HD, generator=g) for n in (nh, nkv, nkv))
    w = torch.randn(B, nh, S, HD, generator=g)                              # loss weights
    return q, k, v, w


def _reference(q, k, v, w, scale, doc_ids):
    """One process: output and gradients of sum(w * attention) on the whole window."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    gqa = k.shape[1] != q.shape[1]
    if doc_ids is None:
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=dm.attention_mask(doc_ids, "sdpa"),
                                           scale=scale, enable_gqa=gqa)
    return (y.detach(), *torch.autograd.grad((w * y).sum(), (q, k, v)))


def _check_cp(group, cp: int, r: int, worst: dict) -> None:
    """Every exchange, head layout and mask on one cp group; ``worst``: the largest relative
    error seen, per exchange."""
    doc_ids = _doc_ids()
    split = lambda t: cpx.split_for_cp(t, cp, r, 2)                            # noqa: E731
    for seed, (nh, nkv) in enumerate(HEADS):
        q, k, v, w = _inputs(nh, nkv, seed)
        for docs, scale in ((None, None), (doc_ids, 0.3)):
            ref = _reference(q, k, v, w, scale, docs)
            for comm in cpx.CP_COMMS:
                mask = None if docs is None else cpx.cp_document_mask(docs, cp, r, comm, "sdpa")
                ql, kl, vl = (split(t).requires_grad_() for t in (q, k, v))
                y = cpx.context_attention(ql, kl, vl, group, comm, scale, mask)
                grads = torch.autograd.grad((split(w) * y).sum(), (ql, kl, vl))
                what = f"cp{cp} rank {r} {comm} heads {nh}/{nkv} docs {docs is not None}"
                for name, got, want in zip("y q k v".split(), (y.detach(), *grads), ref):
                    torch.testing.assert_close(got, split(want), **TOL, msg=f"{what}: {name}")
                    err = ((got - split(want)).abs().max() / split(want).abs().max()).item()
                    worst[comm] = max(worst.get(comm, 0.0), err)

    # The Ulysses pair alone: head group r of the window in natural order; back again; the
    # gradient is the reverse exchange.
    x = torch.randn(B, 8, S, HD, generator=torch.Generator().manual_seed(9))
    gout = torch.randn(B, 8, S, HD, generator=torch.Generator().manual_seed(10))
    h = 8 // cp
    xl = split(x).requires_grad_()
    heads = cpx.seq_to_heads(xl, group)
    assert torch.equal(heads, x[:, r * h:(r + 1) * h])
    assert torch.equal(cpx.heads_to_seq(heads, group), split(x))
    heads.backward(gout[:, r * h:(r + 1) * h])
    assert torch.equal(xl.grad, split(gout))
    assert torch.equal(cpx.gather_from_cp(split(x), group, dim=2), x)

    # One-line errors: cp must divide the query heads for a2a; S must split into 2cp chunks.
    nh = cp + cp // 2                                                       # 3 at CP2, 6 at CP4
    with pytest.raises(ValueError, match=rf"parallel.context_parallel_size \({cp}\) must divide "
                                         rf"model.num_heads per tp rank \({nh}\)") as e:
        cpx.ulysses_attention(torch.zeros(1, nh, 4, HD), *(torch.zeros(1, 1, 4, HD) for _ in range(2)), group)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="divisible by 2 x cp"):
        cpx.allgather_kv_attention(*(torch.zeros(1, 2, 3, HD) for _ in range(3)), group)


def _ranks(rank: int, world: int, out) -> None:
    # One thread per rank: 4 ranks share the cores, and OpenMP's spinning threads, two per rank
    # here (torch was imported before the helper set OMP_NUM_THREADS), made it 20x slower.
    torch.set_num_threads(1)
    worst: dict = {}
    _check_cp(dist.group.WORLD, 4, rank, worst)
    pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])]               # every rank makes both
    _check_cp(pairs[rank % 2], 2, rank // 2, worst)
    if rank == 0:
        out.put(worst)


def test_context_parallel_equals_one_process_cp2_and_cp4():
    import torch.multiprocessing as mp
    out = mp.get_context("spawn").SimpleQueue()
    run_ranks(_ranks, 4, out, timeout=120)
    worst = out.get()
    print("largest relative error per exchange:", worst)
    assert set(worst) == set(cpx.CP_COMMS)


# ------------------------------------------------------------------------------------------
# One process: the split, the positions, the masks, the errors.

def test_split_positions_and_inverse():
    t = torch.arange(16).view(1, 16)
    assert cpx.lb_chunks(2) == [0, 3, 1, 2]
    assert cpx.split_for_cp(t, 2, 0).tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]]
    assert cpx.split_for_cp(t, 2, 1).tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]
    assert cpx.split_for_cp(t, 4, 1).tolist() == [[2, 3, 12, 13]]
    assert cpx.split_for_cp(t, 1, 0) is t
    for cp in (1, 2, 4, 8):
        shards = [cpx.split_for_cp(t, cp, r) for r in range(cp)]
        for r in range(cp):
            assert torch.equal(cpx.positions_for_cp(16, cp, r), shards[r][0])
        assert torch.equal(cpx.from_cp_order(torch.cat(shards, 1), cp), t)
    x = torch.randn(2, 3, 16, 4)                                            # any dim
    shards = [cpx.split_for_cp(x, 4, r, 2) for r in range(4)]
    assert torch.equal(cpx.from_cp_order(torch.cat(shards, 2), 4, 2), x)
    # Balanced: every rank's causal work (keys its queries see) is the same.
    work = [int((cpx.positions_for_cp(16, 4, r) + 1).sum()) for r in range(4)]
    assert len(set(work)) == 1, work
    # Document positions restart per document, split like the tokens.
    doc = _doc_ids()
    assert torch.equal(cpx.cp_document_positions(doc, 4, 3),
                       cpx.split_for_cp(dm.document_positions(doc), 4, 3, 1))
    # Rank 0 of CP4 holds window positions 0-3 and 28-31: row 0's last document starts at 28,
    # row 1's at 11.
    assert cpx.cp_document_positions(doc, 4, 0).tolist() == [[0, 1, 2, 3, 0, 1, 2, 3],
                                                             [0, 1, 2, 3, 17, 18, 19, 20]]


def test_bad_inputs_raise_one_line_errors():
    with pytest.raises(ValueError, match=r"parallel.context_parallel_size \(4\) needs the sequence "
                                         r"length \(12\) divisible by 2 x cp = 8") as e:
        cpx.split_for_cp(torch.zeros(1, 12), 4, 0)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="parallel.context_parallel_size"):
        cpx.positions_for_cp(16, 2, 2)
    with pytest.raises(ValueError, match="parallel.context_parallel_size"):
        cpx.split_for_cp(torch.zeros(1, 16), 0, 0)
    with pytest.raises(ValueError, match=r"parallel.cp_comm \('ring'\) must be one of a2a, allgather, p2p"):
        cpx.context_attention(*(torch.zeros(1, 2, 4, HD) for _ in range(3)), None, "ring")
    with pytest.raises(ValueError, match="parallel.cp_comm"):
        cpx.cp_document_mask(_doc_ids(), 2, 0, "ring")
    with pytest.raises(ValueError, match="attention kernel 'varlen' must be one of sdpa, flex"):
        cpx.cp_document_mask(_doc_ids(), 2, 0, "allgather", "varlen")


def test_one_rank_is_plain_attention():
    """``group=None``: no exchange, the single-process call (and mask) for every cp_comm."""
    q, k, v, _ = _inputs(4, 2, 0)
    doc = _doc_ids()
    for comm in cpx.CP_COMMS:
        for docs in (None, doc):
            mask = None if docs is None else cpx.cp_document_mask(docs, 1, 0, comm, "sdpa")
            got = cpx.context_attention(q, k, v, None, comm, None, mask)
            want = _reference(q, k, v, torch.zeros(B, 4, S, HD), None, docs)[0]
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert cpx.seq_to_heads(q, None) is q and cpx.heads_to_seq(q, None) is q


@pytest.mark.parametrize("kernel", ["sdpa", "flex"])
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@torch.no_grad()
def test_allgather_prefix_masks_are_rows_of_the_window_mask(kernel):
    """Each chunk's mask is its rows of the single-process mask over the key prefix; flex (here
    eager on the CPU, forward only) attends as the bool mask does."""
    doc = _doc_ids()
    full = dm.attention_mask(doc, "sdpa")                                   # (B, 1, S, S)
    q, k, v, _ = _inputs(4, 2, 1)
    cp, c = 4, S // 8
    for r in range(cp):
        masks = cpx.cp_document_mask(doc, cp, r, "allgather", kernel)
        for start, m in zip((r * c, (2 * cp - 1 - r) * c), masks):
            end = start + c
            if kernel == "sdpa":
                assert torch.equal(m, full[:, :, start:end, :end])
                assert not full[:, :, start:end, end:].any()                # nothing after the prefix
            qi, ki, vi = q[:, :, start:end], k[:, :, :end], v[:, :, :end]
            got = dm.attend(qi, ki, vi, m, None, True)
            want = dm.attend(qi, ki, vi, full[:, :, start:end, :end], None, True)
            torch.testing.assert_close(got, want, **TOL)
