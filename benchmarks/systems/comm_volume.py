"""Every collective of one forward+backward, counted and compared with the analytic minimum.

Hardware: any CPU; 2 gloo ranks on 127.0.0.1 (about 15 s on 2 cores with the defaults).
Launch:   python -m benchmarks.systems.comm_volume                                  # defaults below
          python -m benchmarks.systems.comm_volume --batch 8 --seq 64 --hidden 128 --json comm.json

Layouts: TP2 dense (kv heads >= tp), TP2 dense with 1 kv head (replicated over tp), TP2 Mixtral,
the TP2 dense and Mixtral again with sequence parallelism, and EP2 Mixtral (dropless, top-2),
also with the expert exchange in bf16 and in fp8 (``model.moe.dispatch_dtype``: the same elements,
fewer bytes; an fp8 row carries 4 more bytes, its scale); TP2 and TP2 + SP Mixtral with
multi-head latent attention (``model.attention: mla``), with and without ``q_lora_rank``;
scopes: one transformer block (input
requiring grad, as inside a model) and a whole ``--layers``-layer model with its loss. While a step runs, the
``torch.distributed`` collectives that ``model/parallel/`` calls are wrapped to record (op, phase,
elements, bytes), and the ``comm`` helpers are wrapped only to name the call site (module, and for
the expert exchange dispatch or combine); nothing else changes.

Analytic minima (b*s*h: the tokens one rank computes times the hidden size):

* TP (Megatron): per block one all-reduce of b*s*h forward after o_proj and one after the FFN's
  down projection, and one backward each for the gradients entering q/k/v and gate/up; at model
  scope also the vocab-parallel embedding (forward), the output head's input gradient (backward)
  and the cross-entropy statistics (max, then target logit + sum of exponentials: 3*b*s).
* TP with sequence parallelism (Megatron SP): each all-reduce becomes a reduce-scatter of the same
  b*s*h tensor plus an all-gather of this rank's b*s*h/tp shard (the flat-tensor
  ``reduce_scatter_tensor`` / ``all_gather_into_tensor``, no per-rank list), at the same places
  (a ring all-reduce *is* a reduce-scatter then an all-gather: the same bytes on the wire);
  backward gathers once more where column-parallel layers stored only their input's shard (q/k/v,
  gate/up, the output head; not the MoE layer, which stores no gathered input); the norms' weight
  gradients are summed over tp once per backward (per parameter, see below).
* MLA (``model/mla.py``): the latents [c_q, c_kv, k_rot], w = q_lora_rank (0 without it) +
  kv_lora_rank + qk_rope_head_dim wide, enter the tp region in one collective per block: the
  gradient's all-reduce of b*s*w backward (SP: an all-gather of the b*s*w/tp shard forward, a
  reduce-scatter of b*s*w backward; the gathered latents are stored, no re-gather). With
  q_lora_rank the hidden state does not enter the attention (only o_proj's exit remains, and
  under SP its gradient's all-gather); without it q_proj enters it as q/k/v do. Under SP the
  down-projections' weight gradients are summed over tp, as the norms'. After the table, the same
  formulas at DeepSeek-V3's and Moonlight's widths (``--mla-tp``, ``--mla-tokens``): MLA's
  attention traffic per block against GQA's at the same hidden size; and context parallelism's
  exchange per layer at 32K tokens (``cp_comparison``, ``planning/cost_comm.cp_volumes``, which
  tests/planning/test_cp_estimates.py holds to the elements the model's collectives move).
* EP: dispatch and combine each move exactly the routed rows (sum of routed_per_expert * h over
  the group, = k*T*h when dropless; no padding to E*capacity), backward the same exchanges
  reversed; plus the count exchange (E integers per rank) and the routed-count all-reduce of the
  load-balancing loss (E integers).
* Replicated-parameter gradients (``model/parallel/grad_sync.py``, the model's default
  "micro_batch" mode: one all-reduce per parameter in its gradient hook, over ep, tp,
  or tp x ep = mp for a parameter replicated over both) are per parameter, not per token:
  reported against "each replicated parameter once per backward", outside the check. (The
  trainer's "step" mode for ZeRO-0/1 sums them once per optimizer step in buckets instead.)

The script exits 1 when any per-token row exceeds its minimum (EP rows: differ from it), or when a
collective is issued that no row explains.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import re
import sys
import tempfile
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.utils.checkpoint


from model import DenseConfig, MixtralConfig, Transformer
from model.config import MoEConfig
from model.moe.layer import load_balancing_losses
from model.parallel import comm
from model.parallel.groups import build_groups
from training.run.spawn import run_ranks

# torch.distributed functions that move data; whichever exist in this torch are wrapped.
COLLECTIVES = ("all_reduce", "all_to_all_single", "all_to_all", "all_gather",
               "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
               "reduce_scatter_tensor", "reduce_scatter_single", "broadcast",
               "reduce", "gather", "scatter", "send", "recv", "isend", "irecv")
# torch 2.13 renamed the flat-tensor collectives (the old names are deprecated aliases): one name
# per collective in the table whatever the torch. The list APIs keep theirs (all_gather,
# reduce_scatter), so a return to them shows.
OP_NAMES = {"all_gather_single": "all_gather_into_tensor",
            "reduce_scatter_single": "reduce_scatter_tensor"}
# model/parallel/comm.py helpers, wrapped only to label the collectives they issue.
HELPERS = ("copy_to_region", "reduce_from_region", "all_to_all",
           "all_to_all_counts", "all_reduce_sum", "gather_sequence",
           "reduce_scatter_sequence", "gather_sequence_linears")
# Helpers whose backward issues the conjugate collective (labelled like the forward call).
CONJUGATE = ("copy_to_region", "all_to_all", "gather_sequence",
             "reduce_scatter_sequence", "gather_sequence_linears")


@dataclass(frozen=True)
class Sizes:
    """Problem sizes; ``batch`` is the micro-batch over all ep ranks (each takes batch/ep)."""

    batch: int = 4
    seq: int = 16
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 128
    vocab: int = 128
    experts: int = 4
    top_k: int = 2
    layers: int = 2
    tie_embeddings: bool = False
    activation_checkpointing: str = "none"   # Transformer.set_activation_checkpointing policy
    # the MLA layouts' latent widths (model/mla.py); their kv heads are the heads
    q_lora_rank: int = 24
    kv_lora_rank: int = 16
    qk_nope_head_dim: int = 8
    qk_rope_head_dim: int = 4
    v_head_dim: int = 8


# name, tp, ep, family, kv heads (None: Sizes.kv_heads), sequence parallelism, dispatch dtype
LAYOUTS = (("tp2/dense", 2, 1, "dense", None, False, None),
           ("tp2/dense-kv1", 2, 1, "dense", 1, False, None),
           ("tp2/mixtral", 2, 1, "mixtral", None, False, None),
           ("tp2-sp/dense", 2, 1, "dense", None, True, None),
           ("tp2-sp/mixtral", 2, 1, "mixtral", None, True, None),
           ("ep2/mixtral", 1, 2, "mixtral", None, False, None),
           ("ep2-bf16/mixtral", 1, 2, "mixtral", None, False, "bf16"),
           ("ep2-fp8/mixtral", 1, 2, "mixtral", None, False, "fp8"),
           ("tp2/mla", 2, 1, "mla", None, False, None),
           ("tp2/mla-noqlora", 2, 1, "mla-noqlora", None, False, None),
           ("tp2-sp/mla", 2, 1, "mla", None, True, None),
           ("tp2-sp/mla-noqlora", 2, 1, "mla-noqlora", None, True, None))


def _config(family: str, s: Sizes, kv_heads: int | None, layers: int, dispatch: str | None = None):
    common = dict(vocab_size=s.vocab, hidden_size=s.hidden, num_layers=layers, num_heads=s.heads,
                  num_kv_heads=kv_heads or s.kv_heads, ffn_hidden_size=s.ffn, max_seq_len=s.seq,
                  tie_embeddings=s.tie_embeddings, init_std=0.2)
    if family == "dense":
        return DenseConfig(**common).validate()
    if family.startswith("mla"):       # a Mixtral block with latent attention, kv heads = heads
        q_rank = None if family == "mla-noqlora" else s.q_lora_rank
        if (q_rank or 0) + s.kv_lora_rank + s.qk_rope_head_dim == s.hidden:
            raise ValueError("the MLA latents' width equals --hidden: their collectives would not "
                             "be told from the hidden state's")
        common.update(num_kv_heads=s.heads, attention="mla", q_lora_rank=q_rank,
                      kv_lora_rank=s.kv_lora_rank, qk_nope_head_dim=s.qk_nope_head_dim,
                      qk_rope_head_dim=s.qk_rope_head_dim, v_head_dim=s.v_head_dim)
    moe = MoEConfig(num_experts=s.experts, top_k=s.top_k, capacity_factor=None,
                    eval_capacity_factor=None, router_jitter=0.0, dispatch_dtype=dispatch)
    return MixtralConfig(**common, moe=moe).validate()


def latent_width(cfg) -> int | None:
    """Width w of the MLA latents [c_q, c_kv, k_rot] that enter the tp region together:
    q_lora_rank (0 without it) + kv_lora_rank + qk_rope_head_dim; None for GQA."""
    return (cfg.q_lora_rank or 0) + cfg.kv_lora_rank + cfg.qk_rope_head_dim if cfg.mla else None


# ------------------------------------------------------------------------------ the recorder

class CommRecorder:
    """Context manager: records every collective issued on this rank while it is active.

    Each record: op, phase (set by the caller), group name, elements this rank sends (for an
    all-reduce, the reduced tensor), of which to other ranks (all-to-all), bytes, the issuing
    module and comm helper, and for a replicated parameter's gradient sum the parameter.
    """

    def __init__(self, model: torch.nn.Module, groups):
        self.model, self.groups = model, groups
        self.phase = "forward"
        self.records: list[dict] = []
        self._params = {id(p): n for n, p in model.named_parameters()}
        self._modules: list[str] = []         # forward call stack of module names
        self._labels: list[dict] = []         # comm helper being run (forward)
        self._pending: dict | None = None     # label of the backward node running
        self._a2a_calls: dict[str, int] = defaultdict(int)
        self._saved: list[tuple] = []
        self._hooks: list = []
        self._busy = False

    def __enter__(self):
        for name in COLLECTIVES:
            if hasattr(dist, name):
                self._patch(dist, name, self._collective(name, getattr(dist, name)))
        for name in HELPERS:
            self._patch(comm, name, self._helper(name, getattr(comm, name)))
        for name, m in self.model.named_modules():
            self._hooks.append(m.register_forward_pre_hook(self._enter_module(name or "model")))
            self._hooks.append(m.register_forward_hook(self._leave_module))
        return self

    def _enter_module(self, name):
        def hook(_module, _inputs):
            self._modules.append(name)
        return hook

    def _leave_module(self, _module, _inputs, _output):
        self._modules.pop()

    def __exit__(self, *exc):
        for owner, name, fn in reversed(self._saved):
            setattr(owner, name, fn)
        for h in self._hooks:
            h.remove()
        return False

    def _patch(self, owner, name, fn):
        self._saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, fn)

    def _helper(self, kind, fn):
        def wrapper(x, *args, **kwargs):
            if self._labels:     # nested: the outer call names it
                return fn(x, *args, **kwargs)
            module = self._modules[-1] if self._modules else ""
            param = self._params.get(id(x), "")
            if sys._getframe(1).f_code.co_filename.endswith("grad_sync.py"):
                # ReplicaGradSync summing a parameter's .grad (or a flat bucket of them)
                hooked = sys._getframe(1).f_locals.get("param")    # None: a flat bucket
                kind_, param = "grad_sync", self._params.get(id(hooked), "bucket")
            elif kind == "all_to_all":    # _exchange's 1st call dispatches, its 2nd combines
                kind_ = ("all_to_all:dispatch", "all_to_all:combine")[self._a2a_calls[module] % 2]
                self._a2a_calls[module] += 1
            else:
                kind_ = kind
            label = dict(kind=kind_, module=module, param=param)
            self._labels.append(label)
            try:
                out = fn(x, *args, **kwargs)
            finally:
                self._labels.pop()
            first = out[0] if isinstance(out, tuple) else out     # outputs share one node
            if (kind in CONJUGATE and isinstance(first, torch.Tensor)
                    and first is not x and first.grad_fn is not None):
                # The node's backward issues the conjugate collective(s): name them the same.
                first.grad_fn.register_prehook(lambda grads, label=label: self._set_pending(label))
                first.grad_fn.register_hook(lambda *_: self._set_pending(None))
            return out
        return wrapper

    def _set_pending(self, label):
        self._pending = label

    def _collective(self, op, fn):
        signature = inspect.signature(fn)

        def wrapper(*args, **kwargs):
            if self._busy:       # a collective built on another: count the outer one only
                return fn(*args, **kwargs)
            self._busy = True
            try:
                self._record(OP_NAMES.get(op, op), signature.bind(*args, **kwargs).arguments)
                return fn(*args, **kwargs)
            finally:
                self._busy = False
        return wrapper

    def _record(self, op, a):
        group = a.get("group")
        tensor = _sent_tensors(op, a)
        elements = sum(t.numel() for t in tensor)
        if op == "all_to_all_single" and tensor and tensor[0].dtype == torch.uint8:
            elements -= 4 * tensor[0].shape[0]      # fp8 rows: the 4 bytes of each row's scale
        off_rank = elements
        if op == "all_to_all_single":      # rows addressed to this rank never leave it
            me, size = dist.get_rank(group), dist.get_world_size(group)
            splits = a.get("input_split_sizes") or [tensor[0].shape[0] // size] * size
            off_rank = elements - splits[me] * (elements // max(1, tensor[0].shape[0]))
        label = self._labels[-1] if self._labels else (self._pending or {})
        # A forward comm helper running inside backward is activation checkpointing's recompute
        # of the forward (a gradient sum is backward work of its own).
        phase = self.phase
        if phase == "backward" and self._labels and label.get("kind") != "grad_sync":
            phase = "recompute"
        self.records.append(dict(
            op=op, phase=phase, group=self._group_name(group),
            group_size=dist.get_world_size(group), elements=elements, off_rank=off_rank,
            bytes=sum(t.numel() * t.element_size() for t in tensor),
            shape=list(tensor[0].shape) if tensor else [], kind=label.get("kind", ""),
            module=label.get("module", self._modules[-1] if self._modules else ""),
            param=label.get("param", ""), site=_model_frame()))

    def _group_name(self, group) -> str:
        for name in ("tp", "ep", "mp", "dp", "batch", "pp"):
            if group is not None and group is getattr(self.groups, f"{name}_group"):
                return name
        return "world" if group is None else "other"


def _sent_tensors(op, a) -> list[torch.Tensor]:
    """The tensors whose contents this rank contributes to collective ``op``."""
    if op in ("all_to_all_single", "reduce_scatter_tensor"):
        return [a["input"]]
    if op in ("all_to_all", "reduce_scatter"):
        return list(a["input_list"] if "input_list" in a else a["input_tensor_list"])
    if op in ("all_gather", "all_gather_into_tensor"):
        return [a.get("tensor", a.get("input_tensor"))]
    if op in ("scatter",):
        return list(a.get("scatter_list") or [])
    return [a["tensor"]]


def _model_frame() -> str:
    """Qualified name of the innermost model/ function on the stack outside the ``comm``
    wrappers (the issuing code)."""
    f = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename
        if f"{os.sep}model{os.sep}" in name and not name.endswith(os.path.join("parallel", "comm.py")):
            return f.f_code.co_qualname
        f = f.f_back
    return ""


# ------------------------------------------------------------------------------ the ranks

def count_collectives(rank: int, world: int, sizes: Sizes, out_path: str,
                      layouts: tuple[str, ...] | None = None) -> None:
    """Rank body: measure each layout (all of ``LAYOUTS`` by default) at both scopes, gather the
    records on rank 0 and write them to ``out_path`` as JSON."""
    results = []
    for name, tp, ep, family, kv, sp, dispatch in LAYOUTS:
        if layouts is not None and name not in layouts:
            continue
        groups = build_groups(tp=tp, ep=ep, sequence_parallel=sp)
        for scope in ("block", "model"):
            cfg = _config(family, sizes, kv, 1 if scope == "block" else sizes.layers, dispatch)
            results.append(dict(layout=name, scope=scope, tp=tp, ep=ep, latent=latent_width(cfg),
                                q_lora=bool(cfg.mla and cfg.q_lora_rank),
                                **_measure(cfg, groups, scope, sizes)))
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(dict(sizes=dataclasses.asdict(sizes), ranks=gathered), f)


def _measure(cfg, groups, scope: str, s: Sizes) -> dict:
    model = Transformer(cfg, groups, init_seed=0).train()
    if s.activation_checkpointing != "none":
        model.set_activation_checkpointing(s.activation_checkpointing)
    gen = torch.Generator().manual_seed(1)          # same ids on every rank
    ids = torch.randint(0, s.vocab, (s.batch, s.seq), generator=gen)
    labels = torch.randint(0, s.vocab, (s.batch, s.seq), generator=gen)
    # One block: ep ranks see different tokens (their slice of the micro-batch), tp ranks the same
    # ones, or under sequence parallelism their own slice of the sequence.
    sp = groups.tp if groups.sequence_parallel else 1
    gen_x = torch.Generator().manual_seed(100 + groups.ep_rank * sp + groups.tp_rank % sp)
    x = torch.randn(s.batch // groups.ep, s.seq // sp, s.hidden, generator=gen_x).requires_grad_()
    dy = torch.randn(x.shape, generator=gen_x)
    with CommRecorder(model, groups) as rec:
        if scope == "block":
            rope = model.rotary(s.seq, x.device, x.dtype)
            if 0 in getattr(model, "checkpoint_blocks", ()):   # as Transformer.forward would
                y, aux = torch.utils.checkpoint.checkpoint(model.layers[0], x, rope, use_reentrant=False)
            else:
                y, aux = model.layers[0](x, rope)
            auxes = [aux] if aux is not None else []
            loss = (y * dy).sum() + sum(cfg.moe.aux_loss_coef * load_balancing_losses([a], groups)[0]
                                        for a in auxes)
        else:
            out = model(ids, labels)
            auxes = out.moe_aux
            loss = out.ce_sum / out.num_target_tokens + model.router_loss(out)
        rec.phase = "backward"
        loss.backward()
    moe_layers = [f"layers.{i}.mlp" for i in range(cfg.num_layers) if cfg.is_moe_layer(i)]
    used = [(n, p) for n, p in model.named_parameters() if scope == "model" or n.startswith("layers.0.")]
    # Which groups each parameter's gradient must be summed over, worked out here from the
    # layout (not read from the parameter's own declaration): ep for everything outside the
    # experts, tp for kv heads replicated over tp and, under sequence parallelism, the norms and
    # MLA's down-projections (run, like the norms, on each rank's own tokens).
    axes = defaultdict(set)
    for n, p in used:
        if groups.ep > 1 and ".experts." not in n:
            axes[n].add("ep")
    for n, m in model.named_modules():
        in_scope = scope == "model" or n.startswith("layers.0.")
        sp_norm = groups.sequence_parallel and n.endswith(("norm", "q_a_proj", "kv_a_proj_with_mqa"))
        if (getattr(m, "replicated_over_tp", False) or sp_norm) and in_scope:
            axes[f"{n}.weight"].add("tp")
    replicated_over = defaultdict(list)       # group -> numel of each parameter to sum there
    sizes_ = {n: p.numel() for n, p in used}
    for n, over in axes.items():
        replicated_over["mp" if len(over) == 2 else next(iter(over))].append(sizes_[n])
    return dict(records=rec.records, replicated_over=dict(replicated_over),
                routing=[dict(module=m, routed_per_expert=a.routed_per_expert.tolist(),
                              local_experts=model.get_submodule(m).experts.expert_ids)
                         for m, a in zip(moe_layers, auxes)])


# ------------------------------------------------------------------------------ analysis

@dataclass
class Row:
    """One line of the table: a kind of traffic in one phase of one layout and scope."""

    layout: str
    scope: str
    traffic: str
    op: str
    phase: str
    count: int                  # calls per rank
    elements: int               # all-reduce, reduce-scatter: the full tensor per rank; all-gather:
                                # this rank's shard; all-to-all: sent, summed over ranks
    bytes: int
    off_rank: int | None = None     # all-to-all: elements that left their rank
    minimum: int | None = None
    minimum_off: int | None = None
    formula: str = ""
    per_token: bool = True
    where: str = ""
    ok: bool = True
    note: str = ""


def _traffic(rec: dict, h: int, latent: int | None = None) -> tuple[str, bool]:
    """(what this collective is for, whether its volume scales with tokens); ``latent``: the MLA
    latents' width, None for GQA."""
    kind, mod = rec["kind"], re.sub(r"^layers\.\d+\.", "", rec["module"])
    hidden = bool(rec["shape"]) and rec["shape"][-1] == h
    if latent and mod.startswith("self_attn") and rec["shape"] and rec["shape"][-1] == latent:
        return "attention latents in (TP, MLA)", True
    if kind == "grad_sync":
        return f"replicated-parameter grads (grad_sync over {rec['group']})", False
    if kind.startswith("all_to_all:"):
        return f"MoE {kind.split(':')[1]} (all-to-all)", True
    if kind == "all_to_all_counts":
        return "MoE count exchange", True
    if kind == "all_reduce_sum" and rec["site"] == "load_balancing_losses":
        return "MoE routed counts (load-balancing loss, all layers at once)", True
    if mod.startswith("self_attn") and hidden:
        return "attention in/out (TP)", True
    if mod.startswith("mlp") and hidden:
        return "FFN in/out (TP)", True
    if mod.startswith("mlp") and kind == "copy_to_region":
        return "routing-weight grad (TP)", True
    if mod in ("embed_tokens", "lm_head") and hidden:
        return "embedding / output head (vocab-parallel)", True
    if rec["site"].startswith("_VocabParallelCE"):
        return "cross-entropy statistics (vocab-parallel)", True
    return f"unexplained: {kind or rec['site'] or rec['op']} @ {mod or '?'}", True


def _routing_expectations(result: dict, h: int) -> dict:
    """Per (MoE module, label, phase): elements each rank must send, and of them off-rank."""
    ranks = result["ranks"]
    out = {}
    for li, layer in enumerate(ranks[0]["routing"]):
        tpe = [r["routing"][li]["routed_per_expert"] for r in ranks]        # per source rank
        local = [set(r["routing"][li]["local_experts"]) for r in ranks]
        routed = [sum(t) for t in tpe]
        routed_off = [sum(c for e, c in enumerate(tpe[r]) if e not in local[r]) for r in range(len(ranks))]
        received = [sum(tpe[s][e] for s in range(len(ranks)) for e in local[r]) for r in range(len(ranks))]
        received_off = [sum(tpe[s][e] for s in range(len(ranks)) if s != r for e in local[r])
                        for r in range(len(ranks))]
        send = {("dispatch", "forward"): (routed, routed_off), ("combine", "backward"): (routed, routed_off),
                ("combine", "forward"): (received, received_off), ("dispatch", "backward"): (received, received_off)}
        for key, (rows, off) in send.items():
            out[(layer["module"],) + key] = ([r * h for r in rows], [r * h for r in off])
        out[(layer["module"], "max_load")] = max(max(sum(tpe[s][e] for s in range(len(ranks)))
                                                     for e in loc) for loc in local)
    return out


def analyse(data: dict) -> list[Row]:
    """Rows of the table for every layout and scope in ``data`` (``count_collectives`` output)."""
    s, rows = Sizes(**data["sizes"]), []
    for i, head in enumerate(data["ranks"][0]):
        rows += _analyse_one(dict(head, ranks=[r[i] for r in data["ranks"]]), s)
    return rows


def _analyse_one(result: dict, s: Sizes) -> list[Row]:
    h, world = s.hidden, len(result["ranks"])
    ctx = dict(layers=1 if result["scope"] == "block" else s.layers, ep=result["ep"], tp=result["tp"],
               T=s.batch * s.seq // result["ep"],               # tokens one rank computes
               latent=result.get("latent"), q_lora=result.get("q_lora", False),
               moe=len(result["ranks"][0]["routing"]),           # MoE layers in scope
               expect=_routing_expectations(result, h),
               replicated=result["ranks"][0]["replicated_over"])
    groups: dict[tuple, list] = defaultdict(lambda: [[] for _ in range(world)])
    for r, rank in enumerate(result["ranks"]):
        for rec in rank["records"]:
            traffic, per_token = _traffic(rec, h, ctx["latent"])
            groups[(traffic, rec["op"], rec["phase"], per_token)][r].append(rec)
    rows = []
    for (traffic, op, phase, per_token), by_rank in groups.items():
        reduce_like = op != "all_to_all_single"
        first = by_rank[0]
        row = Row(result["layout"], result["scope"], traffic, op, phase, count=len(first),
                  elements=sum(x["elements"] for x in first) if reduce_like else
                  sum(x["elements"] for recs in by_rank for x in recs),
                  bytes=sum(x["bytes"] for x in first) if reduce_like else
                  sum(x["bytes"] for recs in by_rank for x in recs),
                  per_token=per_token,
                  where=", ".join(sorted({re.sub(r"^layers\.\d+\.", "", x["param"] or (
                      x["site"] if x["kind"] == "" else x["module"])) for x in first})))
        if any(len(recs) != row.count for recs in by_rank):
            row.ok, row.note = False, "ranks issued different counts"
        if not reduce_like:
            row.off_rank = sum(x["off_rank"] for recs in by_rank for x in recs)
        _set_minimum(row, by_rank, s, ctx)
        rows.append(row)
    order = ("attention", "FFN", "routing", "embedding", "cross", "MoE dispatch", "MoE combine",
             "MoE count", "MoE routed", "replicated", "unexplained")
    phases = ("forward", "recompute", "backward")
    rows.sort(key=lambda r: (next(i for i, p in enumerate(order) if r.traffic.startswith(p)),
                             phases.index(r.phase)))
    return rows


def _set_minimum(row: Row, by_rank: list[list[dict]], s: Sizes, ctx: dict) -> None:
    """Fill the row's analytic minimum and check the measurement against it."""
    t, h, T, layers, moe, ep = row.traffic, s.hidden, ctx["T"], ctx["layers"], ctx["moe"], ctx["ep"]
    # MLA with q_lora_rank: the hidden state never enters the tp region, only its latents do
    latents_only = bool(ctx["latent"] and ctx["q_lora"])
    if t.startswith("attention latents"):
        # MLA: the latents [c_q, c_kv, k_rot], w wide, enter the region in one collective per
        # layer: SP gathers their (b, s/tp, w) shards forward (and in a recompute), the gradient
        # comes back as one reduce-scatter of b*s*w; without SP only the gradient's all-reduce
        # of b*s*w. The gathered latents are stored whole: no re-gather in backward.
        w, gather = ctx["latent"], row.op.startswith("all_gather")
        n = layers if (row.phase == "backward") != gather else 0
        row.minimum = n * T * w // (ctx["tp"] if gather else 1)
        row.formula = f"{n}·b·s·w{'/tp (shards)' if gather else ''}, w = {w}"
    elif t.startswith(("attention", "FFN", "embedding")) and row.op.startswith("all_gather"):
        # Sequence parallelism: each rank contributes its shard of every gathered b*s*h: one
        # per region entry forward, and backward one per region exit plus one per entry by
        # column-parallel layers, which store only the shard and gather it again (Megatron).
        n = 1 if t.startswith("embedding") else layers    # forward, and its recompute at most
        if t.startswith("attention") and latents_only:
            n = layers if row.phase == "backward" else 0    # o_proj's output gradient only
        elif row.phase == "backward":
            n += n - (moe if t.startswith("FFN") else 0)    # MoE layers store no gathered input
        row.minimum, row.formula = n * T * h // ctx["tp"], f"{n}·b·s·h/tp (shards)"
    elif t.startswith("attention") and latents_only and row.phase == "backward":
        row.minimum, row.formula = 0, "0 (no hidden-state entry)"
    elif t.startswith(("attention", "FFN")):
        row.minimum, row.formula = layers * T * h, f"{layers}·b·s·h"
    elif t.startswith("routing-weight"):
        row.minimum, row.formula = moe * T * s.top_k, f"{moe}·b·s·k"
    elif t.startswith("embedding"):
        row.minimum, row.formula = T * h, "b·s·h"
    elif t.startswith("cross-entropy"):
        row.minimum, row.formula = 3 * T, "3·b·s (max; target+sum-exp)"
    elif t.startswith("MoE count"):
        row.minimum, row.formula = moe * ep * s.experts, f"{moe}·ep·E (E ints per rank)"
    elif t.startswith("MoE routed"):
        row.minimum, row.formula = moe * s.experts, f"{moe}·E"
        if row.count > 1:
            row.ok, row.note = False, f"{row.count} calls: one per micro-batch for all MoE layers"
    elif t.startswith("replicated"):
        sizes = ctx["replicated"].get(t.split("over ")[1].rstrip(")"), [])
        row.minimum, row.formula = sum(sizes), f"{len(sizes)} params once"
        if row.count > len(sizes):
            row.note = f"{row.count} calls for {len(sizes)} replicated parameters"
    elif t.startswith(("MoE dispatch", "MoE combine")):
        label, expect = t.split()[1], ctx["expect"]
        row.formula = f"routed rows·h = {moe}·k·T·h"
        want, want_off = [0] * len(by_rank), [0] * len(by_rank)
        for r, recs in enumerate(by_rank):
            for module in {x["module"] for x in recs}:      # a recompute resends the forward's
                rows_, off = expect[(module, label, "forward" if row.phase == "recompute" else row.phase)]
                want[r] += rows_[r]
                want_off[r] += off[r]
            got = sum(x["elements"] for x in recs)
            if got != want[r]:
                row.ok, row.note = False, f"rank {r} sent {got}, routed {want[r]}"
        row.minimum, row.minimum_off = sum(want), sum(want_off)
        total_T, layers_here = s.batch * s.seq, len({x["module"] for x in by_rank[0]})
        if row.minimum != layers_here * s.top_k * total_T * h or row.off_rank != row.minimum_off:
            row.ok, row.note = False, row.note or "differs from k·T·h / routed off-rank rows"
        pad = sum(s.experts * expect[(m, "max_load")] * h for m in {x["module"] for x in by_rank[0]})
        row.note = row.note or f"padding every expert to the busiest: {pad}"
    else:
        row.ok, row.note = False, "no collective is expected here"
        return
    if row.per_token and row.elements > row.minimum:
        row.ok = False


def markdown(rows: list[Row]) -> str:
    head = ("| layout | scope | traffic | op | phase | count | elements measured | bytes "
            "| analytic minimum | ratio | issued by | note |")
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        meas = f"{r.elements}" + (f" (off-rank {r.off_rank})" if r.off_rank is not None else "")
        mini = "-" if r.minimum is None else f"{r.minimum} = {r.formula}" + (
            f" (off-rank {r.minimum_off})" if r.minimum_off is not None else "")
        ratio = "-" if not r.minimum else f"{r.elements / r.minimum:.2f}"
        flag = "" if r.ok or not r.per_token else " **EXCEEDS**"
        lines.append(f"| {r.layout} | {r.scope} | {r.traffic} | {r.op} | {r.phase} | {r.count} | "
                     f"{meas} | {r.bytes} | {mini} | {ratio}{flag} | {r.where} | {r.note} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ MLA at scale

# (name, hidden, q_lora_rank or None, kv_lora_rank, qk_rope_head_dim), from the recipes
MLA_SHAPES = (("DeepSeek-V3 / Kimi K2", 7168, 1536, 512, 64),        # recipes/deepseek_v3.yaml
              ("Moonlight-16B / V2-Lite", 2048, None, 512, 64))      # recipes/moonlight_16b_a3b.yaml


def attention_volumes(h: int, latent: int | None, q_lora: bool, tp: int, tokens: int,
                      sp: bool) -> dict[tuple, int]:
    """One block's attention TP collectives on one rank: {(op, phase): elements}, counted as in
    the table (all-reduce, reduce-scatter: the tensor; all-gather: this rank's shard).

    GQA (``latent`` None): the hidden state's entry into q/k/v and o_proj's exit, T h each way
    (SP: all-gather T h/tp + reduce-scatter T h forward, reduce-scatter T h + 2 all-gathers of
    T h/tp backward). MLA: the latents, w = ``latent`` wide, enter in one collective (all-reduce
    of T w backward; SP: all-gather T w/tp forward, reduce-scatter T w backward); with
    ``q_lora`` the hidden state does not enter at all (o_proj's exit remains), without it q_proj
    enters it as GQA does. The tiny layouts' counts equal this (tests/benchmarks/systems/test_comm_volume.py).
    """
    out: dict[tuple, int] = defaultdict(int)
    t = tokens
    hidden_entry = latent is None or not q_lora
    if sp:
        out[("reduce_scatter_tensor", "forward")] += t * h                  # o_proj
        out[("all_gather_into_tensor", "backward")] += t * h // tp          # its gradient
        if hidden_entry:                                                    # q/k/v or q_proj
            out[("all_gather_into_tensor", "forward")] += t * h // tp
            out[("reduce_scatter_tensor", "backward")] += t * h
            out[("all_gather_into_tensor", "backward")] += t * h // tp      # stored as a shard
        if latent:
            out[("all_gather_into_tensor", "forward")] += t * latent // tp
            out[("reduce_scatter_tensor", "backward")] += t * latent
    else:
        out[("all_reduce", "forward")] += t * h                             # o_proj
        if hidden_entry:
            out[("all_reduce", "backward")] += t * h
        if latent:
            out[("all_reduce", "backward")] += t * latent
    return dict(out)


def wire_elements(volumes: dict[tuple, int], tp: int) -> float:
    """Elements one rank sends for ``volumes`` with ring collectives: an all-reduce of n sends
    2 (tp-1)/tp n, a reduce-scatter of n (tp-1)/tp n, an all-gather of an n/tp shard (tp-1) n/tp."""
    factor = {"all_reduce": 2 * (tp - 1) / tp, "reduce_scatter_tensor": (tp - 1) / tp,
              "all_gather_into_tensor": tp - 1}
    return sum(factor[op] * n for (op, _), n in volumes.items())


def mla_comparison(tp: int = 8, tokens: int = 4096) -> str:
    """Markdown: per block and micro-batch of ``tokens`` (per rank, before SP's split), MLA's
    attention TP traffic against GQA's at the same hidden size, for ``MLA_SHAPES`` at ``tp``."""
    short = {"all_reduce": "AR", "reduce_scatter_tensor": "RS", "all_gather_into_tensor": "AG"}

    def fmt(vol, phase):
        return " + ".join(f"{short[op]} {n / 1e6:.2f}M" for (op, ph), n in sorted(vol.items())
                          if ph == phase) or "-"

    lines = [f"MLA against GQA at the same hidden size: one block's attention TP collectives per "
             f"rank, tp {tp}, {tokens} tokens per micro-batch (elements as in the table above; "
             f"wire: what a rank sends with ring collectives, bf16)", "",
             "| model | sp | attention | w | forward | backward | wire MB | vs GQA "
             "| + down-projection grad all-reduce over tp, bf16 |", "|" + "---|" * 9]
    for name, h, r_q, r_kv, rope in MLA_SHAPES:
        w = (r_q or 0) + r_kv + rope
        for sp in (True, False):
            gqa = attention_volumes(h, None, False, tp, tokens, sp)
            mla = attention_volumes(h, w, bool(r_q), tp, tokens, sp)
            base = wire_elements(gqa, tp) * 2
            for label, vol in (("GQA (hidden in)", gqa), ("MLA (latents in)", mla)):
                wire = wire_elements(vol, tp) * 2
                mla_row = vol is mla
                params = h * w + (r_q or 0) + r_kv      # q_a_proj, kv_a_proj_with_mqa, 2 norms
                extra = (f"{params / 1e6:.2f}M params: {2 * (tp - 1) / tp * params * 2 / 1e6:.1f} MB "
                         f"per micro-batch (step mode: per step)" if mla_row and sp else "-")
                lines.append(f"| {name} | {'yes' if sp else 'no'} | {label} | {w if mla_row else '-'} "
                             f"| {fmt(vol, 'forward')} | {fmt(vol, 'backward')} | {wire / 1e6:.1f} | "
                             f"{wire / base - 1:+.0%} | {extra} |")
    return "\n".join(lines)


CP_SHAPES = ("recipes/long_context_7b.yaml", "recipes/mixtral_8x7b.yaml", "recipes/deepseek_v3.yaml")


def cp_comparison(seq: int = 32768, cps=(2, 4, 8), gpu: str = "h100-80gb") -> str:
    """Markdown: context parallelism's attention exchange per layer and rank for one ``seq``-token
    sequence (bf16), each ``parallel.cp_comm``, from ``planning/cost_comm.cp_volumes`` (equal to
    the elements the model's collectives move: tests/planning/test_cp_estimates.py), with the
    seconds the cost model puts on them inside an 8-GPU node (``cp_seconds``; the ring's hidden
    behind the layer's attention)."""
    from planning.cost_comm import cp_seconds, cp_volumes
    from planning.cost_compute import attention_seconds
    from planning.cost_layout import Layout, Shape
    from planning.hardware import cluster
    from training.config.recipe import load_recipe
    where = cluster(gpu, 8)
    lines = [f"Context parallelism: one layer's attention exchange per rank, one {seq}-token sequence, "
             f"bf16, inside one {gpu} node (MB a rank sends, forward + backward, ring collectives; "
             f"ms the cost model does not hide)", "",
             "| model | heads / kv heads | cp | a2a MB | allgather MB | p2p MB | a2a ms | allgather ms | p2p ms exposed |",
             "|" + "---|" * 9]
    for path in CP_SHAPES:
        cfg = load_recipe(path, ["model.mtp_depth=0"]).model
        shape = Shape.from_config(cfg)
        kv = cfg.num_heads if cfg.mla else cfg.num_kv_heads
        for cp in cps:
            mb, ms = [], []
            for mode in ("a2a", "allgather", "p2p"):
                lay = Layout(world=cp, global_batch=1, seq_len=seq, cp=cp, cp_comm=mode, ep_splits_batch=True)
                wire = {"all_gather": cp - 1, "reduce_scatter": (cp - 1) / cp}   # ring collectives
                mb.append(sum(n * wire.get(op, 1) for (op, _), n in cp_volumes(shape, lay, range(1)).items())
                          * 2 / 1e6)
                attn = sum(attention_seconds(shape, lay, where.device))
                ms.append(cp_seconds(shape, lay, where, range(1), attn) * 1e3)
            lines.append(f"| {os.path.basename(path)[:-5]} | {cfg.num_heads} / {kv} | {cp} | "
                         + " | ".join(f"{x:.1f}" for x in mb) + " | " + " | ".join(f"{x:.2f}" for x in ms) + " |")
    return "\n".join(lines)


def run(sizes: Sizes, layouts: tuple[str, ...] | None = None) -> dict:
    """Spawn 2 gloo ranks, count, and return the gathered records."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "records.json")
        run_ranks(count_collectives, 2, sizes, path, layouts, timeout=600.0)
        with open(path) as f:
            return json.load(f)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for f in dataclasses.fields(Sizes):
        if f.type in (bool, "bool"):
            p.add_argument(f"--{f.name.replace('_', '-')}", action="store_true")
        elif f.type in (str, "str"):
            p.add_argument(f"--{f.name.replace('_', '-')}", default=f.default,
                           help="none, full, attention, moe, experts or every_k:<k> (collectives of the "
                                "recomputed forward count in a phase of their own, recompute)")
        else:
            p.add_argument(f"--{f.name.replace('_', '-')}", type=int, default=f.default)
    p.add_argument("--layouts", default=",".join(name for name, *_ in LAYOUTS),
                   help="comma-separated subset of the layouts")
    p.add_argument("--json", default=None, help="also write the raw records and rows here")
    p.add_argument("--mla-tp", type=int, default=8, help="tp of the MLA-against-GQA table")
    p.add_argument("--mla-tokens", type=int, default=4096,
                   help="tokens per micro-batch of the MLA-against-GQA table (DeepSeek-V3: 1 x 4096)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    layouts = tuple(args.layouts.split(","))
    unknown = sorted(set(layouts) - {name for name, *_ in LAYOUTS})
    if unknown:
        print(f"--layouts: unknown layout {unknown[0]!r} (known: "
              f"{', '.join(name for name, *_ in LAYOUTS)})", file=sys.stderr)
        return 2
    sizes = Sizes(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Sizes)})
    data = run(sizes, layouts)
    rows = analyse(data)
    print(f"sizes: {sizes}\n")
    print(markdown(rows))
    bad = [r for r in rows if r.per_token and not r.ok]
    for r in rows:
        if not r.per_token and r.note:
            print(f"\nnote ({r.layout} {r.scope}): {r.traffic}: {r.note}")
    print("\n" + mla_comparison(args.mla_tp, args.mla_tokens))
    print("\n" + cp_comparison())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(data, rows=[dataclasses.asdict(r) for r in rows]), f, indent=1)
    if bad:
        print(f"\nFAIL: {len(bad)} per-token rows above (or, for the expert exchange, different "
              f"from) the analytic minimum:")
        for r in bad:
            print(f"  {r.layout} {r.scope} {r.traffic} {r.phase}: {r.elements} vs {r.minimum} {r.note}")
        return 1
    print("\nOK: per-token traffic at the analytic minimum")
    return 0


if __name__ == "__main__":
    sys.exit(main())
