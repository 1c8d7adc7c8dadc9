"""Collectives of one forward+backward against the analytic minimum (``benchmarks/systems/comm_volume.py``).

One 2-rank spawn (about 10 s) counts TP2 dense (kv heads >= tp), TP2 Mixtral with sequence
parallelism, EP2 Mixtral (dropless, top-2) and TP2 and TP2 + SP Mixtral with multi-head latent
attention (with and without q_lora_rank) at block and model scope; every test reads its rows. Counts are per rank; all-reduce elements are
the reduced tensor, all-to-all elements are summed over the ranks. The cost model's volumes
(``planning.cost_model.tp_volumes`` and ``ep_volumes``, for the same sizes) equal these counts
exactly.
"""

from collections import defaultdict

import pytest

from benchmarks.systems import comm_volume as cv
from planning import cost_model as cm

SIZES = cv.Sizes(batch=2, seq=8, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=64, experts=4,
                 top_k=2, layers=2, q_lora_rank=12, kv_lora_rank=10, qk_nope_head_dim=6,
                 qk_rope_head_dim=4, v_head_dim=5)     # the MLA layouts' widths (kv heads = heads)
BSH = SIZES.batch * SIZES.seq * SIZES.hidden          # b*s*h at TP (every rank has all tokens)
MLA_LAYOUTS = ("tp2/mla", "tp2/mla-noqlora", "tp2-sp/mla", "tp2-sp/mla-noqlora")


@pytest.fixture(scope="module")
def rows():
    return cv.analyse(cv.run(SIZES, ("tp2/dense", "tp2-sp/mixtral", "ep2/mixtral") + MLA_LAYOUTS))


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
    # MLA (planning/cost_comm._mla_attention), per block: the latents, w wide, in one collective,
    # o_proj out as GQA's; without q_lora_rank q_proj's hidden-state entry too; the MoE as Mixtral's
    ("tp2/mla", "mla", False, "block", {
        ("all_reduce", "forward"): 2 * TH,
        ("all_reduce", "backward"): T * (SIZES.q_lora_rank + SIZES.kv_lora_rank + SIZES.qk_rope_head_dim)
        + TH + T * K}),
    ("tp2-sp/mla-noqlora", "mla-noqlora", True, "block", {
        ("reduce_scatter", "forward"): 2 * TH,
        ("all_gather", "forward"): T * (SIZES.kv_lora_rank + SIZES.qk_rope_head_dim) / 2 + 2 * TH / 2,
        ("reduce_scatter", "backward"): T * (SIZES.kv_lora_rank + SIZES.qk_rope_head_dim) + 2 * TH,
        ("all_gather", "backward"): 3 * TH / 2, ("all_reduce", "backward"): T * K}),
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


# MLA (model/mla.py): the latents [c_q, c_kv, k_rot] enter the tp region together, w wide
R_Q, R_KV, D_ROPE = SIZES.q_lora_rank, SIZES.kv_lora_rank, SIZES.qk_rope_head_dim
LATENT = "attention latents in (TP, MLA)"
HIDDEN = "attention in/out (TP)"


@pytest.mark.parametrize("layout", MLA_LAYOUTS)
def test_mla_block_moves_its_latents_in_one_collective(rows, layout):
    """MLA, per block (T = b·s = 16 tokens on every tp rank, h = 32, tp = 2): the latents, w =
    q_lora_rank + kv_lora_rank + qk_rope_head_dim = 12 + 10 + 4 = 26 wide (14 without
    q_lora_rank), enter the tp region in one collective; the hidden state enters only q_proj:

    * TP2: forward all-reduce T h (o_proj); backward all-reduce T w (the latents' gradient);
      without q_lora_rank also all-reduce T h backward (q_proj's input gradient).
    * TP2 + SP: forward all-gather T w/tp (the latents' shards) + reduce-scatter T h (o_proj);
      backward reduce-scatter T w + all-gather T h/tp (o_proj's output gradient); without
      q_lora_rank also all-gather T h/tp forward into q_proj, and backward its reduce-scatter of
      T h and a re-gather of T h/tp (it stores only the shard), as GQA's q/k/v.

    The FFN is Mixtral's, row for row; ``comm_volume.attention_volumes`` (its DeepSeek-V3 table)
    gives the same counts."""
    sp, q_lora = "-sp/" in layout, not layout.endswith("noqlora")
    w, tp = (R_Q if q_lora else 0) + R_KV + D_ROPE, 2
    if sp:
        want = {(LATENT, "all_gather_into_tensor", "forward"): (1, T * w // tp),
                (LATENT, "reduce_scatter_tensor", "backward"): (1, T * w),
                (HIDDEN, "reduce_scatter_tensor", "forward"): (1, TH),
                (HIDDEN, "all_gather_into_tensor", "backward"): (1, TH // tp)}
        if not q_lora:
            want.update({(HIDDEN, "all_gather_into_tensor", "forward"): (1, TH // tp),
                         (HIDDEN, "reduce_scatter_tensor", "backward"): (1, TH),
                         (HIDDEN, "all_gather_into_tensor", "backward"): (2, 2 * TH // tp)})
    else:
        want = {(LATENT, "all_reduce", "backward"): (1, T * w),
                (HIDDEN, "all_reduce", "forward"): (1, TH)}
        if not q_lora:
            want[(HIDDEN, "all_reduce", "backward")] = (1, TH)
    block = _rows(rows, layout, "block")
    got = {(r.traffic, r.op, r.phase): (r.count, r.elements) for r in block
           if r.traffic.startswith("attention")}
    assert got == want
    assert all(r.ok and r.elements == r.minimum for r in block if r.per_token), block
    volumes = defaultdict(int)
    for (_, op, phase), (_, n) in got.items():
        volumes[(op, phase)] += n
    assert cv.attention_volumes(H, w, q_lora, tp, T, sp) == dict(volumes)
    ffn = [r for r in block if r.per_token and not r.traffic.startswith("attention")]
    if sp:
        mixtral = [r for r in _rows(rows, "tp2-sp/mixtral", "block") if r.per_token
                   and not r.traffic.startswith("attention")]
        assert [(r.traffic, r.op, r.phase, r.count, r.elements) for r in ffn] == \
            [(r.traffic, r.op, r.phase, r.count, r.elements) for r in mixtral]
    else:
        assert {(r.traffic, r.op, r.phase, r.count, r.elements) for r in ffn} == {
            ("FFN in/out (TP)", "all_reduce", "forward", 1, TH),
            ("FFN in/out (TP)", "all_reduce", "backward", 1, TH),
            ("routing-weight grad (TP)", "all_reduce", "backward", 1, T * K)}
    n = SIZES.layers       # model scope: once per layer
    latent = {(r.op, r.count, r.elements) for r in _rows(rows, layout, "model") if r.traffic == LATENT}
    assert latent == ({("all_gather_into_tensor", n, n * T * w // tp),
                       ("reduce_scatter_tensor", n, n * T * w)} if sp
                      else {("all_reduce", n, n * T * w)})


@pytest.mark.parametrize("layout", MLA_LAYOUTS)
def test_mla_down_projection_grads_are_summed_over_tp_only_under_sp(rows, layout):
    """Under SP each tp rank runs q_a_proj, kv_a_proj_with_mqa and the latent norms on its own
    tokens: one all-reduce per parameter over tp, per block 2 h (the block's norms) + h w +
    q_lora_rank + kv_lora_rank elements (w as above); without SP the latents' gradient
    all-reduce already made them whole, and nothing is summed."""
    q_lora = not layout.endswith("noqlora")
    r_q = R_Q if q_lora else 0
    sync = [r for r in _rows(rows, layout, "block") if r.traffic.startswith("replicated")]
    if "-sp/" not in layout:
        assert sync == []
        return
    names = ["input_layernorm", "post_attention_layernorm", "self_attn.kv_a_layernorm",
             "self_attn.kv_a_proj_with_mqa"] + (["self_attn.q_a_layernorm", "self_attn.q_a_proj"]
                                                 if q_lora else [])
    (r,) = sync
    assert r.where == ", ".join(sorted(f"{n}.weight" for n in names))
    assert (r.count, r.elements) == (len(names), 2 * H + H * (r_q + R_KV + D_ROPE) + r_q + R_KV)
    assert r.elements == r.minimum and not r.note, r


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
                                                   for layout in ("ep2/mixtral", "tp2-sp/mixtral",
                                                                  "tp2-sp/mla", "tp2-sp/mla-noqlora")}
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
