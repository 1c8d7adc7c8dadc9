"""A trained run's model on a text file, or on lm-evaluation-harness tasks.

    python launch/evaluate.py --run-dir DIR --text-file F [--batch-size 8]
    python launch/evaluate.py --run-dir DIR --tasks T1,T2 [--include-path P] [--limit N] [--num-fewshot K] [--tag TAG]

``--text-file``: prints one JSON object ``{"loss": ..., "tokens": ...}``: the text is tokenized
with the run's tokenizer (EOS appended), cut into consecutive windows of the run's training
sequence length, and the loss averaged over every predicted token.

``--tasks``: runs lm-evaluation-harness on the newest (or ``--tag``) checkpoint in memory
(``interop/harness.py``), prints lm-eval's table and writes its results (the dict
``simple_evaluate`` returns) to a new ``DIR/eval/lm_eval_<step>_<time>.json``. Runs on one
process, on the GPU if there is one.
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
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--text-file", help="UTF-8 text file to evaluate on")
    what.add_argument("--tasks", help="comma-separated lm-evaluation-harness tasks")
    p.add_argument("--include-path", help="folder of your own lm-eval task YAMLs (local data files)")
    p.add_argument("--limit", type=int, help="documents per task (default: all)")
    p.add_argument("--num-fewshot", type=int, help="few-shot examples (default: the task's)")
    p.add_argument("--tag", help="checkpoint folder under checkpoints/ (default: the newest)")
    p.add_argument("--batch-size", type=int, default=8, help="windows (sequences) per forward pass")
    args = p.parse_args(argv)
    if args.tasks is not None:
        return _tasks(args)
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


def _tasks(args) -> int:
    try:
        if args.limit is not None and args.limit < 1:
            raise ValueError(f"--limit: {args.limit} must be >= 1 (or left out for every document)")
        if args.batch_size < 1:
            raise ValueError(f"--batch-size: {args.batch_size} must be >= 1")
        tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
        if not tasks:
            raise ValueError("--tasks: name at least one task")
        if args.include_path and not Path(args.include_path).is_dir():
            raise ValueError(f"--include-path {args.include_path}: no such folder")
        from interop.consolidate import load_run_model
        from interop.harness import run_tasks, save_results
        from training.checkpoint.layout import latest_tag
        model, _, tokenizer = load_run_model(Path(args.run_dir), args.tag)
        tag = args.tag or latest_tag(Path(args.run_dir) / "checkpoints")
        model.to("cuda" if torch.cuda.is_available() else "cpu")
        results = run_tasks(model, tokenizer, tasks, args.include_path, args.limit, args.num_fewshot,
                            args.batch_size)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    from lm_eval.utils import make_table
    path = save_results(results, Path(args.run_dir) / "eval", int("".join(c for c in tag if c.isdigit()) or 0))
    print(make_table(results))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
