"""Prepare a corpus offline: tokenize it into Megatron's indexed-dataset format, sharded.

    python launch/prepare_data.py --input 'data/*.jsonl' --output-prefix data/my \\
        --tokenizer TOKENIZER_DIR [--json-keys text] [--workers N] [--append-eod] [--shard i/K]
    python launch/prepare_data.py --input 'data/*.jsonl' --train-tokenizer TOKENIZER_DIR \\
        --vocab-size 32768 [--sample-bytes 100000000] [--output-prefix data/my ...]

Writes ``{output-prefix}_{key}_document-{i:05d}-of-{N:05d}.bin/.idx/.json`` per input shard and
``{output-prefix}_{key}_document.manifest.json``; ``data.source`` takes that prefix. Inputs: .txt
(one document per file), .jsonl / .json / .jsonl.gz / .jsonl.zst and .parquet (one per row),
directories and globs, ``hf:NAME[:SPLIT]`` (the local HF cache or a save_to_disk folder),
``hf-stream:NAME[:SPLIT]``, and ``stdlib``. A rerun skips finished shards; ``--shard i/K`` on K
machines splits the work (``launch/prepare_data_array.sbatch``). ``--train-tokenizer`` trains a
byte-level BPE on about ``--sample-bytes`` of the input, spread over all of it, into a new folder.
Bad input is one line on stderr and exit code 2. See ``data_pipeline/prepare.py``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def _shard(text: str) -> tuple[int, int]:
    try:
        i, k = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shard {text!r} is not i/K (e.g. 0/4)") from None
    return i, k


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, help="files, globs, directories, hf:NAME[:SPLIT], "
                   "hf-stream:NAME[:SPLIT] or stdlib")
    p.add_argument("--output-prefix", default=None, help="output path prefix (its folder is created)")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="text fields; one dataset each")
    p.add_argument("--workers", type=int, default=_cpus(), help="tokenizer processes (default: CPUs)")
    p.add_argument("--append-eod", action="store_true", help="append the EOS id after each document")
    p.add_argument("--tokenizer", default=None, help="an HF tokenizer folder (save_pretrained output)")
    p.add_argument("--train-tokenizer", default=None, metavar="OUT_DIR",
                   help="train a byte-level BPE on a sample of the input into this new folder")
    p.add_argument("--vocab-size", type=int, default=32768, help="BPE vocabulary for --train-tokenizer")
    p.add_argument("--sample-bytes", type=int, default=100_000_000,
                   help="input bytes to train the BPE on, spread over the whole input")
    p.add_argument("--shard", type=_shard, default=(0, 1), metavar="i/K",
                   help="prepare only the input shards j with j %% K == i (one of K machines)")
    p.add_argument("--max-bytes", type=int, default=None, help="keep only about this much input text")
    p.add_argument("--no-progress", action="store_true", help="log lines only, no progress bar")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    from data_pipeline.prepare import prepare_dataset
    from data_pipeline.readers import sample_texts

    try:
        if (args.tokenizer is None) == (args.train_tokenizer is None):
            raise ValueError("give exactly one of --tokenizer DIR and --train-tokenizer OUT_DIR; fix: "
                             "--tokenizer to use a tokenizer folder, --train-tokenizer to make one")
        if args.output_prefix is None and args.train_tokenizer is None:
            raise ValueError("--output-prefix is required to prepare data; fix: e.g. --output-prefix data/my")
        tokenizer = args.tokenizer
        if args.train_tokenizer is not None:
            from data_pipeline.tokenizer import check_new_dir, train_tokenizer

            check_new_dir(args.train_tokenizer)     # before reading a sample of the corpus
            texts = sample_texts(args.input, args.json_keys[0], args.sample_bytes)
            train_tokenizer(texts, args.vocab_size, args.train_tokenizer)
            tokenizer = args.train_tokenizer
            print(f"tokenizer: {tokenizer}")
        if args.output_prefix is not None:
            for key in args.json_keys:
                prefix = prepare_dataset(args.input, args.output_prefix, tokenizer, json_key=key,
                                         workers=args.workers, append_eod=args.append_eod,
                                         shard=args.shard, progress=not args.no_progress,
                                         max_bytes=args.max_bytes)
                print(f"prepared: {prefix} (data.source takes this prefix)")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (TimeoutError, RuntimeError) as e:   # the encoder's one line: a worker hung or died
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
