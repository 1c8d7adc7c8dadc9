"""Document masking study: the same tokens trained with and without ``data.document_masking``,
on a corpus of short documents.

    python -m benchmarks.studies.document_masking_study [--steps 300] [--out runs/document_masking_study]
    # 2 CPU cores: about 6 min

1. The corpus: the functions and methods of the standard library's modules (``ast``), those of
   at most 512 bytes, shuffled (seed 0) so that packed neighbours are unrelated, one document
   per row of ``train.jsonl`` (``data.source`` takes it). The stdlib's files average about
   17 KB, far longer than a 128-token window; these documents average about 220 bytes, so
   most windows cross a boundary or more. Every 50th document goes to ``heldout.jsonl``
   instead, which no run trains on.
2. Two runs of ``recipes/tiny_dense.yaml`` on one process (``--config``, fp32 by default), the
   same seed, data order and tokenizer: ``data.document_masking`` false, then true. Only the
   attention (and the RoPE positions) differ.
3. Printed side by side: documents per window; the train loss (mean of the last 50 steps, the
   same batches); the trainer's eval loss (packed validation windows, each run with its own
   attention); the loss on held-out documents fed one at a time from their first token (what
   inference on one document sees: no packing, the same for both models); the median step
   time; and the forward + backward time of the model alone at 128 and 1,024 tokens, with
   and without the mask (the kernel cost at a longer window).

The corpus and the runs go to ``--out`` (which must not exist); ``document_masking.json`` (the
header, the table's figures, per run) to ``--results`` (default ``benchmarks/studies/results/``).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import datetime
import json
import os
import platform
import random
import statistics
import sys
import sysconfig
import textwrap
import time
from pathlib import Path

from benchmarks import results_dir
from benchmarks.studies.upcycling_study import run  # the studies' subprocess runner

REPO = Path(__file__).resolve().parents[2]

RECIPE = "recipes/tiny_dense.yaml"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=REPO / "runs" / "document_masking_study",
                   help="where the corpus and the runs go (must not exist)")
    p.add_argument("--results", type=Path, default=results_dir("studies"), metavar="DIR",
                   help="folder for document_masking.json (default: benchmarks/studies/results)")
    p.add_argument("--config", default="ds_configs/zero2_fp32.json", help="DeepSpeed JSON of both runs")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seed", type=int, default=None, help="train.seed of both runs (default: the recipe's)")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--corpus-bytes", type=int, default=4_000_000,
                   help="bytes of documents in train.jsonl (the recipe reads at most data.max_bytes)")
    return p.parse_args(argv)


def short_documents(limit: int, max_doc_bytes: int = 512) -> tuple[list[str], list[str]]:
    """(train, held-out) texts: the functions and methods of the stdlib's modules of at most
    ``max_doc_bytes``, from modules in a shuffled order until ``limit`` bytes, shuffled."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if not {"site-packages", "dist-packages"} & set(p.parts))
    random.Random(0).shuffle(files)
    docs, size = [], 0
    for path in files:
        try:
            src = path.read_text(encoding="utf-8")
            tree = ast.parse(src)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue            # a few test files are deliberately broken or not UTF-8
        lines = src.splitlines(keepends=True)   # (ast.get_source_segment re-splits per call)
        for node in tree.body:
            body = node.body if isinstance(node, ast.ClassDef) else [node]
            for fn in body:
                if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    text = textwrap.dedent("".join(lines[fn.lineno - 1:fn.end_lineno]))
                    if len(text.encode()) <= max_doc_bytes:
                        docs.append(text)
                        size += len(text.encode())
        if size > limit * 1.03:                 # the held-out share (1/50) on top
            break
    random.Random(0).shuffle(docs)
    heldout, train, size = docs[::50][:1000], [], 0
    for i, text in enumerate(docs):
        if i % 50 and size < limit:
            train.append(text)
            size += len(text.encode())
    return train, heldout


def write_jsonl(path: Path, texts: list[str]) -> None:
    with path.open("w") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")


def train(args, run_dir: Path, corpus: Path, masking: bool) -> None:
    cmd = [sys.executable, "launch/train.py", "--config", args.config, "--recipe", RECIPE,
           "--run-dir", str(run_dir), "--steps", str(args.steps), "--set",
           f"data.source=[{corpus}]", f"data.document_masking={str(masking).lower()}",
           f"eval.every={args.eval_every}", f"train.save_every={args.steps}",
           *([f"train.seed={args.seed}"] if args.seed is not None else [])]
    print(f"  masking {masking}:", file=sys.stderr, flush=True)
    run(cmd, run_dir.parent / f"{run_dir.name}.log")      # one thread, W&B off, exit on failure


def heldout_loss(run_dir: Path, texts: list[str], seq_len: int) -> tuple[float, float]:
    """(mean next-token loss over held-out documents fed one at a time, mean tokens per
    document with its EOS): each document from its first token, cut at ``seq_len`` + 1."""
    import torch
    from interop.consolidate import load_run_model
    model, _, tokenizer = load_run_model(run_dir)
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    total, count = 0.0, 0
    with torch.no_grad():
        for ids in encoded:
            ids = torch.tensor([(ids + [tokenizer.eos_token_id])[:seq_len + 1]])
            out = model(ids[:, :-1], ids[:, 1:])
            total, count = total + out.ce_sum.item(), count + out.num_target_tokens.item()
    return total / count, sum(len(ids) + 1 for ids in encoded) / len(encoded)


def kernel_cost(seq_lens=(128, 1024), doc_len: int = 40, reps: int = 7) -> dict:
    """Median forward + backward seconds of the recipe's model on a (8, S) batch with a
    separator every ``doc_len`` tokens, masking off and on, interleaved."""
    import torch
    from model import Transformer
    from training.config.recipe import load_recipe
    out = {}
    for S in seq_lens:
        cfg = dataclasses.replace(load_recipe(RECIPE).model, max_seq_len=S)
        ids = torch.randint(1, cfg.vocab_size, (8, S), generator=torch.Generator().manual_seed(0))
        ids[:, doc_len - 1::doc_len] = 0
        models = {m: Transformer(dataclasses.replace(cfg, document_separator_id=0 if m else None))
                  for m in (False, True)}
        times = {False: [], True: []}
        for _ in range(reps):
            for m, model in models.items():
                t0 = time.perf_counter()
                model(ids, ids).ce_sum.backward()
                times[m].append(time.perf_counter() - t0)
        out[S] = {str(m).lower(): statistics.median(t[1:]) for m, t in times.items()}
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.out.exists():
        print(f"error: --out {args.out} exists; choose a new directory or delete it", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True)
    from analysis import run_plots
    from training.config.recipe import load_recipe
    seq_len = load_recipe(RECIPE).seq_len
    started = datetime.datetime.now().isoformat(timespec="seconds")
    load_before = os.getloadavg()
    train_docs, heldout = short_documents(args.corpus_bytes)
    corpus = args.out / "train.jsonl"
    write_jsonl(corpus, train_docs)
    write_jsonl(args.out / "heldout.jsonl", heldout)
    mean_bytes = sum(len(t.encode()) for t in train_docs) / len(train_docs)
    print(f"corpus: {len(train_docs)} documents, {mean_bytes:.0f} bytes each on average; "
          f"{len(heldout)} held out", file=sys.stderr)
    results = {}
    for masking in (False, True):
        run_dir = args.out / f"masking_{str(masking).lower()}"
        train(args, run_dir, corpus, masking)
        rows, evals = run_plots.read_metrics(run_dir)
        loss, doc_tokens = heldout_loss(run_dir, heldout, seq_len)
        results[str(masking).lower()] = {
            "train_loss_last50": statistics.mean(r["loss"] for r in rows[-50:]),
            "eval_loss": {r["step"]: r["eval_loss"] for r in evals},
            "heldout_alone_loss": loss, "heldout_tokens_per_doc": doc_tokens,
            "median_step_s": statistics.median(r["step_time_s"] for r in rows[10:]),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows[10:])}
    costs = kernel_cost()
    off, on = results["false"], results["true"]
    lines = ["| | masking off | masking on | on - off |", "|---|---:|---:|---:|",
             f"| documents per {seq_len}-token window (held-out mean) | "
             f"{seq_len / off['heldout_tokens_per_doc']:.2f} | the same | |"]

    def row(name, a, b, fmt=".4f"):
        lines.append(f"| {name} | {a:{fmt}} | {b:{fmt}} | {b - a:+{fmt}} |")
    row(f"train loss, mean of steps {max(1, args.steps - 49)}-{args.steps} (same batches)",
        off["train_loss_last50"], on["train_loss_last50"])
    for step in off["eval_loss"]:
        row(f"eval loss at {step} (packed windows, own attention)", off["eval_loss"][step],
            on["eval_loss"][step])
    row("held-out documents alone, from their first token", off["heldout_alone_loss"],
        on["heldout_alone_loss"])
    row("median step time (s)", off["median_step_s"], on["median_step_s"], ".3f")
    for S, t in costs.items():
        row(f"forward + backward, batch 8 x {S} tokens (s)", t["false"], t["true"], ".4f")
    table = "\n".join(lines)
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    import torch
    seed = args.seed if args.seed is not None else "of the recipe"
    header = (f"{started}; {cpu}, {os.cpu_count()} cores; torch {torch.__version__}; "
              f"load average {load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after; "
              f"{RECIPE}, {args.config}, {args.steps} steps, seed {seed}")
    print(header)
    print(table)
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "document_masking.json").write_text(json.dumps(
        {"header": header, "documents": len(train_docs), "mean_bytes": mean_bytes,
         "runs": results, "kernel_cost_s": costs}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
