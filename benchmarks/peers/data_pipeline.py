"""Offline data preparation (``launch/prepare_data.py``): throughput by worker count, against HF
``datasets``' ``map(num_proc=2)`` with the same tokenizer, and peak memory at two corpus sizes.

    python -m benchmarks.peers.data_pipeline                      # ~30 MB and ~300 MB corpora (minutes)
    python -m benchmarks.peers.data_pipeline --sizes-mb 3 30      # quicker

Makes its own corpora from text on this machine: the Python standard library's and site-packages'
``.py``/``.md``/``.txt``/``.rst`` files (up to 500 KB), one JSON-lines document per file, the
first ``--sizes-mb`` smallest size of them repeated to each size. One pool for every size, so the
longest document is the same in all: a worker's peak memory follows the longest document it
encodes (measured here: about 30 MB more on a document of 130,000 tokens), so the comparison is
about the corpus size alone. Trains
a byte-level BPE (``--vocab-size``) on a sample with the preparation's own tokenizer step. Every
measurement is a fresh process (interpreter start-up excluded from the times, worker start-up
included), with the whole process tree's resident memory (the sum of RSS over the process and its
workers) sampled every 0.1 s. Prints one table:

- preparation MB/s (input bytes on disk / the shards' seconds, from their ``.json``; the one-off
  start-up, mostly importing transformers, in a row of its own) of the smaller corpus at 1 and 2
  workers (each worker's Rust encoder single-threaded), and at 1 worker with its threads on;
- the same file through HF datasets: ``load_dataset("json")`` then ``map(num_proc=2)`` with the
  same tokenizer (its default thread settings), the load and the map timed together;
- peak resident memory of preparation at 2 workers for every size.

``measure_trainer`` is where the trainer's figures on the same prepared data are added (peak
resident memory per rank, time from launch to the first step).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

_SUFFIXES = (".py", ".md", ".txt", ".rst")
MAX_DOCUMENT_BYTES = 500_000


def make_corpus(path: Path, target_bytes: int, pool_bytes: int) -> int:
    """Writes about ``target_bytes`` of JSON lines, one document per text file, from a pool of the
    first ``pool_bytes`` of files (sorted paths) repeated; returns the file's size. Never holds
    more than one document in memory."""
    roots = sorted({sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"]})
    pool, size = [], 0
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for f in sorted(filenames):
                f = Path(dirpath, f)
                if f.suffix in _SUFFIXES and 0 < f.stat().st_size <= MAX_DOCUMENT_BYTES and size < pool_bytes:
                    pool.append(f)
                    size += f.stat().st_size
    path.parent.mkdir(parents=True, exist_ok=True)
    written = 0
    with path.open("w") as out:
        while written < target_bytes:
            for f in pool:
                line = json.dumps({"text": f.read_bytes().decode("utf-8", errors="replace")}) + "\n"
                out.write(line)
                written += len(line.encode())
                if written >= target_bytes:
                    break
    return path.stat().st_size


def _tree_rss(pid: int) -> int:
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def run_measured(args: list[str], env: dict) -> dict:
    """Runs this file with ``args`` in a fresh process with environment ``env``; returns its JSON
    line plus the peak RSS of its process tree."""
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.peers.data_pipeline", *args], stdout=subprocess.PIPE, text=True, env=env)
    peak, done = [0], threading.Event()

    def sample():
        while not done.wait(0.1):
            peak[0] = max(peak[0], _tree_rss(proc.pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, _ = proc.communicate(timeout=3600)
    done.set()
    sampler.join()
    if proc.returncode != 0:
        raise SystemExit(f"measurement {args} failed with exit code {proc.returncode}")
    return {**json.loads(out.strip().splitlines()[-1]), "peak_rss": peak[0]}


def _child_prepare(corpus: str, out: str, tokenizer: str, workers: int, rust_threads: bool) -> dict:
    from data_pipeline import encoder
    from data_pipeline.prepare import prepare_dataset

    if rust_threads:                 # let the in-process encoder use the Rust thread pool
        import contextlib

        encoder._single_threaded = contextlib.nullcontext
    start = time.perf_counter()
    prefix = prepare_dataset([corpus], out, tokenizer, workers=workers, progress=False)
    seconds = time.perf_counter() - start
    # The shards' own times: reading, tokenizing and writing, without the one-off start-up
    # (importing transformers to load the tokenizer, about 4 s here).
    shard_seconds = sum(json.loads(p.read_text())["seconds"] for p in prefix.parent.glob(f"{prefix.name}-*.json"))
    return {"seconds": seconds, "shard_seconds": shard_seconds}


def _child_hf(corpus: str, cache: str, tokenizer_dir: str, num_proc: int) -> dict:
    import datasets
    from transformers import AutoTokenizer

    datasets.disable_progress_bars()
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    start = time.perf_counter()
    ds = datasets.load_dataset("json", data_files=corpus, split="train", cache_dir=cache)
    ds.map(lambda b: tok(b["text"], add_special_tokens=False), batched=True, num_proc=num_proc,
           remove_columns=["text"])
    return {"seconds": time.perf_counter() - start}


def _anon_rss(pid: int) -> int:
    """Anonymous resident bytes of one process (its heap, not the mapped files' pages)."""
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _train_once(prefix: Path, tokenizer: Path, run_dir: Path, steps: int) -> dict:
    """``launch/train.py`` on 2 gloo ranks over ``prefix``: the peak anonymous memory of each rank
    (sampled every 0.1 s) and the seconds from the launch to the first metrics row."""
    import psutil

    sets = ["model.hidden_size=64", "model.num_layers=2", "model.ffn_hidden_size=64", "model.max_seq_len=128",
            "model.vocab_size=32768", f"data.source=[{prefix}]", f"tokenizer.path={tokenizer}", "eval.every=0",
            "train.log_every=1", "train.save_every=100000"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "launch/train.py", "--config", "ds_configs/zero1_fp32.json", "--run-dir", str(run_dir),
           "--steps", str(steps), "--set", *sets]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peaks, first_row, metrics = {}, None, run_dir / "metrics.jsonl"
    already = metrics.read_text().count('"loss"') if metrics.is_file() else 0
    while proc.poll() is None:
        try:
            ranks = [c for c in psutil.Process(proc.pid).children(recursive=True) if "train.py" in " ".join(c.cmdline())]
        except psutil.Error:
            ranks = []
        for r in ranks:
            peaks[r.pid] = max(peaks.get(r.pid, 0), _anon_rss(r.pid))
        if first_row is None and metrics.is_file() and metrics.read_text().count('"loss"') > already:
            first_row = time.perf_counter() - start
        time.sleep(0.1)
    if proc.returncode != 0:
        raise SystemExit(f"the trainer failed on {prefix}: {proc.stderr.read()[-2000:]}")
    return {"peak_anon": max(peaks.values()), "first_step_s": first_row, "ranks": len(peaks)}


def measure_trainer(prepared: dict[int, Path], tokenizer: Path) -> list[tuple[str, str]]:
    """The trainer on each prepared dataset (``prepared`` maps the corpus size in MB to its
    prefix), 2 gloo ranks, a tiny model, 3 steps: peak anonymous memory per rank (the
    memory-mapped shards' pages are the kernel's page cache, not the rank's) and the time from
    the launch to the first step; then a warm restart of the largest (the same command resumed
    for 3 more steps: nothing is tokenized, parsed or hashed again, its shards untouched)."""
    rows, results = [], {}
    work = next(iter(prepared.values())).parent.parent
    for mb, prefix in sorted(prepared.items()):
        run_dir = work / f"train_{mb}mb"
        import shutil
        shutil.rmtree(run_dir, ignore_errors=True)
        results[mb] = _train_once(prefix, tokenizer, run_dir, 3)
        rows.append((f"trainer on {mb} MB prepared, 2 ranks: peak anonymous memory per rank",
                     f"{results[mb]['peak_anon'] / 1e6:.0f} MB"))
        rows.append((f"trainer on {mb} MB prepared: launch to first step", f"{results[mb]['first_step_s']:.1f} s"))
    sizes = sorted(prepared)
    if len(sizes) > 1:
        lo, hi = results[sizes[0]], results[sizes[-1]]
        rows.append((f"trainer peak memory per rank, {sizes[-1]} MB - {sizes[0]} MB",
                     f"{(hi['peak_anon'] - lo['peak_anon']) / 1e6:+.0f} MB (goal: within 50 MB)"))
        rows.append((f"trainer launch to first step, {sizes[-1]} MB - {sizes[0]} MB",
                     f"{hi['first_step_s'] - lo['first_step_s']:+.1f} s (goal: within 2 s)"))
    big = prepared[sizes[-1]]
    shards = sorted(big.parent.glob(f"{big.name}*"))
    before = {p: p.stat().st_mtime_ns for p in shards}
    warm = _train_once(big, tokenizer, work / f"train_{sizes[-1]}mb", 6)
    untouched = all(p.stat().st_mtime_ns == t for p, t in before.items())
    rows.append((f"warm restart on {sizes[-1]} MB: launch to first step", f"{warm['first_step_s']:.1f} s "
                 f"(resumed; {len(shards)} prepared files {'untouched' if untouched else 'MODIFIED'})"))
    return rows


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-mb", type=int, nargs="+", default=[30, 300], help="corpus sizes (MB)")
    p.add_argument("--work-dir", default="/tmp/data_pipeline_bench", help="corpora and outputs")
    p.add_argument("--vocab-size", type=int, default=32768)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        spec = json.loads(args.child)
        fn = _child_prepare if spec.pop("kind") == "prepare" else _child_hf
        print(json.dumps(fn(**spec)))
        return 0
    import shutil

    from data_pipeline.readers import sample_texts
    from data_pipeline.tokenizer import train_tokenizer

    work = Path(args.work_dir)
    shutil.rmtree(work / "out", ignore_errors=True)
    sizes, corpora = sorted(args.sizes_mb), {}
    started = time.perf_counter()
    print(f"# {time.strftime('%Y-%m-%d %H:%M')}  {_cpu()}  load before: {_load()}", flush=True)
    for mb in sizes:
        corpora[mb] = work / f"corpus_{mb}MB.jsonl"
        if not corpora[mb].is_file() or corpora[mb].stat().st_size < mb * 1e6:
            make_corpus(corpora[mb], mb * 1_000_000, sizes[0] * 1_000_000)
    tok = work / f"tokenizer_{args.vocab_size}"
    if not tok.is_dir():
        train_tokenizer(sample_texts([str(corpora[sizes[0]])], "text", 8_000_000), args.vocab_size, tok)
    small = sizes[0]
    mb_small = corpora[small].stat().st_size / 1e6

    def prepare(mb: int, workers: int, rust_threads: bool = False) -> dict:
        spec = {"kind": "prepare", "corpus": str(corpora[mb]), "tokenizer": str(tok), "workers": workers,
                "out": str(work / "out" / f"{mb}mb_w{workers}{'_t' if rust_threads else ''}" / "c"),
                "rust_threads": rust_threads}
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "true"} if rust_threads else dict(os.environ)
        return run_measured(["--child", json.dumps(spec)], env)

    rows, results = [], {}
    results["w1"] = prepare(small, 1)
    results["w2"] = prepare(small, 2)
    results["w1t"] = prepare(small, 1, rust_threads=True)
    hf_spec = {"kind": "hf", "corpus": str(corpora[small]), "cache": str(work / "out" / "hf_cache"),
               "tokenizer_dir": str(tok), "num_proc": 2}
    # HF datasets as a user runs it: the tokenizers library's own thread default.
    hf_env = {k: v for k, v in os.environ.items() if k != "TOKENIZERS_PARALLELISM"}
    results["hf"] = run_measured(["--child", json.dumps(hf_spec)], hf_env)
    for mb in sizes[1:]:
        results[f"{mb}"] = prepare(mb, 2)
    results[f"{small}"] = results["w2"]

    # Ours: input MB / the shards' seconds (start-up in its own row); HF: load + map, no start-up.
    rate = {k: mb_small / results[k].get("shard_seconds", results[k]["seconds"])
            for k in ("w1", "w2", "w1t", "hf")}
    rows += [(f"prepare {mb_small:.0f} MB, 1 worker", f"{rate['w1']:.2f} MB/s"),
             (f"prepare {mb_small:.0f} MB, 2 workers", f"{rate['w2']:.2f} MB/s  ({rate['w2'] / rate['w1']:.2f}x "
                                                       "1 worker; goal >= 1.7x on an idle 2-core machine)"),
             (f"prepare {mb_small:.0f} MB, 1 worker, Rust encoder threads on", f"{rate['w1t']:.2f} MB/s"),
             (f"HF datasets load_dataset + map(num_proc=2), {mb_small:.0f} MB", f"{rate['hf']:.2f} MB/s  "
              f"(ours at 2 workers: {rate['w2'] / rate['hf']:.2f}x; goal >= 1.0x)")]
    startup = [r["seconds"] - r["shard_seconds"] for k, r in results.items() if "shard_seconds" in r]
    rows.append(("prepare: start-up before the first shard (tokenizer load, plan)",
                 f"{min(startup):.1f}-{max(startup):.1f} s"))
    for mb in sizes:
        r = results[f"{mb}"]
        mbytes = corpora[mb].stat().st_size / 1e6
        rows.append((f"prepare {mbytes:.0f} MB, 2 workers: peak RSS (process tree)",
                     f"{r['peak_rss'] / 1e6:.0f} MB  ({mbytes / r['shard_seconds']:.2f} MB/s)"))
    longest = ", ".join(f"{_largest_line(c) / 1e3:.0f} KB" for c in corpora.values())
    rows.append(("longest document (JSON line) per corpus", longest))
    if len(sizes) > 1:
        lo, hi = results[f"{sizes[0]}"]["peak_rss"], results[f"{sizes[-1]}"]["peak_rss"]
        rows.append((f"peak RSS {sizes[-1]} MB - {sizes[0]} MB", f"{(hi - lo) / 1e6:+.0f} MB (goal: within 100 MB)"))
    rows.append((f"HF datasets map(num_proc=2), {mb_small:.0f} MB: peak RSS", f"{results['hf']['peak_rss'] / 1e6:.0f} MB"))
    prefixes = {mb: work / "out" / f"{mb}mb_w2" / "c_text_document" for mb in sizes}
    rows += measure_trainer(prefixes, tok)
    width = max(len(r[0]) for r in rows)
    print(f"| {'measurement':<{width}} | value |\n|{'-' * (width + 2)}|-------|")
    for label, value in rows:
        print(f"| {label:<{width}} | {value} |")
    print(f"# load after: {_load()}; {time.perf_counter() - started:.0f} s in all; "
          f"tokenizer: {tok} ({args.vocab_size} requested)", flush=True)
    return 0


def _largest_line(path: Path) -> int:
    with path.open("rb") as f:
        return max(len(line) for line in f)


def _cpu() -> str:
    try:
        model = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        model = "unknown CPU"
    return f"{model}, {os.cpu_count()} cores"


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


if __name__ == "__main__":
    sys.exit(main())
