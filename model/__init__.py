"""Model code: plain PyTorch, no DeepSpeed, no argv/env/file access (see STYLE.md)."""

from model.config import (CONFIG_CLASSES, FAMILIES, DenseConfig, MixtralConfig, MoEConfig,
                          SwitchConfig, TransformerConfig)
from model.transformer import Transformer, TransformerOutput

__all__ = ["CONFIG_CLASSES", "FAMILIES", "DenseConfig", "MixtralConfig", "MoEConfig",
           "SwitchConfig", "TransformerConfig", "Transformer", "TransformerOutput"]
