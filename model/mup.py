"""muP, the maximal-update parametrization (Yang et al. 2022, "Tensor Programs V"), for Adam.

With ``model.mup_base_hidden_size`` set, the width multiplier is ``m = hidden_size /
mup_base_hidden_size`` and, relative to the standard parametrization (SP) at that width:

    hidden weights     init std x 1/sqrt(m), Adam lr x 1/m   (every matrix whose two sides grow
                       with the width: q/k/v/o, gate/up/down, the stacked experts, the shared
                       experts; and the router and shared-expert gate, hidden -> E and hidden -> 1)
    attention          scores q.k / head_dim instead of q.k / sqrt(head_dim)
    logits             lm_head(x) x 1/m (the readout's init and lr unchanged: the output
                       multiplier of the paper's Table 8 / the ``mup`` package's MuReadout,
                       equivalent to Table 3's init var 1/fan_in^2 and lr / fan_in)
    vector-like        embeddings, norms, biases: unchanged

so hyperparameters tuned at the base width transfer to wider models. The router is treated as
a hidden matrix (not a readout): its logits then keep the base model's scale at init and their
updates stay of the same size at every width, so routing at init does not depend on the width.
With ``mup_base_hidden_size`` null every function here is the identity and the model is
bitwise the standard one.
"""

from __future__ import annotations

import math

import torch

from model.config import TransformerConfig


def width_mult(cfg: TransformerConfig) -> float:
    """``hidden_size / mup_base_hidden_size``; 1.0 without muP."""
    base = cfg.mup_base_hidden_size
    return cfg.hidden_size / base if base else 1.0


def is_hidden(name: str) -> bool:
    """Whether parameter ``name`` (the Transformer's names) is a hidden, matrix-like weight under
    muP; embeddings, the readout (``lm_head``), norms and biases are vector-like."""
    if name.endswith(("norm.weight", ".bias")) or "embed_tokens" in name or "lm_head" in name:
        return False
    return name.endswith(".weight") or ".experts." in name


def init_scale(cfg: TransformerConfig, name: str) -> float:
    """Factor on the SP init std of parameter ``name``: 1/sqrt(m) for hidden weights."""
    if not cfg.mup_base_hidden_size or not is_hidden(name):
        return 1.0
    return 1.0 / math.sqrt(width_mult(cfg))


def lr_scale(cfg: TransformerConfig, name: str) -> float:
    """Factor on the Adam learning rate of parameter ``name``: 1/m for hidden weights."""
    if not cfg.mup_base_hidden_size or not is_hidden(name):
        return 1.0
    return 1.0 / width_mult(cfg)


def attention_scale(cfg: TransformerConfig) -> float | None:
    """``scale`` for ``scaled_dot_product_attention``: 1/head_dim under muP, None (its default
    1/sqrt(head_dim)) without."""
    return 1.0 / cfg.head_dim if cfg.mup_base_hidden_size else None


def scale_logits(cfg: TransformerConfig, logits: torch.Tensor) -> torch.Tensor:
    """The output multiplier: logits x 1/m under muP, the same tensor without."""
    if not cfg.mup_base_hidden_size:
        return logits
    return logits * (1.0 / width_mult(cfg))
