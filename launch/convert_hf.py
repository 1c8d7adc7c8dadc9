"""Convert between a run of this repo and a transformers (Hugging Face) checkpoint folder.

    python launch/convert_hf.py export --run-dir runs/dense --out hf/dense [--dtype bfloat16]
    python launch/convert_hf.py import --hf path/to/Llama-Mixtral-or-Qwen-MoE --out init/llama
    deepspeed launch/train.py --config ... --init-from init/llama

``export`` writes a folder that ``AutoModelForCausalLM`` / ``AutoTokenizer`` load: dense as
``LlamaForCausalLM``, mixtral as ``MixtralForCausalLM``, or ``Qwen3MoeForCausalLM`` with
``qk_norm``, ``Qwen2MoeForCausalLM`` with a gated shared expert (safetensors), with the same loss
on any text. ``import`` reads a local folder of any of the four and writes an init dir (see
``interop/hf.py``, ``interop/hf_qwen.py``). Nothing is downloaded. Bad input ends with one line on stderr and
exit code 2.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse  # noqa: E402

import torch  # noqa: E402

from interop.hf_files import clear_init_dir, export_hf, import_hf, log, verify_export  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _check_out_dir(out_dir: Path, force: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"--out {out_dir} is a file; fix: choose a directory path")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        raise ValueError(f"--out {out_dir} exists and is not empty; fix: choose a new directory "
                         f"or pass --force to overwrite")


# --------------------------------------------------------------------------- CLI

def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="convert_hf.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    exp = sub.add_parser("export", help="run dir -> transformers checkpoint folder")
    exp.add_argument("--run-dir", type=Path, required=True, help="run directory of launch/train.py")
    exp.add_argument("--out", type=Path, required=True, help="folder to write (HF format)")
    exp.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="saved weight dtype")
    exp.add_argument("--force", action="store_true", help="write into a non-empty --out")
    exp.add_argument("--drop-mtp", action="store_true",
                     help="leave the multi-token-prediction modules (model.mtp_depth) out of the export")
    exp.add_argument("--verify", action="store_true",
                     help="reload --out with AutoModelForCausalLM and print the max logit difference")
    imp = sub.add_parser("import", help="transformers checkpoint folder -> init dir for --init-from")
    imp.add_argument("--hf", type=Path, required=True,
                     help="local Llama/Mixtral/Qwen2-MoE/Qwen3-MoE/DeepSeek-V3 folder")
    imp.add_argument("--out", type=Path, required=True, help="init dir to write")
    imp.add_argument("--force", action="store_true", help="write into a non-empty --out")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        _check_out_dir(args.out, args.force)
        if args.command == "export":
            if not args.run_dir.is_dir():
                raise FileNotFoundError(f"--run-dir {args.run_dir}: no such directory")
            from interop.consolidate import load_run_model
            model, cfg, tokenizer = load_run_model(args.run_dir)
            log(f"loaded {args.run_dir}")         # after the checks: a bad --run-dir is one line
            export_hf(model, cfg, tokenizer, args.out, DTYPES[args.dtype], args.drop_mtp)
            if args.verify:
                log(f"verify: max |logit difference| vs our fp32 model {verify_export(model, args.out):.3g} "
                    f"(fp32: ~1e-6; bfloat16 weights: ~1e-2)")
        else:
            if args.force:
                clear_init_dir(args.out)
            import_hf(args.hf, args.out)
    except (ValueError, FileNotFoundError) as e:
        print(f"convert_hf.py {args.command}: error: {e}", file=sys.stderr)
        return 2
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
