"""One decoder-only transformer for the dense, Switch and Mixtral families.

Pre-norm blocks: ``x + attn(norm(x))`` then ``x + ffn(norm(x))``, where the FFN is a SwiGLU MLP or
an MoE layer as ``config.is_moe_layer(i)`` decides. Parameter names follow transformers' Llama and
Mixtral (``embed_tokens``, ``layers.N.self_attn.q_proj``, ``mlp.gate`` ...), so converting to and
from HF checkpoints is a key copy (plus the expert-weight layout, see ``moe/experts.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.utils.checkpoint

from model.checkpointing import CheckpointPolicy
from model import mup
from model.config import TransformerConfig
from model.block import Attention, Block, MLP
from model.document_mask import document_ids
from model.moe.layer import MoEAux, load_balancing_losses
from model.mtp import MTPModule, depth_targets, shifted
from model.parallel.cp_layout import cp_slice, rank_attention_inputs
from model.parallel.grad_sync import ReplicaGradSync
from model.norm import RMSNorm
from model.parallel.groups import ParallelGroups
from model.parallel.layers import (ColumnParallelLinear, VocabParallelEmbedding, cross_entropy_sum,
                                   init_from_full)
from model.rope import rotary_for

IGNORE_INDEX = -100

__all__ = ["Attention", "Block", "IGNORE_INDEX", "MLP", "RMSNorm", "Transformer", "TransformerOutput",
           "expert_parallel_rows", "init_std_for", "init_weights", "sequence_length"]


def init_std_for(cfg: TransformerConfig):
    """name -> the std of the parameter's init: ``init_std`` for every matrix, residual-output
    projections scaled by 1/sqrt(2 * num_layers) (GPT-2 / Megatron) so the residual stream's
    variance does not grow with depth; None (ones) for norms, the q/k norms too; 0 for biases."""
    std = cfg.init_std
    out_std = std / math.sqrt(2 * cfg.num_layers)

    def std_for(name: str) -> float | None:
        if name.endswith("norm.weight"):
            return None
        if name.endswith(".bias"):
            return 0.0                                                  # Normal(0, 0): zeros
        if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
            return out_std * mup.init_scale(cfg, name)                  # 1.0 without muP
        return std * mup.init_scale(cfg, name)
    return std_for


@torch.no_grad()
def init_weights(module: nn.Module, cfg: TransformerConfig, seed: int, write=None) -> None:
    """Normal(0, std) per element, std by ``init_std_for``. Each full tensor is defined from
    (seed, name) in blocks along its sharded dims and this rank draws only the blocks of its
    shard (``model/parallel/draw.py``), so every layout starts from the same model; ``module``
    may be any part of the model whose parameter names are the Transformer's (e.g. a pipeline
    stage's layer). ``write``: how a shard is stored, see ``model.parallel.draw.fill_shards``."""
    init_from_full(module, init_std_for(cfg), seed, write)


def expert_parallel_rows(t: torch.Tensor, groups: ParallelGroups) -> torch.Tensor:
    """This ep rank's rows of a micro-batch, (B, ...) -> (B/ep, ...): expert-parallel ranks
    split each micro-batch between them (each routes its own tokens)."""
    ep = groups.ep
    if ep == 1:
        return t
    if t.shape[0] % ep:
        raise ValueError(f"micro-batch size ({t.shape[0]}) is not divisible by "
                         f"parallel.expert_parallel_size ({ep})")
    part = t.shape[0] // ep
    return t[groups.ep_rank * part:(groups.ep_rank + 1) * part]


def sequence_length(x: torch.Tensor, groups: ParallelGroups) -> int:
    """The window's length from a (B, s, H) residual-stream tensor between blocks (it holds S/cp
    positions under context parallelism, and of those 1/tp under sequence parallelism), for the
    RoPE tables."""
    return x.shape[1] * (groups.tp if groups.sequence_parallel else 1) * groups.cp


@dataclass
class TransformerOutput:
    """What the model returns; the trainer combines the losses (see ``total_loss``)."""

    logits: torch.Tensor                      # (B, S, V)
    ce_sum: torch.Tensor | None = None        # sum of next-token cross-entropy over target tokens
    num_target_tokens: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None      # load-balancing loss averaged over MoE layers
    z_loss: torch.Tensor | None = None        # router z-loss averaged over MoE layers
    moe_aux: list[MoEAux] = field(default_factory=list)   # per MoE layer, in layer order (MTP's last)
    mtp_ce_sum: list[torch.Tensor] = field(default_factory=list)   # per MTP depth: its cross-entropy sum
    mtp_target_tokens: list[torch.Tensor] = field(default_factory=list)   # per depth: its targets

    @property
    def loss(self) -> torch.Tensor:
        """Mean next-token cross-entropy over this batch's target tokens (no auxiliary losses)."""
        return self.ce_sum / self.num_target_tokens.clamp_min(1)


class Transformer(nn.Module):
    """Decoder-only language model for the dense, Switch and Mixtral families.

    Args:
        cfg: a validated ``DenseConfig``, ``SwitchConfig`` or ``MixtralConfig``.
        groups: process groups for tensor/expert parallelism (None: single process). Under
            expert parallelism each ep rank takes its slice of the micro-batch; under tensor
            parallelism ``logits`` is this rank's vocabulary shard (for every position, also
            under sequence parallelism, whose sequence shards live only between the layers).
        init_seed: seed of the weight init; the full weights are the same at any layout.
            None leaves the parameters uninitialized for the caller (a partitioned build
            initializes them after construction with ``reset_parameters(seed, write)``).
    """

    def __init__(self, cfg: TransformerConfig, groups: ParallelGroups | None = None,
                 init_seed: int | None = 0):
        super().__init__()
        self.cfg = cfg
        self.groups = groups or ParallelGroups()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, groups)
        self.layers = nn.ModuleList(Block(cfg, i, groups) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, groups)
        self.lm_head = None if cfg.tie_embeddings else ColumnParallelLinear(cfg.hidden_size, cfg.vocab_size, groups)
        self.rotary = rotary_for(cfg)
        # Multi-token prediction (model/mtp.py): in training only, unless ``mtp_in_eval``.
        self.mtp = nn.ModuleList(MTPModule(cfg, d, groups) for d in range(1, cfg.mtp_depth + 1))
        self.mtp_in_eval = False
        self.checkpoint_blocks: set[int] = set()    # blocks recomputed whole in backward
        if init_seed is not None:
            self.reset_parameters(init_seed)
        # Sums the gradients of replicated parameters over tp/ep, per parameter in its hook; the
        # trainer switches it to one bucketed sum per step where DeepSpeed allows it.
        self.grad_sync = ReplicaGradSync(self, self.groups)

    def set_activation_checkpointing(self, policy: str) -> None:
        """Choose what backward recomputes instead of storing: a ``train.activation_checkpointing``
        policy (none, full, attention, moe, experts, every_k:<k>; see ``model/checkpointing.py``).
        """
        policy = CheckpointPolicy.parse(policy)
        self.checkpoint_blocks = policy.whole_blocks(self.cfg.num_layers)
        for layer in [*self.layers, *(m.block for m in self.mtp)]:
            layer.set_checkpointing(policy)

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0, write=None) -> None:
        """See ``init_weights``: every layout starts from the same model."""
        init_weights(self, self.cfg, seed, write)

    def reset_buffers(self) -> None:
        """Recompute the derived fp32 buffers (RoPE frequencies) and put the expert biases back
        in fp32 after a build that created them in another dtype."""
        self.rotary.reset()
        for mlp in self._moe_layers():
            mlp.gate.reset_bias_dtype()

    def _moe_layers(self) -> list:
        """The MoE layers in order: the blocks', then the MTP modules' (``cfg.moe_block_ids``)."""
        blocks = [*self.layers, *(m.block for m in self.mtp)]
        return [b.mlp for b in blocks if b.is_moe]

    @torch.no_grad()
    def update_expert_bias(self, counts: torch.Tensor) -> None:
        """Loss-free balancing after an optimizer step (``TopKRouter.update_bias``): ``counts``
        (L_moe, E), the step's routed assignments per MoE layer (in layer order) and expert,
        summed over every micro-batch and every rank that sees different tokens. A no-op when
        ``model.moe.expert_bias_update_rate`` is 0."""
        for mlp, layer_counts in zip(self._moe_layers(), counts.unbind(0), strict=True):
            mlp.gate.update_bias(layer_counts)

    def expert_biases(self) -> list[tuple[int, torch.Tensor]]:
        """(MoE layer index, (E,) expert bias) of each router that holds one (loss-free
        balancing), in layer order."""
        return [(j, mlp.gate.e_score_correction_bias) for j, mlp in enumerate(self._moe_layers())
                if mlp.gate.e_score_correction_bias is not None]

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> TransformerOutput:
        """input_ids, labels: (B, S); labels already shifted (position t predicts labels[t]),
        ``-100`` where no target. Under context parallelism every cp rank gets the whole window
        and keeps its ``split_for_cp`` slice (the document ids are taken on the whole window
        first); the logits and losses are then those of its S/cp tokens."""
        g = self.groups
        input_ids = expert_parallel_rows(input_ids, g)
        labels = expert_parallel_rows(labels, g) if labels is not None else None
        S, sep = input_ids.shape[1], self.cfg.document_separator_id
        docs = None if sep is None else document_ids(input_ids, sep)          # (B, S) whole window
        window = input_ids, labels          # MTP shifts on the whole window, then slices
        # Under cp, this rank's load-balanced S/cp tokens (model/parallel/cp_layout.py).
        input_ids = cp_slice(input_ids, g)                                      # (B, S/cp)
        labels = cp_slice(labels, g) if labels is not None else None
        if g.sequence_parallel and input_ids.shape[1] % g.tp:
            raise ValueError(f"sequence length ({input_ids.shape[1]}) is not divisible by "
                             f"parallel.tensor_parallel_size ({g.tp}) under "
                             f"parallel.sequence_parallel")
        x = self.embed_tokens(input_ids)                        # (B, s, H); s/tp under SP
        rope, mask = rank_attention_inputs(self.rotary, S, x, docs, g)
        moe_aux = []
        for layer_idx, layer in enumerate(self.layers):
            if self.training and layer_idx in self.checkpoint_blocks:
                x, aux = torch.utils.checkpoint.checkpoint(layer, x, rope, mask, use_reentrant=False)
            else:
                x, aux = layer(x, rope, mask)
            if aux is not None:
                moe_aux.append(aux)
        out = TransformerOutput(logits=self._head(self.norm(x)), moe_aux=moe_aux)
        if self.mtp and labels is not None and (self.training or self.mtp_in_eval):
            self._mtp(out, x, *window, docs, rope, mask)
        if moe_aux:
            # Per-rank contributions: under expert parallelism they sum over the ep group to the
            # micro-batch's values (see MoEAux).
            out.aux_loss = load_balancing_losses(moe_aux, self.groups, self.cfg.moe.global_balance).mean()
            out.z_loss = torch.stack([a.z_loss for a in moe_aux]).mean()
        if labels is not None:
            out.ce_sum = self._ce_sum(out.logits, labels)
            out.num_target_tokens = (labels != IGNORE_INDEX).sum()
        return out

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        """(B, S, H) normalized hidden states -> logits (this rank's vocabulary shard under tp)."""
        if self.lm_head is None:
            logits = self.embed_tokens(x, unembed=True)                       # (B, S, V/tp)
        else:
            logits = self.lm_head(x)
        return mup.scale_logits(self.cfg, logits)                            # x 1/m under muP

    def _ce_sum(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return cross_entropy_sum(logits, labels, self.groups, head.start, IGNORE_INDEX)

    def _mtp(self, out: TransformerOutput, hidden, input_ids, labels, docs, rope, mask) -> None:
        """The MTP depths after the main model (``model/mtp.py``): each depth's cross-entropy sum
        and target count into ``out``, its MoE aux after the main model's. ``hidden``: the last
        block's output, before the final norm; ``input_ids``, ``labels``, ``docs``: the whole
        window's (B, S), shifted there and then sliced for this cp rank (a chunk's last tokens
        predict tokens of the next chunk)."""
        g = self.groups
        for k, module in enumerate(self.mtp, start=1):
            embedded = self.embed_tokens(cp_slice(shifted(input_ids, k, 0), g))     # tokens k ahead
            targets = cp_slice(depth_targets(labels, k, docs), g)
            hidden, normed, aux = module(hidden, embedded, rope, mask)
            out.mtp_ce_sum.append(self._ce_sum(self._head(normed), targets))
            out.mtp_target_tokens.append((targets != IGNORE_INDEX).sum())
            if aux is not None:
                out.moe_aux.append(aux)

    def mtp_objective(self, out: TransformerOutput) -> torch.Tensor | float:
        """``mtp_loss_coef / D`` x the depths' cross-entropy sums (0 without MTP): added to
        ``ce_sum`` before the trainer's normalization by the step's target tokens."""
        if not out.mtp_ce_sum:
            return 0.0
        return self.cfg.mtp_loss_coef / len(out.mtp_ce_sum) * torch.stack(out.mtp_ce_sum).sum()

    def router_loss(self, out: TransformerOutput) -> torch.Tensor:
        """``aux_loss_coef * aux + z_loss_coef * z`` (zero for dense models)."""
        if out.aux_loss is None:
            return out.logits.new_zeros((), dtype=torch.float32)
        moe = self.cfg.moe
        return moe.aux_loss_coef * out.aux_loss + moe.z_loss_coef * out.z_loss
