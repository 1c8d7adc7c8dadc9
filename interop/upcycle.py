"""Sparse upcycling: a trained dense model's weights as the starting point of an MoE model.

Every weight outside the FFNs (embeddings, attention, norms, head) is copied. In each MoE block
the experts are copies of that block's dense SwiGLU MLP, ``down(silu(x @ gate) * (x @ up))``,
optionally with noise, and the router is new. ``launch/upcycle.py`` is the command; the output
is an init dir (``interop/hf.py``) that ``launch/train.py --init-from`` loads with the MoE recipe.

Why the MoE starts as the dense model. The MoE layer returns ``sum_k w_k * expert_{i_k}(x)``
over the k experts a token is routed to, with combine weights ``w_k``:

* Copies (``split`` 1): every expert is the MLP, so the output is ``(sum_k w_k) * MLP(x)``: the
  dense output whenever the weights sum to 1 for every token, whatever the router says:
  renormalized top-k (``normalize_top_k``, Mixtral, DeepSeek-V3's sigmoid too) with
  ``routed_scaling_factor`` 1, or softmax over all experts with ``top_k = num_experts``.
  Switch's raw top-1 probability (about 1/E at init) scales the output down instead.
* Slices (``split`` N): SwiGLU acts element-wise on the inner dimension, so cutting the MLP's
  inner dimension I into N slices of I/N gives N small SwiGLU experts whose outputs SUM to the
  MLP's output exactly. With E = N x c experts (c copies of each slice, expert e holding slice
  e mod N of copy e // N), the output is the dense one when every slice's weights, summed over
  its copies, are 1. A zero router gives every expert the same weight (1/E after softmax or
  renormalization), so that holds with ``top_k = num_experts`` and ``routed_scaling_factor``
  = N (c x N/E = 1). With top_k < E a token sees only some slices: not the dense model at init
  (the fine-grained MoEs of DeepSeek/Qwen2-MoE accept that and train it back).
* Nothing may be dropped: a capacity factor (train or eval) can drop tokens, whose FFN output
  is then zero.

* Shared experts (``num_shared_experts``, DeepSeek-MoE, Qwen2-MoE): the shared FFN, whose inner
  size must be the dense MLP's, is a copy of the MLP too, and the two paths split its output:
  the shared FFN's down projection is scaled by ``shared_fraction`` f (2f behind Qwen2-MoE's
  sigmoid gate, whose weight starts at zero, so it gates by exactly 1/2) and every routed
  expert's by 1 - f. The output is ``f * MLP(x) + (1 - f) * MLP(x)`` under the conditions above.

``exact_at_init`` states these conditions for a recipe; tests/interop/test_upcycle.py checks
the logits against the dense model's in each exact mode.

Noise (``noise`` s > 0): each expert's weights are multiplied by ``1 + s * eps``, eps ~ N(0, 1)
drawn per expert and element, so the copies differ (the router can then tell them apart) while
each weight moves by a relative s. The MoE is then only close to the dense model.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from interop import hf
from model.config import TransformerConfig, config_from_dict
from model.transformer import Transformer
from training.checkpoint.layout import read_run_config

# Config fields that must be the dense model's: they set the shapes of the copied weights, or
# (rope_theta, norm_eps) what those weights compute. max_seq_len has no weight: free.
SAME_FIELDS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
               "tie_embeddings", "rope_theta", "norm_eps")
PROVENANCE_FILE = "upcycle.json"
_FFN = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class UpcycleOptions:
    """How the experts and the router are made from the dense MLP."""

    split: int = 1
    """Slices of the dense MLP's inner dimension, each one expert (fine-grained experts)."""
    noise: float = 0.0
    """Std of the multiplicative Gaussian noise on each expert's weights (0: exact copies)."""
    seed: int = 0
    """Seed of the noise and of the router init."""
    router_std: float | None = None
    """Std of the router's normal init; None: 0 (zeros) when split > 1, whose exact start needs
    equal combine weights, else the recipe's model.init_std."""
    shared_fraction: float = 0.5
    """With shared experts: the share of the dense MLP's output the shared FFN carries at init."""

    def router_init_std(self, cfg: TransformerConfig) -> float:
        if self.router_std is not None:
            return self.router_std
        return 0.0 if self.split > 1 else cfg.init_std

    def validate(self) -> "UpcycleOptions":
        if isinstance(self.split, bool) or not isinstance(self.split, int) or self.split < 1:
            raise ValueError(f"--split ({self.split}) must be an integer >= 1")
        if not 0 <= self.noise < math.inf:
            raise ValueError(f"--noise ({self.noise}) must be a finite number >= 0 (0: exact copies)")
        if self.router_std is not None and not 0 <= self.router_std < math.inf:
            raise ValueError(f"--router-std ({self.router_std}) must be a finite number >= 0")
        if not 0 <= self.shared_fraction <= 1:
            raise ValueError(f"--shared-fraction ({self.shared_fraction}) must be in [0, 1]")
        return self


# --------------------------------------------------------------------------- reading the source

def _kind(source: Path) -> str:
    """"init" or "run" for a dense source directory; ValueError / FileNotFoundError otherwise."""
    if not source.is_dir():
        raise FileNotFoundError(f"--from {source}: no such directory; fix: pass a run directory of "
                                f"launch/train.py or an init dir (model_config.json + model.safetensors)")
    if (source / hf.INIT_CONFIG_FILE).is_file() and (source / hf.INIT_WEIGHTS_FILE).is_file():
        return "init"
    if (source / "config.json").is_file():
        return "run"
    raise ValueError(f"--from {source}: neither a run directory (config.json + checkpoints/) "
                     f"nor an init dir ({hf.INIT_CONFIG_FILE} + {hf.INIT_WEIGHTS_FILE})")


def read_dense_config(source: Path) -> TransformerConfig:
    """The model config of a dense run directory or init dir, without reading any weight."""
    source = Path(source)
    if _kind(source) == "init":
        try:
            cfg = config_from_dict(json.loads((source / hf.INIT_CONFIG_FILE).read_text(encoding="utf-8")))
        except (ValueError, KeyError, TypeError) as e:     # bad JSON or UTF-8, missing or bad keys
            raise ValueError(f"--from {source}: {hf.INIT_CONFIG_FILE} is invalid "
                             f"({type(e).__name__}: {e})") from None
    else:
        try:
            resolved = read_run_config(source)
        except ValueError as e:
            raise ValueError(str(e).replace("--run-dir ", "--from ", 1)) from None
        cfg = config_from_dict(resolved["recipe"]["model"])
    if cfg.moe is not None:
        raise ValueError(f"--from {source}: holds a {cfg.family} model; upcycling starts from a "
                         f"dense one (model.family dense)")
    return cfg


def read_dense(source: Path):
    """The dense model of a run directory (its newest checkpoint) or of an init dir.

    Returns:
        (config, full fp32 state dict, tokenizer or None)

    Raises:
        ValueError / FileNotFoundError: one line naming ``--from`` and the fix.
    """
    source = Path(source)
    cfg = read_dense_config(source)
    if _kind(source) == "init":
        _, sd, tokenizer = hf.load_init_dir(source)
        return cfg, {k: v.float() for k, v in sd.items()}, tokenizer
    from interop.consolidate import load_run_model
    try:
        model, cfg, tokenizer = load_run_model(source)
    except ValueError as e:
        raise ValueError(str(e).replace("--run-dir ", "--from ", 1)) from None
    return cfg, {k: v.detach().float() for k, v in model.state_dict().items()}, tokenizer


# --------------------------------------------------------------------------- checks

def check_compatible(dense: TransformerConfig, moe_cfg: TransformerConfig, split: int) -> None:
    """Refuse an MoE config whose weights cannot be the dense model's: one ``ValueError`` line
    naming the recipe field and the value to set."""
    if moe_cfg.moe is None:
        raise ValueError(f"model.family ({moe_cfg.family}) is not an MoE family; fix: pass an MoE "
                         f"recipe (switch or mixtral, e.g. recipes/tiny_mixtral.yaml)")
    for name in SAME_FIELDS:
        ours, theirs = getattr(moe_cfg, name), getattr(dense, name)
        if ours != theirs:
            raise ValueError(f"model.{name} ({ours}) differs from the dense model's ({theirs}); fix: "
                             f"--set model.{name}={theirs} or edit the recipe")
    moe, ffn = moe_cfg.moe, dense.ffn_hidden_size
    if ffn % split:
        raise ValueError(f"--split ({split}) does not divide the dense model's ffn_hidden_size ({ffn}); "
                         f"fix: choose a --split that divides {ffn}")
    dense_blocks = not all(moe_cfg.is_moe_layer(i) for i in range(moe_cfg.num_layers))
    if dense_blocks and moe_cfg.ffn_hidden_size != ffn:
        raise ValueError(f"model.ffn_hidden_size ({moe_cfg.ffn_hidden_size}) is the MLP of the blocks "
                         f"that stay dense, copied from the dense model's ({ffn}); fix: --set "
                         f"model.ffn_hidden_size={ffn} (and model.moe.expert_ffn_hidden_size="
                         f"{ffn // split} for the experts)")
    expert = moe_cfg.expert_ffn_size
    # With dense blocks, model.ffn_hidden_size is theirs: the experts' size has its own field.
    field = ("model.moe.expert_ffn_hidden_size" if moe.expert_ffn_hidden_size or dense_blocks
             else "model.ffn_hidden_size")
    if expert != ffn // split:
        hint = f" or --split {ffn // expert}" if ffn % expert == 0 else ""
        value = (f"{expert}" if moe.expert_ffn_hidden_size or not dense_blocks
                 else f"unset, so model.ffn_hidden_size, {expert}")
        raise ValueError(f"{field} ({value}) must be the dense model's ffn_hidden_size / --split = "
                         f"{ffn} / {split} = {ffn // split}; fix: --set {field}={ffn // split}{hint}")
    if moe.num_experts % split:
        raise ValueError(f"model.moe.num_experts ({moe.num_experts}) is not a multiple of --split "
                         f"({split}): each copy of the MLP is cut into {split} experts; fix: "
                         f"--set model.moe.num_experts={split * max(1, moe.num_experts // split)}")
    shared = moe.shared_ffn_size(expert) if moe.num_shared_experts else 0
    if shared and shared != ffn:
        raise ValueError(f"the shared experts' inner size ({shared}) must be the dense model's "
                         f"ffn_hidden_size ({ffn}): the shared FFN is a copy of the dense MLP; fix: "
                         f"--set model.moe.shared_expert_ffn_hidden_size={ffn}")


def exact_at_init(moe_cfg: TransformerConfig, opts: UpcycleOptions) -> str | None:
    """None when the upcycled model computes the dense model's function at init (up to float
    rounding), else the reason it does not (see the module docstring)."""
    moe, split = moe_cfg.moe, opts.split
    if opts.noise > 0:
        return f"--noise {opts.noise} perturbs the experts"
    for name in ("capacity_factor", "eval_capacity_factor"):
        if getattr(moe, name) is not None:
            return f"model.moe.{name} ({getattr(moe, name)}) can drop tokens; set it to null"
    E, k, scale = moe.num_experts, moe.top_k, moe.routed_scaling_factor
    if split == 1:
        if moe.normalize_top_k and scale == 1.0:
            return None
        if moe.score_function == "softmax" and k == E and scale == 1.0:
            return None
        return ("the combine weights do not sum to 1 per token: use model.moe.normalize_top_k=true "
                "and routed_scaling_factor=1.0")
    if k != E:
        return (f"top_k ({k}) < num_experts ({E}): a token gets {k} of the {E} slice experts, "
                f"not all {split} slices of the MLP; top_k={E} and routed_scaling_factor={split} are exact")
    if opts.router_init_std(moe_cfg) != 0:
        return "a non-zero router gives the slices unequal weights; use --router-std 0"
    per_expert = (1.0 / E if moe.normalize_top_k or moe.score_function == "softmax" else 0.5) * scale
    if not math.isclose(per_expert * E / split, 1.0, rel_tol=1e-12):
        need = split if moe.normalize_top_k or moe.score_function == "softmax" else 2 * split / E
        return (f"each slice's combine weights sum to {per_expert * E / split:g}, not 1: set "
                f"model.moe.routed_scaling_factor={need:g}")
    return None


# --------------------------------------------------------------------------- the weights

def _noisy(w: torch.Tensor, noise: float, gen: torch.Generator) -> torch.Tensor:
    if noise == 0:
        return w
    return w * (1.0 + noise * torch.randn(w.shape, generator=gen, dtype=w.dtype))


def upcycle_state_dict(dense: TransformerConfig, dense_sd: dict[str, torch.Tensor],
                       moe_cfg: TransformerConfig, opts: UpcycleOptions) -> dict[str, torch.Tensor]:
    """The MoE model's full state dict from the dense one's (both in our names, fp32).

    Starts from a freshly built MoE model (``model.init_std``, seed ``opts.seed``) so that
    every key the MoE has is present, then overwrites: every dense key of the same name (all
    weights outside the MoE FFNs; also the MLPs of blocks that stay dense); per MoE block the
    experts' ``(E, H, I/N)`` / ``(E, I/N, H)`` stacks (our ``x @ W`` layout: the transposes of
    the dense ``(I, H)`` / ``(H, I)`` weights) and the router's ``(E, H)`` weight.
    """
    check_compatible(dense, moe_cfg, opts.split)
    sd = Transformer(moe_cfg, init_seed=opts.seed).state_dict()
    gen = torch.Generator().manual_seed(opts.seed)
    moe, n = moe_cfg.moe, opts.split
    inner = moe_cfg.expert_ffn_size                                  # I/N per expert
    copied = set()
    for name, t in dense_sd.items():
        if name in sd:
            copied.add(name)
            if sd[name].shape != t.shape:
                raise ValueError(f"{name}: the dense weight is {tuple(t.shape)} but the MoE "
                                 f"expects {tuple(sd[name].shape)}")
            sd[name] = t.float().clone()
    router_std = opts.router_init_std(moe_cfg)
    for i in range(moe_cfg.num_layers):
        if not moe_cfg.is_moe_layer(i):
            continue
        p = f"layers.{i}.mlp."
        gate, up = dense_sd[p + "gate_proj.weight"].float(), dense_sd[p + "up_proj.weight"].float()
        down = dense_sd[p + "down_proj.weight"].float()                  # (I, H), (I, H), (H, I)
        stacks = {name: [] for name in _FFN}
        for e in range(moe.num_experts):
            cut = slice((e % n) * inner, (e % n + 1) * inner)           # slice e mod N
            stacks["gate_proj"].append(_noisy(gate[cut].t(), opts.noise, gen))     # (H, I/N)
            stacks["up_proj"].append(_noisy(up[cut].t(), opts.noise, gen))         # (H, I/N)
            stacks["down_proj"].append(_noisy(down[:, cut].t(), opts.noise, gen))  # (I/N, H)
        for name in _FFN:
            sd[p + "experts." + name] = torch.stack(stacks[name]).contiguous()   # (E, ., .)
        router = torch.randn(moe.num_experts, moe_cfg.hidden_size, generator=gen) * router_std
        sd[p + "gate.weight"] = router                                   # (E, H)
        copied.update(p + k for k in ("gate.weight", *(f"experts.{name}" for name in _FFN)))
        if moe.num_shared_experts:                                       # f to shared, 1 - f routed
            f = opts.shared_fraction
            sd[p + "experts.down_proj"] *= 1.0 - f
            gated = moe.shared_expert_gate                               # sigmoid(0) = 1/2
            shared_down = down * f * (2 if gated else 1)
            for name, w in (("gate_proj", gate), ("up_proj", up), ("down_proj", shared_down)):
                sd[p + f"shared_experts.{name}.weight"] = w.clone()      # (I, H), (I, H), (H, I)
                copied.add(p + f"shared_experts.{name}.weight")
            if gated:
                sd[p + "shared_expert_gate.weight"] = torch.zeros(1, moe_cfg.hidden_size)
                copied.add(p + "shared_expert_gate.weight")
    fresh = [k for k in sd if k not in copied and not k.endswith("e_score_correction_bias")]
    assert not fresh, f"not set from the dense model: {fresh[:3]}"   # the expert bias starts at 0
    return sd


# --------------------------------------------------------------------------- the init dir

def check_out_dir(out: Path) -> None:
    if Path(out).exists():
        raise ValueError(f"--out {out} already exists; fix: choose a new directory (upcycle never "
                         f"overwrites)")


def upcycle(source: Path, moe_cfg: TransformerConfig, out: Path, opts: UpcycleOptions) -> str | None:
    """Read the dense model at ``source``, write the MoE init dir ``out`` (model_config.json,
    model.safetensors, tokenizer/ when the source has one, upcycle.json), return
    ``exact_at_init``'s verdict. ``out`` is written beside itself and renamed into place, so
    a failure leaves nothing behind; an existing ``out`` is refused."""
    opts.validate()
    out = Path(out)
    check_out_dir(out)
    dense = read_dense_config(Path(source))            # refuse a mismatch before reading weights
    check_compatible(dense, moe_cfg, opts.split)
    dense, dense_sd, tokenizer = read_dense(Path(source))
    sd = upcycle_state_dict(dense, dense_sd, moe_cfg, opts)
    verdict = exact_at_init(moe_cfg, opts)
    tmp = out.with_name(f".{out.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        hf.save_init_dir(tmp, moe_cfg, sd, tokenizer)
        record = {"source": str(source), "split": opts.split, "noise": opts.noise, "seed": opts.seed,
                  "shared_fraction": opts.shared_fraction if moe_cfg.moe.num_shared_experts else None,
                  "router_std": opts.router_init_std(moe_cfg), "exact_at_init": verdict is None,
                  "not_exact_because": verdict, "dense_model": dense.to_dict()}
        (tmp / PROVENANCE_FILE).write_text(json.dumps(record, indent=2) + "\n")
        check_out_dir(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return verdict
