"""Router analysis of a trained MoE run over a text file, at one or several checkpoints.

    python launch/analyze_router.py --run-dir DIR --text-file F --out OUT [--checkpoints all] [--max-tokens N]

Loads each chosen checkpoint offline on one process (every layout ``launch/evaluate.py``
reads), tokenizes the text with the run's tokenizer (EOS appended), runs the model in eval
mode over windows of the run's sequence length, the run's micro-batch per forward, and writes
``OUT/router_report.json`` (per MoE layer: tokens per expert, load max/mean, router and load
entropy, dropped fraction at the train and eval capacity factors, expert co-selection, token
and token-class specialization, collapsed experts and layers; see ``analysis/router_report.py``) and
the PNG plots of ``analysis/router_plots.py``, then prints their paths. ``--checkpoints``:
``latest`` (default), ``all`` (one report entry per checkpoint, oldest first), or a comma list
of tags or steps (``step00000100,200``). Bad input is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run-dir", required=True, help="an MoE run directory of launch/train.py")
    p.add_argument("--text-file", required=True, help="UTF-8 text to route")
    p.add_argument("--out", required=True, help="folder for router_report.json and the PNGs")
    p.add_argument("--checkpoints", default="latest",
                   help="latest (default), all, or a comma list of tags or step numbers")
    p.add_argument("--max-tokens", type=int, default=65536,
                   help="route at most this many tokens of the text (default 65536)")
    return p.parse_args(argv)


def prepare(args: argparse.Namespace) -> dict:
    """Every check that needs no model: ValueError (one line, naming the fix) on bad input."""
    from model.config import config_from_dict
    from training.checkpoint.layout import read_run_config
    from analysis.router_report import select_checkpoints

    run_dir, text_file = Path(args.run_dir), Path(args.text_file)
    if not run_dir.is_dir():
        raise ValueError(f"--run-dir {run_dir}: no such directory (pass a run directory "
                         f"written by launch/train.py)")
    resolved = read_run_config(run_dir)
    cfg = config_from_dict(resolved["recipe"]["model"])
    if cfg.num_moe_layers == 0:
        raise ValueError(f"--run-dir {run_dir}: a {cfg.family} run has no router; pass an MoE "
                         f"run (model.family switch or mixtral)")
    if not text_file.is_file():
        raise ValueError(f"--text-file {text_file}: file not found (pass a UTF-8 text file)")
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens: {args.max_tokens} must be >= 1")
    text = text_file.read_bytes().decode("utf-8", errors="replace")
    if not text.strip():
        raise ValueError(f"--text-file {text_file}: the file is empty (pass a text to route)")
    tags = select_checkpoints(run_dir / "checkpoints", args.checkpoints)
    return {"run_dir": run_dir, "resolved": resolved, "cfg": cfg, "text": text, "tags": tags}


def analyze(args: argparse.Namespace, job: dict) -> list[dict]:
    """One report entry per checkpoint of ``job["tags"]``, oldest first."""
    from analysis import router_report as router
    from interop.consolidate import load_run_model
    from training.config.recipe import recipe_from_dict
    from training.data.batches import encode_texts

    resolved, cfg = job["resolved"], job["cfg"]
    seq_len = recipe_from_dict(resolved["recipe"]).seq_len
    batch = int(resolved["ds_config"].get("train_micro_batch_size_per_gpu", 1))
    ep = int(resolved.get("world", {}).get("expert_parallel_size", 1))
    job["layout"] = {"seq_len": seq_len, "windows_per_forward": batch, "expert_parallel_size": ep}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    entries, vocab, batches = [], None, None
    for tag in job["tags"]:
        model, _, tokenizer = load_run_model(job["run_dir"], tag)
        if batches is None:
            ids = encode_texts([job["text"]], tokenizer)[:args.max_tokens]
            batches = router.windows(torch.as_tensor(ids.astype("int64")), seq_len, batch)
            vocab = router.vocabulary(tokenizer, cfg.vocab_size)
        result = router.analyze_model(model, batches, vocab, ep, device)
        entries.append({"tag": tag, "step": router.step_of(tag), **result})
        loads = ", ".join(f"{L['load_max_over_mean']:.2f}" for L in result["layers"])
        print(f"{tag}: {result['tokens']} tokens, load max/mean per MoE layer {loads}",
              file=sys.stderr)
    return entries


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        # stdout carries only the written paths: DeepSpeed's import-time logs go to stderr.
        with contextlib.redirect_stdout(sys.stderr):
            job = prepare(args)
            entries = analyze(args, job)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    cfg, moe = job["cfg"], job["cfg"].moe
    meta = {"run_dir": str(args.run_dir), "text_file": str(args.text_file), "family": cfg.family,
            "num_experts": moe.num_experts, "top_k": moe.top_k,
            "capacity_factor": {"train": moe.capacity_factor, "eval": moe.eval_capacity_factor},
            **job["layout"], "max_tokens": args.max_tokens}
    from analysis import router_plots, router_report as router
    report = router.report(meta, entries)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "router_report.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    print(out / "router_report.json")
    for name in router_plots.plot_all(report, out):
        print(out / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
