"""What a recipe holds: one frozen dataclass per section, each field with its one-line docstring.

A recipe says *what* to train (model, data, tokenizer, run length, parallel layout); the DeepSpeed
JSON says *how* to optimize it (ZeRO stage, precision, batch, optimizer, LR schedule). The two are
kept apart so that one recipe runs under any ``ds_configs/*.json``. Each section checks its own
fields; ``Recipe`` checks the sections against each other and the model (the parallel degrees
through ``ParallelDims``, the checkpointing policy through ``CheckpointPolicy``). Reading YAML
into these classes is ``recipe.py``.
"""

from __future__ import annotations

import dataclasses
import re
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from model.checkpointing import CheckpointPolicy
from model.config import TransformerConfig, check_int
from model.parallel.dims import ParallelDims
from training.data.streams import parse_sources

# Byte-level BPE needs its 256 byte symbols plus the end-of-text token (data_pipeline/tokenizer.py).
_MIN_BPE_VOCAB = 258


@dataclass(frozen=True, kw_only=True)        # by name only: fields are added in reading order
class ParallelConfig:
    """Model-parallel layout; data parallelism takes the remaining ranks of the world."""

    tensor_parallel_size: int = 1
    """Ranks sharing each attention/MLP matmul (Megatron TP); divides the heads, FFN and vocab."""
    expert_parallel_size: int = 1
    """Ranks the experts of each MoE layer are spread over; must divide model.moe.num_experts."""
    pipeline_parallel_size: int = 1
    """Pipeline stages (DeepSpeed PipelineModule); DeepSpeed allows only ZeRO-0/1 with it."""
    pipeline_schedule: Literal["1f1b", "gpipe", "zb-h1"] = "1f1b"
    """1f1b (DeepSpeed's TrainSchedule), gpipe (all forwards, then all backwards) or zb-h1 (zero-bubble H1: weight gradients deferred to the cool-down, fp32 or bf16; training/engine/pipe_schedules.py)."""
    sequence_parallel: bool = False
    """Megatron SP: split activations between TP regions along the sequence (seq_len % tp == 0)."""
    context_parallel_size: int = 1
    """Ranks splitting every sequence (2 x cp load-balanced chunks); only attention communicates (docs/context-parallelism.md)."""
    cp_comm: Literal["a2a", "allgather", "p2p"] = "a2a"
    """Context parallelism's attention exchange: a2a (Ulysses, cp divides heads per tp rank), allgather (K/V), p2p (ring)."""
    expert_placement: Literal["contiguous", "round_robin"] = "contiguous"
    """Which experts an EP rank holds: a contiguous block, or every ep-th expert."""
    timeout_minutes: float = 30.0
    """How long any collective may wait before the job fails (every process group's timeout)."""
    backend: Literal["auto", "nccl", "gloo", "cuda:gloo"] = "auto"
    """auto (NCCL on GPUs, gloo on CPU); cuda:gloo refuses CPU tensors as NCCL does, on one GPU."""
    grad_compression: Literal["none", "bf16", "powersgd"] = "none"
    """The data-parallel gradient exchange: bf16 (DeepSpeed's communication_data_type) or powersgd (ZeRO-0/1, fp32 or bf16)."""
    powersgd_rank: int = 4
    """PowerSGD's factor width r: r (n + m) numbers per n x m gradient matrix instead of n m."""
    powersgd_start_steps: int = 10
    """Optimizer steps whose gradients are exchanged uncompressed before PowerSGD starts."""
    powersgd_error_feedback: bool = True
    """Carry what the compression left out into the next step (off only to study what it does)."""
    shared_expert_overlap: bool = False
    """Compute the shared experts while the expert dispatch all-to-all is in flight (needs ep > 1 and shared experts)."""
    expert_exchange: Literal["flat", "hierarchical"] = "flat"
    """hierarchical: each token crosses the network once per destination node, then spreads inside it."""
    node_size: int | None = None
    """Ranks per node for the hierarchical exchange; null = LOCAL_WORLD_SIZE, the ranks the launcher starts per node."""

    def __post_init__(self) -> None:
        ParallelDims(self.tensor_parallel_size, self.expert_parallel_size, self.pipeline_parallel_size,
                     cp=self.context_parallel_size, cp_comm=self.cp_comm)
        if not self.timeout_minutes > 0:
            raise ValueError(f"parallel.timeout_minutes ({self.timeout_minutes}) must be > 0: "
                             f"give the minutes a collective may wait (30 is a good default)")
        check_int("parallel.powersgd_rank", self.powersgd_rank, 1)
        check_int("parallel.powersgd_start_steps", self.powersgd_start_steps, 0)
        if self.pipeline_schedule != "1f1b" and self.pipeline_parallel_size == 1:
            raise ValueError(f"parallel.pipeline_schedule {self.pipeline_schedule} needs pipeline stages "
                             f"(pipeline_parallel_size is 1): set pipeline_parallel_size > 1, or drop it")
        check_int("parallel.node_size", self.node_size, 1, optional=True)
        if self.node_size is not None and self.expert_exchange == "flat":
            raise ValueError(f"parallel.node_size ({self.node_size}) is set but parallel.expert_exchange "
                             f"is flat: set expert_exchange: hierarchical, or drop node_size")
        if self.grad_compression != "powersgd":
            for f in dataclasses.fields(self):
                if f.name.startswith("powersgd_") and getattr(self, f.name) != f.default:
                    raise ValueError(f"parallel.{f.name} ({getattr(self, f.name)!r}) is set but "
                                     f"parallel.grad_compression is {self.grad_compression}: set "
                                     f"grad_compression: powersgd, or drop {f.name}")


@dataclass(frozen=True)
class DataConfig:
    """Where the training text comes from and how it is cut into samples.

    ``train_specs`` and ``val_specs`` (``SourceSpec`` tuples, ``training/data/streams.py``): the
    ``source`` and ``val_source`` entries with their blend weights, parsed once at validation.
    """

    source: str | tuple[str | int | float, ...] = "stdlib"
    """stdlib, a prepared prefix, raw files/globs or hf:<name> (prepared into the cache); a list, or a blend [w, prefix, ...]."""
    val_source: str | tuple[str | int | float, ...] | None = None
    """Held-out data in the same forms; null holds out data.val_fraction of every dataset."""
    text_field: str = "text"
    """Column holding the text in JSONL/parquet/HF records."""
    val_fraction: float = 0.02
    """Share of each dataset's documents (the last of every shard) held out for evaluation."""
    max_bytes: int | None = None
    """Cap on the bytes of raw text prepared per entry, deterministic; null prepares everything."""
    seq_len: int | None = None
    """Tokens per packed sample; null = model.max_seq_len."""
    document_masking: bool = False
    """Packed documents attend only within themselves, positions restart after each EOS (Megatron's reset_*)."""

    def __post_init__(self) -> None:
        for name in ("source", "val_source"):
            value = getattr(self, name)
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))
        # Parsed once, here (one line naming the field otherwise); everything after reads these
        # two attributes (not fields: the recipe's YAML and config.json keep the forms as written).
        object.__setattr__(self, "train_specs", parse_sources(self.source, "data.source"))
        object.__setattr__(self, "val_specs", None if self.val_source is None else
                           parse_sources(self.val_source, "data.val_source"))
        if not self.text_field:
            raise ValueError("data.text_field ('') is empty: name the text column, e.g. text")
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"data.val_fraction ({self.val_fraction}) must be in (0, 1): "
                             f"e.g. 0.02")
        check_int("data.max_bytes", self.max_bytes, 1, optional=True)
        check_int("data.seq_len", self.seq_len, 1, optional=True)


@dataclass(frozen=True)
class TokenizerConfig:
    """Which tokenizer maps the text to token ids."""

    path: str | None = None
    """Local HF tokenizer directory; null trains (and caches) a byte-level BPE on the corpus."""
    vocab_size: int | None = None
    """Vocabulary of the trained BPE; null = model.vocab_size (must be <= model.vocab_size)."""
    train_bytes: int = 8_000_000
    """Raw-text bytes the BPE is trained on, sampled over the whole of the raw entries."""

    def __post_init__(self) -> None:
        check_int("tokenizer.vocab_size", self.vocab_size, 1, optional=True)
        check_int("tokenizer.train_bytes", self.train_bytes, 1)


@dataclass(frozen=True)
class TrainConfig:
    """Run length, checkpointing, memory/stability knobs (the optimizer lives in the DS JSON)."""

    steps: int = 100
    """Optimizer steps (--steps overrides)."""
    seed: int = 1234
    """Seed of model init, data order and every RNG stream (resume continues them)."""
    save_every: int = 50
    """Steps between checkpoints, and one at the last step; 0 saves only on preemption or spike stop."""
    keep_last: int = 3
    """Checkpoints kept on disk, oldest deleted first; 0 keeps all."""
    log_every: int = 10
    """Steps between console lines (metrics.jsonl gets every step)."""
    activation_checkpointing: str = "none"
    """Recompute in backward: none | full | attention | moe | experts (expert FFNs) | every_k:<k>."""
    memory_snapshot: bool = False
    """On a GPU, record allocation stack traces for the out-of-memory report's snapshot (slower)."""
    spike_action: Literal["log", "skip", "stop"] = "log"
    """On a loss spike: log it, skip the optimizer step, or save and stop."""
    spike_factor: float = 4.0
    """A step's loss above spike_factor x the running mean of the last spike_window steps spikes."""
    spike_window: int = 50
    """Steps in the running mean the spike test compares against."""
    grad_spike_factor: float | None = None
    """grad_norm above this x the last spike_window steps' mean is a spike (docs/stability.md); None: off."""
    async_save: bool = True
    """Write checkpoint files in a background thread while training goes on (training/checkpoint/saving.py)."""
    on_save_error: Literal["continue", "stop"] = "continue"
    """A checkpoint a rank could not write (disk full): keep training, or stop with exit code 74."""
    hang_timeout_s: float = 0.0
    """Seconds with no step done before every rank dumps stacks, exits 76; 0: 10x slowest, >= 300."""
    preemption_signals: tuple[str, ...] = ("SIGTERM", "SIGUSR1")
    """Signals that make every rank finish its step, save and exit 75; SIGUSR1 always (preemption.py)."""
    noise_scale: bool = True
    """Log the gradient noise scale where the layout allows it exactly (training/step/noise_scale.py)."""
    tf32: bool = False
    """On a GPU, fp32 matmuls and convolutions in TF32 (10-bit mantissa; faster, less exact)."""
    compile: bool = False
    """torch.compile each transformer block on its own (training/engine/compile.py); eager by default."""
    qk_clip_tau: float | None = None
    """QK-clip (Kimi K2's MuonClip): heads whose max logit passed this are scaled back to it; None: off."""

    def __post_init__(self) -> None:
        for name, low in (("steps", 1), ("seed", 0), ("save_every", 0), ("keep_last", 0),
                          ("log_every", 1), ("spike_window", 1)):
            check_int(f"train.{name}", getattr(self, name), low)
        _ = self.checkpointing  # raises on a misspelt policy
        if not (isinstance(self.hang_timeout_s, (int, float)) and self.hang_timeout_s >= 0):
            raise ValueError(f"train.hang_timeout_s ({self.hang_timeout_s}) must be a number of "
                             f"seconds >= 0 (0: automatic, 10x the slowest recent step)")
        if not self.spike_factor > 1.0:
            raise ValueError(f"train.spike_factor ({self.spike_factor}) must be > 1, e.g. 4.0")
        if self.grad_spike_factor is not None and not (
                isinstance(self.grad_spike_factor, (int, float)) and self.grad_spike_factor > 1.0):
            raise ValueError(f"train.grad_spike_factor ({self.grad_spike_factor}) must be > 1, e.g. 5.0, "
                             f"or null (off)")
        if self.qk_clip_tau is not None and not (
                isinstance(self.qk_clip_tau, (int, float)) and not isinstance(self.qk_clip_tau, bool)
                and self.qk_clip_tau > 0):
            raise ValueError(f"train.qk_clip_tau ({self.qk_clip_tau}) must be a number > 0 (Kimi K2: 100), "
                             f"or null (off)")
        for name in self.preemption_signals:
            if name in ("SIGKILL", "SIGSTOP") or not isinstance(getattr(signal, name, None),
                                                                signal.Signals):
                raise ValueError(f"train.preemption_signals: {name!r} is not a signal a process "
                                 f"can catch; use names such as SIGTERM, SIGUSR1, SIGUSR2")

    @property
    def checkpointing(self) -> CheckpointPolicy:
        """``activation_checkpointing`` parsed; raises on a misspelling."""
        return CheckpointPolicy.parse(self.activation_checkpointing)


@dataclass(frozen=True)
class EvalConfig:
    """Held-out loss during training."""

    every: int = 50
    """Optimizer steps between evaluations; 0 turns evaluation off."""
    batches: int = 8
    """Micro-batches of the validation split per evaluation (the same ones every time)."""

    def __post_init__(self) -> None:
        check_int("eval.every", self.every, 0)
        check_int("eval.batches", self.batches, 1)


@dataclass(frozen=True)
class TrackingConfig:
    """Weights & Biases logging (metrics.jsonl in the run directory is always written)."""

    wandb: bool = False
    """Send metrics to W&B; offline under the run directory when no API key is set."""
    project: str = "ds-moe-recipes"
    """W&B project."""
    run_name: str | None = None
    """W&B run name; null = the recipe name."""
    entity: str | None = None
    """W&B team or user; null = the API key's default entity."""
    tags: tuple[str, ...] = ()
    """W&B tags."""

    def __post_init__(self) -> None:
        if not self.project:
            raise ValueError("tracking.project ('') is empty: name a W&B project")
        if not all(isinstance(t, str) for t in self.tags):
            raise ValueError(f"tracking.tags ({list(self.tags)!r}) must be strings: quote them")


SECTIONS: dict[str, type] = {
    "parallel": ParallelConfig, "data": DataConfig, "tokenizer": TokenizerConfig,
    "train": TrainConfig, "eval": EvalConfig, "tracking": TrackingConfig}


@dataclass(frozen=True)
class Recipe:
    """A whole recipe: the validated model config plus one frozen dataclass per section."""

    name: str
    """Run name; the default run directory is runs/<name>."""
    model: TransformerConfig
    """Validated model config of the family's class (DenseConfig, SwitchConfig, MixtralConfig)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """TP/EP/CP/PP layout."""
    data: DataConfig = field(default_factory=DataConfig)
    """Corpus and sample length."""
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    """Tokenizer choice."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Run length, checkpoints, stability."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Held-out evaluation."""
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    """W&B."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not re.fullmatch(r"[A-Za-z0-9._-]+", self.name):
            raise ValueError(f"name ({self.name!r}) must be a plain directory name: use letters, "
                             f"digits, '.', '-' and '_'")
        self.model.validate()
        self.dims()
        _check_cross(self)

    def dims(self, world_size: int | None = None) -> ParallelDims:
        """The parallel layout checked against the model, the sample length and, when given,
        the world size (ValueError naming the field otherwise)."""
        par = self.parallel
        return ParallelDims(par.tensor_parallel_size, par.expert_parallel_size,
                            par.pipeline_parallel_size, par.sequence_parallel, world_size,
                            self.model, self.seq_len, par.context_parallel_size, par.cp_comm)

    @property
    def seq_len(self) -> int:
        """Tokens per training sample (data.seq_len, else model.max_seq_len)."""
        return self.data.seq_len or self.model.max_seq_len

    @property
    def tokenizer_vocab_size(self) -> int:
        """Vocabulary of the BPE to train (tokenizer.vocab_size, else model.vocab_size)."""
        return self.tokenizer.vocab_size or self.model.vocab_size

    @property
    def default_run_dir(self) -> Path:
        """runs/<name>, relative to the working directory."""
        return Path("runs") / self.name

    def to_dict(self) -> dict[str, Any]:
        """Plain, JSON-serializable form; ``recipe_from_dict`` rebuilds an equal Recipe."""
        out: dict[str, Any] = {"name": self.name, "model": self.model.to_dict()}
        for section in SECTIONS:
            out[section] = {k: list(v) if isinstance(v, tuple) else v
                            for k, v in dataclasses.asdict(getattr(self, section)).items()}
        return out


def _check_cross(r: Recipe) -> None:
    """Checks between sections: the data and tokenizer fit the model, and so does the
    checkpointing policy (the layout is ``Recipe.dims``)."""
    m = r.model
    if r.train.qk_clip_tau is not None:
        problem = ("model.qk_norm is true (the norm after q_proj and k_proj undoes their scaling)" if
                   getattr(m, "qk_norm", False) else
                   "parallel.context_parallel_size > 1 (a head's logits span the cp ranks)"
                   if r.parallel.context_parallel_size > 1 else
                   "data.document_masking is true (its heads attend within documents only)"
                   if r.data.document_masking else None)
        if problem:
            raise ValueError(f"train.qk_clip_tau: {problem}; set it to null")
    if r.parallel.expert_exchange == "hierarchical":
        problem = ("the model has no experts" if m.moe is None else
                   "expert_parallel_size is 1" if r.parallel.expert_parallel_size == 1 else
                   f"model.moe.dispatch_dtype is {m.moe.dispatch_dtype} (rows travel as computed)"
                   if m.moe.dispatch_dtype else
                   "shared_expert_overlap is true (it overlaps the flat exchange)"
                   if r.parallel.shared_expert_overlap else None)
        if problem:
            raise ValueError(f"parallel.expert_exchange hierarchical: {problem}; use flat")
    if r.parallel.shared_expert_overlap:
        if m.moe is None or not m.moe.num_shared_experts:
            raise ValueError("parallel.shared_expert_overlap is true but the model has no shared "
                             "experts (model.moe.num_shared_experts): set it false")
        if r.parallel.expert_parallel_size == 1:
            raise ValueError("parallel.shared_expert_overlap is true but expert_parallel_size is 1: "
                             "there is no expert exchange to overlap; set it false or use ep > 1")
    if r.data.seq_len is not None and r.data.seq_len > m.max_seq_len:
        raise ValueError(f"data.seq_len ({r.data.seq_len}) exceeds model.max_seq_len "
                         f"({m.max_seq_len}): lower it or raise model.max_seq_len")
    if r.tokenizer.vocab_size is not None and r.tokenizer.vocab_size > m.vocab_size:
        raise ValueError(f"tokenizer.vocab_size ({r.tokenizer.vocab_size}) exceeds "
                         f"model.vocab_size ({m.vocab_size}): token ids must fit the embedding; "
                         f"lower it or raise model.vocab_size")
    if r.tokenizer.path is None and r.tokenizer_vocab_size < _MIN_BPE_VOCAB:
        raise ValueError(f"tokenizer.vocab_size ({r.tokenizer_vocab_size}) is below "
                         f"{_MIN_BPE_VOCAB}, the byte-level BPE minimum: raise it")
    problems = r.train.checkpointing.problems(m.num_layers, m.moe is not None)
    if problems:
        raise ValueError(problems[0])
