"""Activation-checkpointing policies (``train.activation_checkpointing``), parsed in one place.

    none          store everything
    full          recompute every block (store only the block inputs)
    attention     recompute the attention sub-layer of every block
    moe           recompute the MoE FFN sub-layers
    experts       recompute only the expert FFNs inside the MoE layers (routing and the
                  expert-parallel exchange are not repeated)
    every_k:<k>   recompute blocks 0, k, 2k, ... whole

``model.Transformer``, the pipeline stages, the recipe check and the memory model all read a
policy through ``CheckpointPolicy.parse``.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass

NAMES = ("none", "full", "attention", "moe", "experts", "every_k")
CHOICES = ("none", "full", "attention", "moe", "experts", "every_k:<k>")


@dataclass(frozen=True)
class CheckpointPolicy:
    """One parsed policy: its name and, for ``every_k``, its k."""

    name: str = "none"
    """One of ``NAMES``."""
    every_k: int | None = None
    """k of ``every_k:<k>``; None for the named policies."""

    @classmethod
    def parse(cls, text: str) -> "CheckpointPolicy":
        """The policy ``text`` names; ValueError (one line, with a did-you-mean) otherwise."""
        if text in NAMES[:-1]:
            return cls(text)
        match = re.fullmatch(r"every_k:(\d+)", str(text))
        if match and int(match.group(1)) >= 1:
            return cls("every_k", int(match.group(1)))
        near = difflib.get_close_matches(str(text), CHOICES, n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise ValueError(f"train.activation_checkpointing ({text!r}) is not one of "
                         f"{', '.join(CHOICES)} with k >= 1{hint}")

    def __str__(self) -> str:
        return f"every_k:{self.every_k}" if self.name == "every_k" else self.name

    def whole_blocks(self, num_layers: int) -> set[int]:
        """The blocks recomputed whole in backward."""
        if self.name == "full":
            return set(range(num_layers))
        if self.name == "every_k":
            return set(range(0, num_layers, self.every_k))
        return set()

    def problems(self, num_layers: int, has_moe: bool) -> list[str]:
        """Why this policy does not fit a model of ``num_layers`` blocks (empty when it does)."""
        out = []
        if self.every_k is not None and self.every_k > num_layers:
            out.append(f"train.activation_checkpointing ({self}) exceeds model.num_layers "
                       f"({num_layers}): choose k <= {num_layers}")
        if self.name in ("moe", "experts") and not has_moe:
            out.append(f"train.activation_checkpointing ({self}) needs MoE layers but "
                       f"model.family is dense: use full, attention or every_k:<k>")
        return out
