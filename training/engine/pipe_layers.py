"""The layers of the pipeline form of the transformer (``training/engine/pipeline.py``).

Each layer maps the stage I/O to the stage I/O, a tuple ``(hidden, aux_sum, z_sum, *docs, *tail)``
(``split_io``): ``docs`` the (B, S) document ids under document masking, ``tail`` what multi-token
prediction carries (``model.mtp_depth`` D > 0; ``model/mtp.py``). Under context parallelism the
hidden states hold this cp rank's S/cp tokens while the document and token ids stay whole-window,
as in ``Transformer.forward``:

    between stages                the (B, S) token ids (integer: no gradient)
    after ``embed_ahead``         the D embeddings of the tokens 1..D ahead     (last stage)
    after ``MTPPipe``             the D depths' normalized outputs              (last stage)
    after the head                the D depths' logits, for ``PipelineLoss``    (last stage)

The tail is empty outside training (MTP runs in training only) and without MTP, and the head then
drops the document ids. Parameter names are the ``Transformer``'s (``embed_tokens``,
``layers.N``, ``norm``, ``lm_head``, ``mtp.K``): the same init draws, ``--init-from`` keys and
checkpoint keys.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.utils.checkpoint

from model import mup
from model.checkpointing import CheckpointPolicy
from model.config import TransformerConfig
from model.document_mask import document_ids
from model.moe.layer import load_balancing_losses
from model.mtp import MTPModule, shifted
from model.parallel.cp_layout import cp_slice, rank_attention_inputs
from model.parallel.groups import ParallelGroups
from model.parallel.layers import ColumnParallelLinear, VocabParallelEmbedding
from model.rope import rotary_for
from model.transformer import Block, RMSNorm, expert_parallel_rows, init_weights, sequence_length


def _load(module: nn.Module, init: dict | None) -> None:
    # Parameter names are the Transformer's, so an init state dict loads by key.
    if init is not None:
        module.load_state_dict({k: init[k] for k in module.state_dict()}, strict=True)


def split_io(cfg: TransformerConfig, inputs) -> tuple:
    """(hidden, aux_sum, z_sum, docs, tail) of the stage I/O: ``docs`` a list of zero or one
    tensor, ``tail`` a list (see the module docstring)."""
    x, aux_sum, z_sum, *rest = inputs
    n = int(cfg.document_separator_id is not None)
    return x, aux_sum, z_sum, rest[:n], rest[n:]


def _add_router_losses(block: Block, aux, groups: ParallelGroups, aux_sum, z_sum, stash: list,
                       index: int):
    """Add one MoE block's losses to the carried sums; stash its detached statistics as
    (row ``index`` in ``cfg.moe_block_ids``, values) for ``TransformerPipe.add_step_stats``."""
    balance = load_balancing_losses([aux], groups, block.mlp.moe.global_balance)[0]
    stash.append((index, [t.detach() for t in (balance, aux.z_loss, aux.entropy, aux.dropped_frac,
                                                aux.routed_per_expert, aux.logit_max, aux.logit_lse)]))
    return aux_sum + balance, z_sum + aux.z_loss


class EmbeddingPipe(nn.Module):
    """First layer: token ids -> (hidden, aux_sum, z_sum[, docs][, ids]); also the tied head
    (``unembed``) and, under MTP, the embedding of the tokens ahead (``embed_ahead``)."""

    def __init__(self, cfg: TransformerConfig, groups: ParallelGroups, seed: int, init=None):
        super().__init__()
        self.groups, self.cfg = groups, cfg
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, groups)
        init_weights(self, cfg, seed)
        _load(self, init)

    def forward(self, input_ids: torch.Tensor):
        input_ids = expert_parallel_rows(input_ids, self.groups)                         # (B/ep, S)
        # Under cp this rank embeds its split_for_cp slice; the document ids and MTP's token
        # ids stay whole-window (each later layer slices what it derives from them).
        x = self.embed_tokens(cp_slice(input_ids, self.groups))                          # (B/ep, S/cp, H)
        # Zeros inside the autograd graph (a sum over no elements of x): DeepSpeed runs backward
        # on every floating-point stage output, so the sums must require grad even on a stage
        # without MoE layers.
        zero = x.flatten()[:0].sum().float()
        sep = self.cfg.document_separator_id
        docs = [] if sep is None else [document_ids(input_ids, sep)]                    # (B/ep, S)
        ids = [input_ids] if self.cfg.mtp_depth else []          # for MTP on the last stage
        return x, zero, zero.clone(), *docs, *ids


def embed_ahead(embedding: EmbeddingPipe, inputs):
    """``forward_fn`` of the embedding's tied copy before ``MTPPipe``: the token ids become the
    embeddings of the tokens 1..D ahead (in training; the ids end here either way)."""
    x, aux_sum, z_sum, docs, (input_ids,) = split_io(embedding.cfg, inputs)
    if not embedding.training:
        return x, aux_sum, z_sum, *docs
    # Shifted on the whole window, then this cp rank's slice (Transformer._mtp).
    ahead = [embedding.embed_tokens(cp_slice(shifted(input_ids, k, 0), embedding.groups))  # (B, S/cp, H)
             for k in range(1, embedding.cfg.mtp_depth + 1)]
    return x, aux_sum, z_sum, *docs, *ahead


def _head_outputs(logits, aux_sum, z_sum, docs: list, depth_logits: list) -> tuple:
    # PipelineLoss needs the document ids only for the MTP depths' targets.
    return (logits, aux_sum, z_sum, *docs, *depth_logits) if depth_logits else (logits, aux_sum, z_sum)


def unembed(embedding: EmbeddingPipe, inputs):
    """``forward_fn`` of the tied head: logits (and each MTP depth's) from the shared embedding
    weight."""
    x, aux_sum, z_sum, docs, tail = split_io(embedding.cfg, inputs)

    def head(h):
        return mup.scale_logits(embedding.cfg, embedding.embed_tokens(h, unembed=True))    # (B, S, V)
    return _head_outputs(head(x), aux_sum, z_sum, docs, [head(n) for n in tail])


class BlockPipe(nn.Module):
    """One transformer block; adds its MoE layer's losses to the carried sums.

    The block sits in ``self.layers[str(layer_idx)]`` so that parameter names are the
    Transformer's (``layers.N.*``).
    """

    def __init__(self, cfg: TransformerConfig, layer_idx: int, groups: ParallelGroups, seed: int,
                 checkpointing: str = "none", init=None):
        super().__init__()
        self.groups, self.cfg = groups, cfg
        policy = CheckpointPolicy.parse(checkpointing)
        block = Block(cfg, layer_idx, groups)
        block.set_checkpointing(policy)
        self.layers = nn.ModuleDict({str(layer_idx): block})
        self.rotary = rotary_for(cfg)
        self.checkpoint_whole = layer_idx in policy.whole_blocks(cfg.num_layers)
        self.moe_index = sum(cfg.is_moe_layer(i) for i in range(layer_idx))   # row in the stats
        self.moe_stats: list = []       # (row, detached MoEAux fields) per micro-batch
        init_weights(self, cfg, seed)
        _load(self, init)

    @property
    def block(self) -> Block:
        return next(iter(self.layers.values()))

    def moe_blocks(self) -> list[tuple[int, Block]]:
        """(row in ``cfg.moe_block_ids``, block) of this layer's MoE block, if it is one."""
        return [(self.moe_index, self.block)] if self.block.is_moe else []

    def forward(self, inputs):
        x, aux_sum, z_sum, docs, tail = split_io(self.cfg, inputs)
        rope, mask = rank_attention_inputs(self.rotary, sequence_length(x, self.groups), x,
                                           *(docs or [None]), self.groups)
        if self.checkpoint_whole and self.training:
            x, aux = torch.utils.checkpoint.checkpoint(self.block, x, rope, mask, use_reentrant=False)
        else:
            x, aux = self.block(x, rope, mask)
        if aux is not None:
            aux_sum, z_sum = _add_router_losses(self.block, aux, self.groups, aux_sum, z_sum,
                                                self.moe_stats, self.moe_index)
        return x, aux_sum, z_sum, *docs, *tail


class MTPPipe(nn.Module):
    """The MTP depths (``model/mtp.py``) on the last stage, before the final norm: from the last
    block's hidden state and ``embed_ahead``'s embeddings, each depth's normalized output for the
    head; their MoE blocks' losses added to the carried sums (after the model's, as in
    ``Transformer.forward``). Outside training a pass-through."""

    def __init__(self, cfg: TransformerConfig, groups: ParallelGroups, seed: int,
                 checkpointing: str = "none", init=None):
        super().__init__()
        self.groups, self.cfg = groups, cfg
        self.mtp = nn.ModuleList(MTPModule(cfg, d, groups) for d in range(1, cfg.mtp_depth + 1))
        policy = CheckpointPolicy.parse(checkpointing)
        for module in self.mtp:
            module.block.set_checkpointing(policy)
        self.rotary = rotary_for(cfg)
        # Depth d's block is block num_layers + d - 1; its row in the statistics, if MoE.
        ids = cfg.moe_block_ids
        self.moe_rows = [ids.index(cfg.num_layers + d) if m.block.is_moe else None
                         for d, m in enumerate(self.mtp)]
        self.moe_stats: list = []
        init_weights(self, cfg, seed)
        _load(self, init)

    def moe_blocks(self) -> list[tuple[int, Block]]:
        return [(row, m.block) for row, m in zip(self.moe_rows, self.mtp) if row is not None]

    def forward(self, inputs):
        x, aux_sum, z_sum, docs, ahead = split_io(self.cfg, inputs)
        if not ahead:
            return inputs
        rope, mask = rank_attention_inputs(self.rotary, sequence_length(x, self.groups), x,
                                           *(docs or [None]), self.groups)
        hidden, normed = x, []
        for module, embedded, row in zip(self.mtp, ahead, self.moe_rows, strict=True):
            hidden, out, aux = module(hidden, embedded, rope, mask)
            normed.append(out)
            if aux is not None:
                aux_sum, z_sum = _add_router_losses(module.block, aux, self.groups, aux_sum, z_sum,
                                                    self.moe_stats, row)
        return x, aux_sum, z_sum, *docs, *normed


class FinalNormPipe(nn.Module):
    """The final RMSNorm (before a tied head)."""

    def __init__(self, cfg: TransformerConfig, groups: ParallelGroups, seed: int, init=None):
        super().__init__()
        self.cfg = cfg
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, groups)
        init_weights(self, cfg, seed)
        _load(self, init)

    def forward(self, inputs):
        x, aux_sum, z_sum, docs, tail = split_io(self.cfg, inputs)
        return self.norm(x), aux_sum, z_sum, *docs, *tail


class HeadPipe(nn.Module):
    """The final RMSNorm and the untied output head (also over the MTP depths' outputs)."""

    def __init__(self, cfg: TransformerConfig, groups: ParallelGroups, seed: int, init=None):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, groups)
        self.lm_head = ColumnParallelLinear(cfg.hidden_size, cfg.vocab_size, groups)
        self.cfg = cfg
        init_weights(self, cfg, seed)
        _load(self, init)

    def forward(self, inputs):
        x, aux_sum, z_sum, docs, tail = split_io(self.cfg, inputs)

        def head(h):
            return mup.scale_logits(self.cfg, self.lm_head(h))                   # (B, S, V)
        return _head_outputs(head(self.norm(x)), aux_sum, z_sum, docs, [head(n) for n in tail])
