"""The same command with glibc's default malloc thresholds and with the ones ``.ci/run`` and
``launch/cpu_local.sh`` set: wall, user and system seconds, alternating runs (CPU).

    python -m benchmarks.systems.cpu_allocator                          # the quick start in fp32, 40 steps
    python -m benchmarks.systems.cpu_allocator --pairs 3 -- python -m pytest -q tests/parallel/test_train_layouts.py

glibc returns a freed block larger than its mmap threshold (32 MiB at most, adjusted as it goes)
to the kernel at once and trims the heap above 128 KiB, so a training step that frees and
allocates the same large tensors every step page-faults them in again: system time, not user
time. ``MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=68719476736`` keep such
blocks in the process (glibc reads both at start-up; a fixed mmap threshold also stops its
adjustment). Runs alternate (default first, then tuned) so that drift in the machine's load
falls on both; each row is one run's wall clock and its children's CPU seconds. The ratio is
of medians. GPUs are unaffected (their tensors live in the caching allocator).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TUNED = {"MALLOC_MMAP_THRESHOLD_": "4294967296", "MALLOC_TRIM_THRESHOLD_": "68719476736"}


def default_command(run_dir: str) -> list[str]:
    return [sys.executable, "launch/train.py", "--config", "ds_configs/zero3_fp32.json",
            "--run-dir", run_dir, "--steps", "40", "--set", "eval.every=0", "train.save_every=100000"]


def run_once(cmd: list[str], tuned: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in TUNED}
    env.update({"WANDB_MODE": "offline", "WANDB_SILENT": "true", **(TUNED if tuned else {})})
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True, timeout=3600)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr[-1500:]}")
    return {"wall": wall, "user": after.ru_utime - before.ru_utime, "sys": after.ru_stime - before.ru_stime}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=3, help="runs of each setting, alternating")
    p.add_argument("command", nargs="*", help="the command (after --); default: the fp32 quick start, 40 steps")
    args = p.parse_args(argv)
    rows = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.pairs):
            for tuned in (False, True):
                cmd = args.command or default_command(str(Path(tmp) / f"run-{i}-{int(tuned)}"))
                r = run_once(cmd, tuned)
                rows[tuned].append(r)
                print(f"pair {i + 1}/{args.pairs} {'tuned  ' if tuned else 'default'}: wall {r['wall']:.1f} s, "
                      f"user {r['user']:.1f} s, sys {r['sys']:.1f} s", file=sys.stderr, flush=True)
    print(f"# {time.strftime('%Y-%m-%d %H:%M')}  {args.pairs} pairs, alternating; command: "
          f"{' '.join(args.command) or 'python launch/train.py --config ds_configs/zero3_fp32.json --steps 40'}")
    print("| malloc | wall (s), median [min-max] | user (s), median | sys (s), median |\n|---|---|---|---|")
    med = {}
    for tuned, label in ((False, "glibc defaults"), (True, "MALLOC_MMAP_THRESHOLD_ + MALLOC_TRIM_THRESHOLD_")):
        walls = [r["wall"] for r in rows[tuned]]
        med[tuned] = {k: statistics.median(r[k] for r in rows[tuned]) for k in ("wall", "user", "sys")}
        print(f"| {label} | {med[tuned]['wall']:.1f} [{min(walls):.1f}-{max(walls):.1f}] | "
              f"{med[tuned]['user']:.1f} | {med[tuned]['sys']:.1f} |")
    print(f"| tuned / default | {med[True]['wall'] / med[False]['wall']:.2f}x | "
          f"{med[True]['user'] / med[False]['user']:.2f}x | {med[True]['sys'] / max(med[False]['sys'], 1e-9):.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
