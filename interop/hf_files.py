"""Reading and writing transformers (Hugging Face) checkpoint folders.

``export_hf`` writes our model as ``LlamaForCausalLM`` / ``MixtralForCausalLM`` /
``Qwen2MoeForCausalLM`` / ``Qwen3MoeForCausalLM`` / ``DeepseekV3ForCausalLM`` (safetensors, the
class ``hf.hf_model_type`` picks) plus its tokenizer; ``import_hf`` reads a local folder of any of
them into an init dir for ``train.py --init-from``. The config and weight-name mapping is
``interop/hf.py``. Used by ``launch/convert_hf.py``.

Multi-token prediction (DeepSeek-V3): transformers' model has no MTP layers, so the export adds
them to the saved files after ``save_pretrained``, where DeepSeek's checkpoints keep them
(``hf_deepseek.mtp_to_files``; transformers then warns of unexpected keys and ignores them), and
the import reads them from the files directly.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from interop import hf, hf_deepseek

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")


def log(message: str) -> None:
    print(f"convert_hf: {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- export

def export_hf(model, cfg, tokenizer, out_dir: Path, dtype: torch.dtype = torch.float32,
              drop_mtp: bool = False):
    """Write ``model`` as a transformers checkpoint folder (safetensors) plus its tokenizer.

    Args:
        model: our ``Transformer`` (any device; weights are copied to CPU).
        cfg: its config (dense or mixtral; see ``hf.hf_model_type`` for the HF class).
        tokenizer: a transformers tokenizer, saved beside the weights (None to skip).
        out_dir: target folder (created).
        dtype: dtype of the saved weights.
        drop_mtp: leave the multi-token-prediction modules out (``model.mtp_depth``).

    Returns:
        The HF model that was saved.

    Raises:
        ValueError: when the config has no HF equivalent (switch family, capacity factor, ...).
    """
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    if drop_mtp:
        cfg = dataclasses.replace(cfg, mtp_depth=0)
    hf_config = hf.to_hf_config(cfg, dtype=dtype)       # refuses before any work
    if tokenizer is not None:
        # Llama's defaults (bos 1, eos 2) belong to Llama's tokenizer, not ours.
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            setattr(hf_config, name, getattr(tokenizer, name, None))
    log(f"converting {cfg.family} weights to {type(hf_config).__name__.removesuffix('Config')}"
        f"ForCausalLM layout ({str(dtype).removeprefix('torch.')})")
    if cfg.moe is not None and cfg.moe.router_dtype == "bf16":
        log("note: this model was trained with model.moe.router_dtype bf16; transformers routes in "
            "fp32 (close, not the trained arithmetic: ties between experts may break differently)")
    our_sd = {k: v.detach().to("cpu", dtype) for k, v in model.state_dict().items()
              if cfg.mtp_depth or not k.startswith("mtp.")}
    hf_sd = hf.to_hf_state_dict(cfg, our_sd)
    with no_init_weights():                                      # weights come from hf_sd
        hf_model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    hf_model.load_state_dict(hf_sd, strict=True)
    out_dir = Path(out_dir)
    log(f"writing {out_dir}")
    out_dir.mkdir(parents=True, exist_ok=True)
    hf_model.save_pretrained(str(out_dir), safe_serialization=True)
    if cfg.mtp_depth:
        _add_tensors(out_dir, hf_deepseek.mtp_to_files(cfg, our_sd))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out_dir))
    return hf_model


def _add_tensors(out_dir: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Add ``tensors`` to the safetensors ``save_pretrained`` wrote: into the single file, or as
    one more shard listed in the index."""
    index = out_dir / "model.safetensors.index.json"
    if index.is_file():
        name = "model-mtp.safetensors"
        save_file(tensors, str(out_dir / name), metadata={"format": "pt"})
        data = json.loads(index.read_text())
        data["weight_map"].update({k: name for k in tensors})
        index.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        return
    path = out_dir / "model.safetensors"
    save_file({**load_file(str(path)), **tensors}, str(path), metadata={"format": "pt"})


def _mtp_tensors(hf_dir: Path, layers: int, depth: int) -> dict[str, torch.Tensor]:
    """The tensors of DeepSeek's MTP layers (``model.layers.<layers>`` on) in ``hf_dir``'s
    safetensors files, which transformers does not load."""
    prefixes = tuple(f"model.layers.{layers + k}." for k in range(depth))
    out = {}
    for path in sorted(hf_dir.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():
                if key.startswith(prefixes):
                    out[key] = f.get_tensor(key)
    return out


def verify_export(model, out_dir: Path, num_tokens: int = 16) -> float:
    """Reload ``out_dir`` with the Auto classes; max |logit difference| to ``model`` on random ids."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_model = AutoModelForCausalLM.from_pretrained(str(out_dir), local_files_only=True).eval()
    if any(Path(out_dir, f).is_file() for f in _TOKENIZER_FILES):
        AutoTokenizer.from_pretrained(str(out_dir), local_files_only=True)
    cfg = model.cfg
    ids = torch.randint(0, cfg.vocab_size, (1, min(num_tokens, cfg.max_seq_len)),
                        generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model.eval()(ids.to(next(model.parameters()).device)).logits.float().cpu()
        theirs = hf_model(ids).logits.float()
    return (ours - theirs).abs().max().item()


# --------------------------------------------------------------------------- import

def read_hf_dir(hf_dir: Path):
    """Read a local transformers Llama/Mixtral/Qwen2-MoE/Qwen3-MoE folder.

    Returns:
        (HF config, HF state dict in transformers' in-memory layout, tokenizer or None)
    """
    from transformers import AutoConfig, AutoTokenizer

    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise FileNotFoundError(f"--hf {hf_dir}: no such directory; fix: pass a local folder "
                                f"written by save_pretrained (nothing is downloaded)")
    config_path = hf_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"--hf {hf_dir}: no config.json; fix: pass a transformers "
                                f"checkpoint folder (config.json + *.safetensors)")
    raw = json.loads(config_path.read_text())
    model_type = raw.get("model_type")
    if model_type not in hf.HF_MODEL_TYPES:
        archs = "/".join(raw.get("architectures") or []) or "unknown architecture"
        raise ValueError(f"--hf {hf_dir}: model_type {model_type!r} ({archs}) is not supported; "
                         f"convert_hf imports {hf.SUPPORTED} only")
    hf_config = AutoConfig.from_pretrained(str(hf_dir), local_files_only=True)
    state_dict = _read_weights(hf_dir, hf_config)
    tokenizer = None
    if any((hf_dir / f).is_file() for f in _TOKENIZER_FILES):
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(hf_dir), local_files_only=True)
        except (OSError, ValueError, ImportError) as e:
            raise ValueError(f"--hf {hf_dir}: has tokenizer files but transformers cannot load "
                             f"them ({e}); fix: repair or remove them") from e
    return hf_config, state_dict, tokenizer


def _read_weights(hf_dir: Path, hf_config) -> dict[str, torch.Tensor]:
    """The checkpoint's weights in transformers' in-memory names and layout, as its own
    ``from_pretrained`` reads them (single or sharded safetensors, else pytorch_model.bin; the
    per-expert Mixtral files fused), in the stored dtype."""
    from transformers import AutoModelForCausalLM

    if not any((hf_dir / name).is_file() for name in _WEIGHT_FILES):
        raise FileNotFoundError(f"--hf {hf_dir}: no model.safetensors, model.safetensors.index.json "
                                f"or pytorch_model.bin; fix: save the model with save_pretrained")
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            str(hf_dir), config=hf_config, dtype="auto", local_files_only=True,
            output_loading_info=True)
    except OSError as e:                # a weight shard listed in the index is missing, ...
        first = (str(e).strip().splitlines() or [""])[0]
        raise FileNotFoundError(f"--hf {hf_dir}: cannot read the weights ({first})") from None
    # from_pretrained initializes what the files lack; the conversion must not see those.
    missing = sorted(info["missing_keys"]) + sorted(k for k, *_ in info["mismatched_keys"])
    if missing:
        raise ValueError(f"--hf {hf_dir}: the weights lack or mis-shape {missing[:5]}"
                         f"{' ...' if len(missing) > 5 else ''}; fix: re-save the model with "
                         f"save_pretrained")
    return model.state_dict()


def import_hf(hf_dir: Path, out_dir: Path):
    """Convert a local HF Llama/Mixtral/Qwen-MoE folder into an init dir for ``train.py --init-from``.

    Returns:
        Our config of the imported model.
    """
    log(f"loading {hf_dir}")
    hf_config, hf_sd, tokenizer = read_hf_dir(Path(hf_dir))
    cfg = hf.from_hf_config(hf_config)
    interleave = getattr(hf_config, "rope_interleave", False)
    our_sd = hf.from_hf_state_dict(cfg, hf_sd, interleave)
    depth = getattr(hf_config, "num_nextn_predict_layers", 0) or 0
    mtp = _mtp_tensors(Path(hf_dir), cfg.num_layers, depth) if cfg.mla and depth else {}
    if mtp:                                   # DeepSeek's multi-token prediction modules
        cfg = dataclasses.replace(cfg, mtp_depth=depth).validate()
        our_sd.update(hf_deepseek.mtp_from_files(cfg, mtp, interleave))
    elif depth and cfg.mla:
        log(f"config.json num_nextn_predict_layers is {depth} but the files hold no MTP layers: "
            f"importing without MTP")
    log(f"converting {hf_config.model_type} -> family {cfg.family} "
        f"({cfg.num_params() / 1e6:.1f}M parameters)")
    log(f"writing {out_dir}" + ("" if tokenizer is not None else " (no tokenizer in --hf)"))
    hf.save_init_dir(Path(out_dir), cfg, our_sd, tokenizer)
    return cfg


def clear_init_dir(out_dir: Path) -> None:
    """Remove the files an earlier import wrote, so a stale tokenizer cannot survive --force."""
    import shutil

    for name in (hf.INIT_CONFIG_FILE, hf.INIT_WEIGHTS_FILE):
        (out_dir / name).unlink(missing_ok=True)
    shutil.rmtree(out_dir / hf.INIT_TOKENIZER_DIR, ignore_errors=True)
