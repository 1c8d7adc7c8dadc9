"""Collectives of one forward+backward against the analytic minimum (``benchmarks/comm_volume.py``).

One 2-rank spawn (about 10 s) counts TP2 dense (kv heads >= tp), TP2 Mixtral with sequence
parallelism and EP2 Mixtral (dropless, top-2) at block and model scope; every test reads its rows. Counts are per rank; all-reduce elements are
the reduced tensor, all-to-all elements are summed over the ranks. The cost model's volumes
(``planning.cost_model.tp_volumes`` and ``ep_volumes``, for the same sizes) equal these counts
exactly.
"""

from collections import defaultdict

import pytest

from benchmarks import comm_volume as cv
from planning import cost_model as cm

SIZES = cv.Sizes(batch=2, seq=8, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=64, experts=4,
                 top_k=2, layers=2)
BSH = SIZES.batch * SIZES.seq * SIZES.hidden          # b*s*h at TP (every rank has all tokens)


@pytest.fixture(scope="module")
def rows():
    return cv.analyse(cv.run(SIZES, ("tp2/dense", "tp2-sp/mixtral", "ep2/mixtral")))


def _rows(rows, layout, scope, phase=None):
    return [r for r in rows if r.layout == layout and r.scope == scope
            and (phase is None or r.phase == phase)]


def test_tp_block_forward_is_two_all_reduces_of_bsh(rows):
    got = {(r.traffic, r.op, r.count, r.elements) for r in _rows(rows, "tp2/dense", "block", "forward")}
    assert got == {("attention in/out (TP)", "all_reduce", 1, BSH),     # after o_proj
                   ("FFN in/out (TP)", "all_reduce", 1, BSH)}           # after down_proj


def test_tp_block_backward_is_two_all_reduces_of_bsh(rows):
    got = {(r.traffic, r.op, r.count, r.elements) for r in _rows(rows, "tp2/dense", "block", "backward")}
    assert got == {("attention in/out (TP)", "all_reduce", 1, BSH),     # into q/k/v
                   ("FFN in/out (TP)", "all_reduce", 1, BSH)}           # into gate/up


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_sequence_parallel_block_replaces_each_all_reduce_by_reduce_scatter_plus_all_gather(rows, phase):
    # Same places as TP's all-reduces; a ring all-reduce is exactly these two collectives, so
    # the traffic is unchanged while activations between the regions are split by tp. Backward
    # gathers q/k/v's input once more (stored as a shard, Megatron); the MoE layer stores none.
    got = {(r.traffic, r.op, r.count, r.elements)
           for r in _rows(rows, "tp2-sp/mixtral", "block", phase) if r.per_token}
    # The flat-tensor collectives: one call each, no per-rank list of temporaries.
    want = {(t, op, 1, n) for t in ("attention in/out (TP)", "FFN in/out (TP)")
            for op, n in (("all_gather_into_tensor", BSH // 2), ("reduce_scatter_tensor", BSH))}
    if phase == "backward":     # the router's combine weights multiply partial expert outputs
        want.add(("routing-weight grad (TP)", "all_reduce", 1, SIZES.batch * SIZES.seq * SIZES.top_k))
        want.remove(("attention in/out (TP)", "all_gather_into_tensor", 1, BSH // 2))
        want.add(("attention in/out (TP)", "all_gather_into_tensor", 2, BSH))
    assert got == want
    norms = [r for r in _rows(rows, "tp2-sp/mixtral", "block", phase) if not r.per_token]
    assert [(r.count, r.where) for r in norms] == ([(2, "input_layernorm.weight, post_attention_"
                                                    "layernorm.weight")] if phase == "backward" else [])


def test_tp_model_adds_only_the_vocab_parallel_embedding_and_cross_entropy(rows):
    extra = {(r.traffic, r.phase, r.count, r.elements) for r in _rows(rows, "tp2/dense", "model")
             if not r.traffic.startswith(("attention", "FFN"))}
    assert extra == {("embedding / output head (vocab-parallel)", "forward", 1, BSH),
                     ("embedding / output head (vocab-parallel)", "backward", 1, BSH),
                     ("cross-entropy statistics (vocab-parallel)", "forward", 2,
                      3 * SIZES.batch * SIZES.seq)}


def _cost_model(family: str, scope: str, **degrees) -> tuple:
    """The counted run's sizes as the cost model's Shape and Layout: 2 ranks, one micro-batch of
    SIZES.batch x SIZES.seq; comm_volume's ep ranks split it, as this trainer's do."""
    cfg = cv._config(family, SIZES, None, 1 if scope == "block" else SIZES.layers)
    shape = cm.Shape.from_config(cfg)
    layout = cm.Layout(world=2, global_batch=SIZES.batch, seq_len=SIZES.seq, micro_batch=SIZES.batch,
                       ep_splits_batch=True, **degrees)
    layout.check(shape)
    return shape, layout


# comm_volume's collective names -> the cost model's
COST_OPS = {"all_reduce": "all_reduce", "reduce_scatter_tensor": "reduce_scatter",
            "all_gather_into_tensor": "all_gather"}
T, H, K = SIZES.batch * SIZES.seq, SIZES.hidden, SIZES.top_k     # TP: every rank all T tokens
TH = T * H


@pytest.mark.parametrize("layout,family,sp,scope,want", [
    # per layer 2 all-reduces of T h each way; model: + the embedding's forward all-reduce, the
    # head's backward one and the cross-entropy's 3 T statistics
    ("tp2/dense", "dense", False, "block", {("all_reduce", "forward"): 2 * TH,
                                            ("all_reduce", "backward"): 2 * TH}),
    ("tp2/dense", "dense", False, "model", {("all_reduce", "forward"): 2 * 2 * TH + TH + 3 * T,
                                            ("all_reduce", "backward"): 2 * 2 * TH + TH}),
    # SP, per layer: attention and MoE each a reduce-scatter of T h and a gather of the T h / 2
    # shard each way, backward gathering q/k/v's input once more; the routing weights' T k
    # gradient all-reduced. Model: the embedding reduce-scatters T h forward and gathers its
    # grad's shard; the head gathers its input forward and backward and reduce-scatters the grad
    ("tp2-sp/mixtral", "mixtral", True, "block", {
        ("reduce_scatter", "forward"): 2 * TH, ("all_gather", "forward"): 2 * TH / 2,
        ("reduce_scatter", "backward"): 2 * TH, ("all_gather", "backward"): 3 * TH / 2,
        ("all_reduce", "backward"): T * K}),
    ("tp2-sp/mixtral", "mixtral", True, "model", {
        ("reduce_scatter", "forward"): 2 * 2 * TH + TH, ("all_gather", "forward"): (2 * 2 + 1) * TH / 2,
        ("reduce_scatter", "backward"): 2 * 2 * TH + TH, ("all_gather", "backward"): (2 * 3 + 2) * TH / 2,
        ("all_reduce", "forward"): 3 * T, ("all_reduce", "backward"): 2 * T * K}),
])
def test_cost_model_tp_volumes_equal_the_counted_elements(rows, layout, family, sp, scope, want):
    counted = defaultdict(int)
    for r in _rows(rows, layout, scope):
        if r.per_token:      # the replicated norms' grads are per parameter, outside tp_volumes
            counted[(COST_OPS[r.op], r.phase)] += r.elements
    shape, lay = _cost_model(family, scope, tp=2, sp=sp)
    model = scope == "model"
    assert dict(counted) == want
    assert cm.tp_volumes(shape, lay, range(shape.layers), head=model, embedding=model) == want
    if model:       # the first stage holds the embedding by default
        assert cm.tp_volumes(shape, lay, range(shape.layers), head=True) == want


def _counted_exchange(rows, layout: str, scope: str) -> dict:
    """{(dispatch|combine, phase): elements summed over the ranks} of the expert exchange."""
    return {(r.traffic.split()[1], r.phase): r.elements for r in _rows(rows, layout, scope)
            if r.traffic.startswith(("MoE dispatch", "MoE combine"))}


def test_cost_model_ep_volumes_times_ranks_equal_the_counted_exchange(rows):
    # Balanced, each of the 2 ep ranks sends k T h = 2 x 8 x 32 per exchange and MoE layer (T = 8:
    # its half of the micro-batch). A rank's counted share depends on the routing (how many rows
    # its experts received); dropless, the sum over the ranks is exact: 2 x k T h.
    for scope, moe_layers in (("block", 1), ("model", SIZES.layers)):
        shape, lay = _cost_model("mixtral", scope, ep=2)
        per_rank = cm.ep_volumes(shape, lay, range(shape.layers))
        assert per_rank == {(label, phase): moe_layers * K * (T // 2) * H
                            for label in ("dispatch", "combine") for phase in ("forward", "backward")}
        assert {key: 2 * n for key, n in per_rank.items()} == _counted_exchange(rows, "ep2/mixtral", scope)


def test_ep_exchange_sends_exactly_the_routed_rows(rows):
    k, h, E, tokens = SIZES.top_k, SIZES.hidden, SIZES.experts, SIZES.batch * SIZES.seq
    for scope, moe_layers in (("block", 1), ("model", SIZES.layers)):
        exchange = [r for r in _rows(rows, "ep2/mixtral", scope) if r.traffic.startswith(
            ("MoE dispatch", "MoE combine"))]
        assert len(exchange) == 4, exchange         # dispatch, combine x forward, backward
        for r in exchange:
            # analyse() checked each rank's send against sum(routed_per_expert) * h of its
            # routing (r.ok); dropless top-k routes k*T rows in all, with no padding.
            assert r.ok, (scope, r.traffic, r.phase, r.note)
            assert r.count == moe_layers and r.op == "all_to_all_single"
            assert r.elements == r.minimum == moe_layers * k * tokens * h, (scope, r)
            assert r.off_rank == r.minimum_off and 0 < r.off_rank < r.elements, (scope, r)
        small = {(r.traffic, r.phase, r.count, r.elements) for r in _rows(rows, "ep2/mixtral", scope)
                 if r.traffic.startswith(("MoE count", "MoE routed"))}
        assert small == {("MoE count exchange", "forward", moe_layers, moe_layers * 2 * E),
                         ("MoE routed counts (load-balancing loss, all layers at once)", "forward",
                          1, moe_layers * E)}


def test_every_collective_is_explained_and_replicas_sync_once(rows):
    assert not [r for r in rows if r.traffic.startswith("unexplained")]
    assert all(r.ok for r in rows if r.layout.startswith("ep"))
    sync = [r for r in rows if r.traffic.startswith("replicated")]
    assert {(r.layout, r.scope) for r in sync} == {(layout, scope) for scope in ("block", "model")
                                                   for layout in ("ep2/mixtral", "tp2-sp/mixtral")}
    for r in sync:      # ep: every parameter outside the experts, its gradient summed once over
                        # ep; tp with sequence parallelism: every norm weight once over tp
        assert r.phase == "backward" and r.elements == r.minimum and not r.note, r
    assert not [r for r in rows if r.layout.startswith("tp") and r.traffic.startswith("MoE")]


def test_experts_checkpointing_does_not_repeat_the_expert_exchange():
    """``moe`` recomputes the whole MoE layer in backward, so its forward exchange runs again
    (6 k·T·h exchanges per layer instead of 4, the repeated ones counted as the ``recompute``
    phase, each equal to the forward's routed rows); ``experts`` recomputes only the expert FFNs
    between the exchanges and keeps 4. Every row stays at its minimum, so the documented
    ``comm_volume.py --activation-checkpointing`` commands exit 0."""
    k, h, tokens = SIZES.top_k, SIZES.hidden, SIZES.batch * SIZES.seq
    for policy, per_layer in (("moe", 6), ("experts", 4)):
        sizes = cv.Sizes(**{**SIZES.__dict__, "activation_checkpointing": policy})
        rows = cv.analyse(cv.run(sizes, ("ep2/mixtral",)))
        got = [r for r in rows if r.scope == "block" and r.traffic.startswith(("MoE dispatch", "MoE combine"))]
        assert sum(r.elements for r in got) == per_layer * k * tokens * h, (policy, got)
        phases = {"forward", "backward"} | ({"recompute"} if policy == "moe" else set())
        assert {r.phase for r in got} == phases, (policy, got)
        assert [r for r in rows if r.per_token and not r.ok] == [], policy
        # the cost model repeats the exchange for the same policies: its per-rank figure times
        # the 2 ranks equals the counted rows, recompute phase included
        shape, lay = _cost_model("mixtral", "block", ep=2, recompute=policy)
        assert {key: 2 * n for key, n in cm.ep_volumes(shape, lay, range(1)).items()} == \
            _counted_exchange(rows, "ep2/mixtral", "block"), policy


def test_tied_embedding_gradient_is_summed_over_ep_once():
    # The embedding and the tied head are one parameter: its gradient hook runs
    # once per backward, one all-reduce per replicated parameter (``analyse`` notes any
    # parameter summed more often).
    sizes = cv.Sizes(**{**SIZES.__dict__, "tie_embeddings": True})
    sync = [r for r in cv.analyse(cv.run(sizes, ("ep2/mixtral",)))
            if r.scope == "model" and r.traffic.startswith("replicated")]
    assert len(sync) == 1 and not sync[0].note and sync[0].elements == sync[0].minimum, sync
