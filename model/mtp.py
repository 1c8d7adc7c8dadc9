"""Multi-token prediction (MTP), DeepSeek-V3 section 2.2 (``model.mtp_depth`` modules).

After the main model, D modules predict further ahead, one token more each, sequentially: module
k (1..D) takes the previous depth's hidden state at position i (the main model's last block
output for k = 1, before its final norm) and the embedding of token i + k, and predicts token
i + k + 1:

    h'_i = W_k [RMSNorm(Emb(t_{i+k})); RMSNorm(h^{k-1}_i)]        (eh_proj: 2H -> H)
    h^k  = Block_k(h')                                           (one transformer block, causal)
    P^k  = OutHead(RMSNorm_k(h^k))                               (the model's own output head)

The embedding and the output head are the main model's (shared, not copied); each module has
its own two input norms, projection, block and final norm (DeepSeek's checkpoints name them
``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``). The loss of depth k is the cross-entropy
of its targets, and the objective adds ``mtp_loss_coef / D`` times their sum, each normalized
like the main loss by the step's target tokens (the paper's 1/T): a denser training signal, and
at inference a draft for speculative decoding. Targets that do not exist (the last k positions)
or cross a document boundary under document masking are ignored. The modules run in training
only (``Transformer.forward``): evaluation and export see the main model unless asked.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from model.block import Block
from model.config import TransformerConfig
from model.norm import RMSNorm
from model.parallel.groups import ParallelGroups
from model.parallel.layers import ReplicatedLinear

IGNORE_INDEX = -100


class MTPModule(nn.Module):
    """One depth: the two input norms, the projection of their concatenation, a transformer
    block (index ``num_layers + depth - 1``, DeepSeek's numbering: an MoE block where the model's
    rule says so) and the module's final norm. Tensor parallel as the main model's blocks; ``eh_proj`` is small and
    whole on every tp rank (``ReplicatedLinear``)."""

    def __init__(self, cfg: TransformerConfig, depth: int, groups: ParallelGroups | None = None):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.norm_eps
        self.enorm, self.hnorm = RMSNorm(h, eps, groups), RMSNorm(h, eps, groups)
        self.eh_proj = ReplicatedLinear(2 * h, h, groups)
        self.block = Block(cfg, cfg.num_layers + depth - 1, groups)
        self.norm = RMSNorm(h, eps, groups)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor, rope, mask=None):
        """hidden: the previous depth's (B, S, H) hidden state (S/tp under sequence parallelism);
        embedded: the embeddings of the tokens k ahead, the same shape. Returns (this depth's
        hidden state for the next, its normalized output for the head, the block's MoE aux)."""
        x = self.eh_proj(torch.cat((self.enorm(embedded), self.hnorm(hidden)), dim=-1))
        x, aux = self.block(x, rope, mask)
        return x, self.norm(x), aux


def shifted(t: torch.Tensor, k: int, fill: int) -> torch.Tensor:
    """(B, S) ``t`` moved k positions left, the last k (all, if k >= S) filled with ``fill``."""
    k = min(k, t.shape[1])
    return torch.cat((t[:, k:], t.new_full((t.shape[0], k), fill)), dim=1)


def depth_targets(labels: torch.Tensor, k: int, docs: torch.Tensor | None) -> torch.Tensor:
    """Depth k's targets: position i predicts ``labels[i + k]`` (the token i + k + 1), ignored
    where it does not exist or, with document ids ``docs`` (B, S), belongs to another document
    than position i."""
    target = shifted(labels, k, IGNORE_INDEX)
    if docs is None:
        return target
    # labels[i + k] is the token at i + k + 1; its document is docs[i + k + 1]
    ahead = shifted(docs, k + 1, -1)
    return torch.where(ahead == docs, target, torch.full_like(target, IGNORE_INDEX))
