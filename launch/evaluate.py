"""Mean next-token cross-entropy of a trained run's model over a text file.

    python launch/evaluate.py --run-dir DIR --text-file F [--batch-size 8]

Prints one JSON object ``{"loss": ..., "tokens": ...}``: the text is tokenized with the run's
tokenizer (EOS appended), cut into consecutive windows of the run's training sequence length,
and the loss averaged over every predicted token. Runs on one process, on the GPU if there is one.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402


def evaluate_text(model, tokenizer, text: str, seq_len: int, batch_size: int = 8,
                  device: str = "cpu") -> dict:
    """Loss of ``model`` over ``text`` in windows of ``seq_len`` (see module docstring)."""
    from training.data import batches

    tokens = batches.encode_texts([text], tokenizer)
    layout = batches.BatchLayout(batch_size, batch_size)
    ce_sum, count = 0.0, 0
    model.to(device)
    with torch.no_grad():
        for input_ids, labels in batches.validation_batches(batches.text_windows(tokens, seq_len), layout):
            out = model(input_ids.to(device), labels.to(device))
            ce_sum += out.ce_sum.double().item()
            count += out.num_target_tokens.item()
    return {"loss": ce_sum / max(count, 1), "tokens": count}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run-dir", required=True, help="run directory written by launch/train.py")
    p.add_argument("--text-file", required=True, help="UTF-8 text file to evaluate on")
    p.add_argument("--batch-size", type=int, default=8, help="windows per forward pass")
    args = p.parse_args(argv)
    try:
        text_file = Path(args.text_file)
        if not text_file.is_file():
            raise ValueError(f"--text-file {text_file}: file not found")
        if args.batch_size < 1:
            raise ValueError(f"--batch-size: {args.batch_size} must be >= 1")
        from interop.consolidate import load_run_model
        from training.config.recipe import recipe_from_dict
        model, _, tokenizer = load_run_model(Path(args.run_dir))
        resolved = json.loads((Path(args.run_dir) / "config.json").read_text())
        seq_len = recipe_from_dict(resolved["recipe"]).seq_len
        text = text_file.read_bytes().decode("utf-8", errors="replace")
        if not text:
            raise ValueError(f"--text-file {text_file}: the file is empty")
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(json.dumps(evaluate_text(model, tokenizer, text, seq_len, args.batch_size, device)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
