"""The parallel layout's degrees, validated once, up front (torchtitan's ``ParallelDims``).

    dims = ParallelDims(tp=2, ep=4, pp=1, sp=True, world_size=64, model=cfg, seq_len=4096, cp=2)
    dims.dp                                    # 4: the ranks left for data parallelism

Every check of a degree lives here: the recipe (``training/config/schema.py``), the process groups
(``model/parallel/groups.py``), the memory planner and the out-of-memory ladder all build one. The
checks that also need the DeepSpeed JSON (micro-batch vs ep, ZeRO stage vs pipelines) are
``training.config.ds_config.check_layout``. Plain Python: this module imports no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

from model.checks import is_int


class ModelShape(Protocol):
    """What the layout checks read of a model (``model.config.TransformerConfig`` has it all);
    a protocol, so that ``model/parallel/`` needs nothing from the model above it."""

    family: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden_size: int
    vocab_size: int
    expert_ffn_size: int
    moe: Any            # model.moe.config.MoEConfig, or None for a dense model


@dataclass(frozen=True)
class ParallelDims:
    """Tensor-, expert-, context-, pipeline-parallel degrees and sequence parallelism of one job.

    Construction raises ``ValueError`` naming the field, the value and the fix for the first
    problem (``problems`` lists them all). ``world_size``, ``model`` and ``seq_len`` are optional:
    without them the checks that need them are skipped (a recipe is checked before the world size
    is known).
    """

    tp: int = 1
    """Tensor-parallel degree (``parallel.tensor_parallel_size``)."""
    ep: int = 1
    """Expert-parallel degree (``parallel.expert_parallel_size``)."""
    pp: int = 1
    """Pipeline stages (``parallel.pipeline_parallel_size``)."""
    sp: bool = False
    """Sequence parallelism over the tp ranks (``parallel.sequence_parallel``)."""
    world_size: int | None = None
    """Processes in the job; data parallelism takes what tp x ep x cp x pp leaves."""
    model: ModelShape | None = None
    """The model the degrees must divide."""
    seq_len: int | None = None
    """Tokens per sample, split over cp (2 x cp chunks) and then over tp under sequence parallelism."""
    cp: int = 1
    """Context-parallel degree (``parallel.context_parallel_size``): ranks splitting every sequence."""
    cp_comm: str = "a2a"
    """Context parallelism's attention exchange (``parallel.cp_comm``): a2a, allgather or p2p."""

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ValueError(problems[0])

    @property
    def dp(self) -> int:
        """Data-parallel degree: ``world_size / (tp * ep * cp * pp)``."""
        assert self.world_size is not None, "ParallelDims built without a world size"
        return self.world_size // (self.tp * self.ep * self.cp * self.pp)

    def problems(self) -> list[str]:
        """Every problem of this layout, one line each, first the degrees themselves."""
        degrees = (("tensor_parallel_size", self.tp), ("expert_parallel_size", self.ep),
                   ("pipeline_parallel_size", self.pp), ("context_parallel_size", self.cp))
        out = [f"parallel.{name} ({value!r}) must be an integer >= 1"
               for name, value in degrees if not is_int(value, 1)]
        if self.world_size is not None and not is_int(self.world_size, 1):
            out.append(f"world size ({self.world_size!r}) must be an integer >= 1")
        if out:
            return out
        if self.model is not None:
            out += _model_problems(self.model, self.tp, self.ep, self.pp)
        if self.cp > 1:
            out += _cp_problems(self)
        elif self.sp and self.seq_len is not None and self.seq_len % self.tp:
            out.append(f"data.seq_len ({self.seq_len}) is not divisible by "
                       f"parallel.tensor_parallel_size ({self.tp}): sequence parallelism splits "
                       f"every sequence over the tensor-parallel ranks; use a multiple of {self.tp}")
        model = self.tp * self.ep * self.cp * self.pp
        if self.world_size is not None and self.world_size % model:
            out.append(f"world size ({self.world_size}) is not divisible by tensor_parallel_size x "
                       f"expert_parallel_size x context_parallel_size x pipeline_parallel_size "
                       f"({self.tp} x {self.ep} x {self.cp} x {self.pp} = {model}): launch a "
                       f"multiple of {model} processes (GPUs) or change the parallel sizes")
        return out


CP_COMMS = ("a2a", "allgather", "p2p")


def _cp_problems(d: ParallelDims) -> list[str]:
    """What context parallelism needs: whole chunks of the sequence (2 per cp rank, and the
    local S/cp split over tp under sequence parallelism), the query heads of a tp rank split
    over cp for the all-to-all. Pipeline stages and MTP compose with it (each rank shifts the
    MTP tokens and targets on the whole window before its slice)."""
    cp, out = d.cp, []
    if d.cp_comm not in CP_COMMS:
        out.append(f"parallel.cp_comm ({d.cp_comm!r}) must be one of {', '.join(CP_COMMS)}")
    need = math.lcm(2 * cp, cp * d.tp) if d.sp else 2 * cp
    if d.seq_len is not None and d.seq_len % need:
        why = f"2 x cp chunks, each rank's S/cp split over tp = {d.tp}" if d.sp else "2 x cp chunks"
        out.append(f"data.seq_len ({d.seq_len}) is not divisible by {need} for "
                   f"parallel.context_parallel_size ({cp}) ({why}): use a multiple of {need}")
    if d.model is not None and d.cp_comm == "a2a" and d.model.num_heads % d.tp == 0 \
            and (d.model.num_heads // d.tp) % cp:
        out.append(f"parallel.context_parallel_size ({cp}) does not divide the query heads per "
                   f"tp rank (model.num_heads {d.model.num_heads} / tp {d.tp}) for parallel.cp_comm "
                   f"a2a: use cp_comm allgather or p2p, or a cp that divides them")
    return out


def _model_problems(m: ModelShape, tp: int, ep: int, pp: int) -> list[str]:
    """What the degrees must divide in the model: heads, kv heads, FFN, vocabulary, experts;
    the pipeline needs a block per stage."""
    out = []
    heads, kv = m.num_heads, m.num_kv_heads
    if heads % tp:
        out.append(f"parallel.tensor_parallel_size ({tp}) does not divide model.num_heads "
                   f"({heads}): choose a divisor of {heads}")
    # KV heads are split over TP when tp divides them and replicated when they divide tp (GQA
    # with fewer KV heads than TP ranks, as Megatron does); anything else leaves ranks unequal.
    if kv % tp and tp % kv:
        ok = [d for d in range(1, heads + 1) if heads % d == 0 and (kv % d == 0 or d % kv == 0)]
        out.append(f"parallel.tensor_parallel_size ({tp}) and model.num_kv_heads ({kv}) must "
                   f"divide one another (KV heads are split or replicated): choose "
                   f"tensor_parallel_size in {ok}")
    for name in ("ffn_hidden_size", "vocab_size"):
        size = getattr(m, name)
        if size % tp:
            out.append(f"parallel.tensor_parallel_size ({tp}) does not divide model.{name} "
                       f"({size}): choose a divisor of {size}")
    if m.moe is not None and m.moe.expert_ffn_hidden_size and m.expert_ffn_size % tp:
        out.append(f"parallel.tensor_parallel_size ({tp}) does not divide "
                   f"model.moe.expert_ffn_hidden_size ({m.expert_ffn_size}): choose a divisor")
    shared = m.moe.shared_ffn_size(m.expert_ffn_size) if m.moe is not None else 0
    if shared % tp:
        out.append(f"parallel.tensor_parallel_size ({tp}) does not divide the shared experts' "
                   f"inner size ({shared}): set model.moe.shared_expert_ffn_hidden_size to a "
                   f"multiple of {tp}")
    if m.moe is None and ep != 1:
        out.append(f"parallel.expert_parallel_size ({ep}) must be 1 for model.family {m.family} "
                   f"(no experts): set it to 1 or choose switch or mixtral")
    if m.moe is not None and m.moe.num_experts % ep:
        n = m.moe.num_experts
        out.append(f"parallel.expert_parallel_size ({ep}) does not divide model.moe.num_experts "
                   f"({n}): choose a divisor of {n}")
    if pp > m.num_layers:
        out.append(f"parallel.pipeline_parallel_size ({pp}) exceeds model.num_layers "
                   f"({m.num_layers}): choose at most {m.num_layers}")
    return out
