"""Recipe YAML -> frozen dataclasses, one per section, with type checks and cross-field validation.

A recipe says *what* to train (model, data, tokenizer, run length, parallel layout); the DeepSpeed
JSON says *how* to optimize it (ZeRO stage, precision, batch, optimizer, LR schedule). The two are
kept apart so that one recipe runs under any ``ds_configs/*.json``.

Every error is a one-line ``ValueError`` naming the recipe key, the value and the fix, because the
user's next action is to edit that key (or its ``--set`` override) and nothing else.

Example::

    recipe = load_recipe("recipes/tiny_mixtral.yaml", ["train.steps=50", "model.moe.top_k=1"])
    recipe.model.num_params(active=True)
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import re
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import yaml

from model.config import CONFIG_CLASSES, FAMILIES, DenseConfig, MoEConfig, TransformerConfig

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_RECIPE = REPO_ROOT / "recipes" / "tiny_mixtral.yaml"
CHECKPOINTING_CHOICES = ("none", "full", "attention", "moe", "experts", "every_k:<k>")
# Byte-level BPE needs its 256 byte symbols plus the end-of-text token (training/tokenization.py).
_MIN_BPE_VOCAB = 258


@dataclass(frozen=True)
class ParallelConfig:
    """Model-parallel layout; data parallelism takes the remaining ranks of the world."""

    tensor_parallel_size: int = 1
    """Ranks sharing each attention/MLP matmul (Megatron TP); must divide model.num_heads."""
    expert_parallel_size: int = 1
    """Ranks the experts of each MoE layer are spread over; must divide model.moe.num_experts."""
    pipeline_parallel_size: int = 1
    """Pipeline stages (DeepSpeed PipelineModule, 1F1B); DeepSpeed allows only ZeRO-0/1 with it."""
    sequence_parallel: bool = False
    """Megatron SP: split activations between TP regions along the sequence (seq_len % tp == 0)."""
    expert_placement: Literal["contiguous", "round_robin"] = "contiguous"
    """Which experts an EP rank holds: a contiguous block, or every ep-th expert."""

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "expert_parallel_size", "pipeline_parallel_size"):
            _check_min(f"parallel.{name}", getattr(self, name), 1)


@dataclass(frozen=True)
class DataConfig:
    """Where the training text comes from and how it is cut into samples."""

    source: str | tuple[str, ...] = "stdlib"
    """stdlib (embedded corpus), hf:<dataset>[:split], or local .txt/.jsonl/.parquet paths/globs."""
    text_field: str = "text"
    """Column holding the text in JSONL/parquet/HF records."""
    val_fraction: float = 0.02
    """Share of the corpus held out for evaluation (split deterministically)."""
    max_bytes: int | None = None
    """Cap on corpus bytes read, deterministic; null reads everything."""
    seq_len: int | None = None
    """Tokens per packed sample; null = model.max_seq_len."""

    def __post_init__(self) -> None:
        src = self.source
        if isinstance(src, str) and src != "stdlib" and not src.startswith("hf:"):
            src = (src,)  # one local path or glob: normalize so consumers see one shape
        src = tuple(src) if isinstance(src, list) else src
        object.__setattr__(self, "source", src)
        if src in ((), "hf:") or not all(isinstance(p, str) and p for p in self.source):
            shown = list(src) if isinstance(src, tuple) else src
            raise ValueError(f"data.source ({shown!r}) is empty: use stdlib, hf:<dataset>[:split] "
                             f"or [path/*.jsonl, ...]")
        if not self.text_field:
            raise ValueError("data.text_field ('') is empty: name the text column, e.g. text")
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"data.val_fraction ({self.val_fraction}) must be in (0, 1): "
                             f"e.g. 0.02")
        _check_min("data.max_bytes", self.max_bytes, 1, optional=True)
        _check_min("data.seq_len", self.seq_len, 1, optional=True)


@dataclass(frozen=True)
class TokenizerConfig:
    """Which tokenizer maps the text to token ids."""

    path: str | None = None
    """Local HF tokenizer directory; null trains (and caches) a byte-level BPE on the corpus."""
    vocab_size: int | None = None
    """Vocabulary of the trained BPE; null = model.vocab_size (must be <= model.vocab_size)."""
    train_bytes: int = 8_000_000
    """Corpus bytes the BPE is trained on (the first bytes of the training split)."""

    def __post_init__(self) -> None:
        _check_min("tokenizer.vocab_size", self.vocab_size, 1, optional=True)
        _check_min("tokenizer.train_bytes", self.train_bytes, 1)


@dataclass(frozen=True)
class TrainConfig:
    """Run length, checkpointing, memory/stability knobs (the optimizer lives in the DS JSON)."""

    steps: int = 100
    """Optimizer steps (--steps overrides)."""
    seed: int = 1234
    """Seed of model init, data order and every RNG stream (resume continues them)."""
    save_every: int = 50
    """Optimizer steps between checkpoints (the last step is always saved)."""
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

    def __post_init__(self) -> None:
        for name, low in (("steps", 1), ("seed", 0), ("save_every", 1), ("keep_last", 0),
                          ("log_every", 1), ("spike_window", 1)):
            _check_min(f"train.{name}", getattr(self, name), low)
        _ = self.checkpoint_every_k  # raises on a misspelt policy
        if not self.spike_factor > 1.0:
            raise ValueError(f"train.spike_factor ({self.spike_factor}) must be > 1, e.g. 4.0")

    @property
    def checkpoint_every_k(self) -> int | None:
        """k of ``every_k:<k>``, or None for the named policies; raises on a misspelling."""
        policy = self.activation_checkpointing
        if policy in CHECKPOINTING_CHOICES[:-1]:
            return None
        match = re.fullmatch(r"every_k:(\d+)", policy)
        if match and int(match.group(1)) >= 1:
            return int(match.group(1))
        near = difflib.get_close_matches(policy, CHECKPOINTING_CHOICES, n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise ValueError(f"train.activation_checkpointing ({policy!r}) is not one of "
                         f"{', '.join(CHECKPOINTING_CHOICES)} with k >= 1{hint}")


@dataclass(frozen=True)
class EvalConfig:
    """Held-out loss during training."""

    every: int = 50
    """Optimizer steps between evaluations; 0 turns evaluation off."""
    batches: int = 8
    """Micro-batches of the validation split per evaluation (the same ones every time)."""

    def __post_init__(self) -> None:
        _check_min("eval.every", self.every, 0)
        _check_min("eval.batches", self.batches, 1)


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
    """TP/EP/PP layout."""
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
        _check_cross(self)

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
    """Checks between sections: the layout fits the model, the data and tokenizer fit the model."""
    m, par = r.model, r.parallel
    tp, ep, pp = par.tensor_parallel_size, par.expert_parallel_size, par.pipeline_parallel_size
    heads, kv = m.num_heads, m.num_kv_heads
    if heads % tp:
        raise ValueError(f"parallel.tensor_parallel_size ({tp}) does not divide model.num_heads "
                         f"({heads}): choose a divisor of {heads}")
    # KV heads are split over TP when tp divides them and replicated when they divide tp (GQA
    # with fewer KV heads than TP ranks, as Megatron does); anything else leaves ranks unequal.
    if kv % tp and tp % kv:
        ok = [d for d in range(1, heads + 1) if heads % d == 0 and (kv % d == 0 or d % kv == 0)]
        raise ValueError(f"parallel.tensor_parallel_size ({tp}) and model.num_kv_heads ({kv}) "
                         f"must divide one another (KV heads are split or replicated): choose "
                         f"tensor_parallel_size in {ok}")
    if m.moe is None and ep != 1:
        raise ValueError(f"parallel.expert_parallel_size ({ep}) must be 1 for model.family "
                         f"{m.family} (no experts): set it to 1 or choose switch or mixtral")
    if m.moe is not None and m.moe.num_experts % ep:
        n = m.moe.num_experts
        raise ValueError(f"parallel.expert_parallel_size ({ep}) does not divide "
                         f"model.moe.num_experts ({n}): choose a divisor of {n}")
    if pp > m.num_layers:
        raise ValueError(f"parallel.pipeline_parallel_size ({pp}) exceeds model.num_layers "
                         f"({m.num_layers}): choose at most {m.num_layers}")
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
    k = r.train.checkpoint_every_k
    if k is not None and k > m.num_layers:
        raise ValueError(f"train.activation_checkpointing (every_k:{k}) exceeds model.num_layers "
                         f"({m.num_layers}): choose k <= {m.num_layers}")
    policy = r.train.activation_checkpointing
    if policy in ("moe", "experts") and m.moe is None:
        raise ValueError(f"train.activation_checkpointing ({policy}) needs MoE layers but "
                         f"model.family is dense: use full, attention or every_k:<k>")


def load_recipe(path: str | Path | None, overrides: Sequence[str] = ()) -> Recipe:
    """Reads a recipe YAML, applies ``--set`` overrides and validates everything.

    Args:
        path: Recipe file; None means ``recipes/tiny_mixtral.yaml``. A relative path that does not
            exist under the working directory is also looked up under the repo root.
        overrides: ``dotted.key=value`` strings; values are parsed as YAML and type-checked.

    Returns:
        The validated, frozen recipe.

    Raises:
        ValueError: one line naming the key, the value and the fix.
    """
    path = Path(DEFAULT_RECIPE if path is None else path)
    if not path.is_file() and not path.is_absolute() and (REPO_ROOT / path).is_file():
        path = REPO_ROOT / path
    if not path.is_file():
        raise ValueError(f"--recipe: file not found: {path} (pass a YAML from recipes/)")
    try:
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=_StrictLoader)
    except UnicodeDecodeError as exc:
        raise ValueError(f"--recipe: {path} is not UTF-8 text ({exc.reason} at byte {exc.start}): "
                         f"save it as UTF-8") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1} column {mark.column + 1}" if mark else ""
        problem = " ".join(str(getattr(exc, "problem", None) or exc).split())
        raise ValueError(f"--recipe: invalid YAML in {path}{where}: {problem} "
                         f"(fix the syntax there)") from None
    if not isinstance(raw, dict):
        raise ValueError(f"--recipe: {path} must be a YAML mapping of sections (name, model, "
                         f"train, ...), got {_show(raw)}")
    return recipe_from_dict(apply_overrides(raw, overrides))


def apply_overrides(raw: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Returns a deep copy of ``raw`` with each ``dotted.key=value`` set (value parsed as YAML)."""
    out = copy.deepcopy(dict(raw))
    for item in overrides:
        key, sep, text = item.partition("=")
        parts = key.strip().split(".")
        if not sep or not all(parts):
            raise ValueError(f"--set {item!r}: expected dotted.key=value, e.g. train.steps=50")
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            value = text  # e.g. an unquoted glob like *.txt, which YAML reads as an alias
        node = out
        for i, part in enumerate(parts[:-1]):
            if node.get(part) is None:
                node[part] = {}
            elif not isinstance(node[part], dict):
                raise ValueError(f"--set {item!r}: recipe key {'.'.join(parts[:i + 1])} is a "
                                 f"value, not a section: set it directly")
            node = node[part]
        node[parts[-1]] = value
    return out


def recipe_from_dict(d: Mapping[str, Any]) -> Recipe:
    """Builds and validates a Recipe from plain data (parsed YAML or ``Recipe.to_dict()``)."""
    _check_keys(d, ["name", "model", *SECTIONS], prefix="")
    if d.get("name") is None:
        raise ValueError("recipe key name is missing: add name: <run name> (runs/<name> is the "
                         "default run directory)")
    name = _check_type("name", d["name"], str)
    sections = {s: cls(**_typed_kwargs(cls, d.get(s), s)) for s, cls in SECTIONS.items()}
    return Recipe(name=name, model=_build_model(d.get("model")), **sections)


def _build_model(raw: Any) -> TransformerConfig:
    raw = dict(_mapping(raw, "model"))
    family = raw.pop("family", None)
    if family is None:
        raise ValueError(f"recipe key model.family is missing: set it to one of "
                         f"{', '.join(FAMILIES)}")
    if family not in CONFIG_CLASSES:
        raise ValueError(f"recipe key model.family: expected one of {'|'.join(FAMILIES)}, got "
                         f"{_show(family)}{_did_you_mean(str(family), FAMILIES)}")
    cls = CONFIG_CLASSES[family]
    moe_raw = raw.pop("moe", None)
    kwargs = _typed_kwargs(cls, raw, "model")
    # null (or no) moe section = the family's defaults; a section updates those defaults, so a
    # family switch via --set keeps the recipe's explicit MoE choices and nothing else.
    if moe_raw is not None:
        if cls is DenseConfig:
            raise ValueError("recipe key model.moe is set but model.family is dense: remove the "
                             "moe section (--set model.moe=null) or choose switch or mixtral")
        moe_kwargs = _typed_kwargs(MoEConfig, moe_raw, "model.moe")
        kwargs["moe"] = dataclasses.replace(cls().moe, **moe_kwargs)
    return cls(**kwargs).validate()


def _typed_kwargs(cls: type, raw: Any, prefix: str) -> dict[str, Any]:
    """Checks the keys of ``raw`` against ``cls``'s fields and the values against their types."""
    raw = _mapping(raw, prefix)
    hints = get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.name != "moe"]
    extra = ["family", "moe"] if prefix == "model" else []
    _check_keys(raw, names + extra, prefix)
    return {k: _check_type(f"{prefix}.{k}", v, hints[k]) for k, v in raw.items() if k in names}


def _mapping(raw: Any, prefix: str) -> Mapping[str, Any]:
    if raw is None:  # an empty section ("eval:") means all defaults
        return {}
    if not isinstance(raw, Mapping):
        raise ValueError(f"recipe key {prefix}: expected a mapping of keys, got {_show(raw)}")
    return raw


def _check_keys(raw: Mapping[str, Any], valid: Sequence[str], prefix: str) -> None:
    dot = f"{prefix}." if prefix else ""
    for key in raw:
        if key not in valid:
            hint = _did_you_mean(str(key), valid, dot) or (
                f" (valid keys{' under ' + prefix if prefix else ''}: {', '.join(valid)})")
            raise ValueError(f"unknown recipe key '{dot}{key}'{hint}")


def _check_type(key: str, value: Any, tp: Any) -> Any:
    """Returns ``value`` (ints widened to float, lists to tuples) if it matches ``tp``."""
    origin, args = get_origin(tp), get_args(tp)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in (a for a in args if a is not type(None)):
            try:
                return _check_type(key, value, arg)
            except ValueError:
                pass
    elif value is None:
        pass
    elif origin is Literal:
        if value in args and isinstance(value, str):
            return value
        hint = _did_you_mean(value, args) if isinstance(value, str) else ""
        raise ValueError(f"recipe key {key}: expected {_type_name(tp)}, got {_show(value)}{hint}")
    elif origin is tuple:
        if isinstance(value, (list, tuple)) and all(isinstance(v, args[0]) for v in value):
            return tuple(value)
    elif tp is bool or tp is str:
        if isinstance(value, tp):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        # PyYAML follows YAML 1.1, which reads 1e-3 (no dot) as a string: accept what float()
        # reads so that recipes may write coefficients the way papers do.
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    raise ValueError(f"recipe key {key}: expected {_type_name(tp)}, got {_show(value)}")


def _type_name(tp: Any) -> str:
    origin, args = get_origin(tp), get_args(tp)
    if origin in (Union, types.UnionType):
        names = [_type_name(a) for a in args if a is not type(None)]
        return " or ".join(names + (["null"] if type(None) in args else []))
    if origin is Literal:
        return "one of " + "|".join(args)
    if origin is tuple:
        return f"list of {args[0].__name__}"
    return tp.__name__


def _show(value: Any) -> str:
    if value is None:
        return "null"
    kind = {dict: "mapping", list: "list", tuple: "list"}.get(type(value), type(value).__name__)
    return f"{kind} {value!r}"


def _did_you_mean(word: str, choices: Sequence[str], prefix: str = "") -> str:
    near = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{prefix}{near[0]}'?)" if near else ""


def _check_min(name: str, value: Any, low: int, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} ({value!r}) must be an integer >= {low}"
                         + (" or null" if optional else ""))


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys, which plain YAML silently resolves to the last."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (keep one)", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)
