"""A soak of random faults: every one survived, and every step's loss equal to the uninterrupted run.

    python -m benchmarks.reliability.fault_soak                                 # 20 faults on each layout
    python -m benchmarks.reliability.fault_soak --layouts dp2 --faults 3        # the short version CI runs

For each layout (2 gloo ranks under torchrun, the tiny Mixtral of the tests, fp32) it trains an
uninterrupted control run, then the same command again and again in a second run directory,
injecting one random fault per attempt at a random step a few steps past the attempt's resume
point, until ``--faults`` were injected; then once more to the end. The faults:

- ``kill_job``: SIGKILL of every process (a node lost, a scheduler's hard kill);
- ``kill_rank``: SIGKILL of one rank (a GPU error, the OOM killer): the survivor names it and
  exits 76 (``training/resilience/watchdog.py``);
- ``stop_rank``: SIGSTOP of one rank (a hung process) past the watchdog
  (``train.hang_timeout_s``): the live rank dumps its stacks, names it and exits 76;
- ``sigterm``: SIGTERM to every rank (a preemption): each finishes its step, saves it, exits 75;
- ``truncate_newest``: the job killed, then the largest file of its newest checkpoint cut in
  half: the rerun skips that checkpoint with a warning and resumes from the one before (chosen
  only once two checkpoints are published: with one, the rerun refuses, exit code 2).

A fault counts as survived when the attempt ended as documented for it (the exit codes the ranks
record in ``$TRAIN_EXIT_CODE_FILE``) and the next attempt resumed. At the end every step's loss is
compared with the control (relative ``RTOL``: the same processes and reduction order in fp32
make a resumed run the same computation). Steps recomputed: per fault, the last step logged
before it minus the step the next attempt resumed from. Prints one row per layout; exit code 1
if a fault was not survived or a loss differs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from training.run.spawn import free_port

REPO = Path(__file__).resolve().parents[2]
LAYOUTS = {            # name: (DeepSpeed JSON, recipe overrides)
    "dp2": ("ds_configs/zero1_fp32.json", []),
    "dp2-zero3": ("ds_configs/zero3_fp32.json", []),
    "tp2": ("ds_configs/zero1_fp32.json", ["parallel.tensor_parallel_size=2"]),
    "ep2": ("ds_configs/zero1_fp32.json", ["parallel.expert_parallel_size=2"]),
    "pp2": ("ds_configs/zero1_fp32.json", ["parallel.pipeline_parallel_size=2"]),
}
FAULTS = ("kill_job", "kill_rank", "stop_rank", "sigterm", "truncate_newest")
EXPECTED = {"kill_job": set(), "truncate_newest": set(), "kill_rank": {"76"},
            "stop_rank": {"76"}, "sigterm": {"75"}}          # the codes the ranks record
RTOL = 1e-6
HANG_TIMEOUT_S = 10
SMALL = ["model.hidden_size=64", "model.num_layers=2", "model.ffn_hidden_size=64",
         "model.max_seq_len=64", "data.seq_len=64", "data.max_bytes=1500000",
         "tokenizer.train_bytes=1500000", "model.moe.router_jitter=0.01", "eval.every=0",
         "train.log_every=5", "train.save_every=2", f"train.hang_timeout_s={HANG_TIMEOUT_S}",
         "tracking.wandb=false"]



class Run:
    """One run directory and the command that trains it."""

    def __init__(self, run_dir: Path, layout: str, steps: int):
        config, overrides = LAYOUTS[layout]
        self.run_dir, self.steps = run_dir, steps
        self.codes = run_dir.parent / f"{run_dir.name}.codes"
        self.args = ["launch/train.py", "--config", config, "--run-dir", str(run_dir),
                     "--steps", str(steps), "--set", *SMALL, *overrides]
        self.attempt = 0

    def start(self) -> tuple[subprocess.Popen, Path]:
        self.attempt += 1
        self.run_dir.parent.mkdir(parents=True, exist_ok=True)
        self.codes.unlink(missing_ok=True)
        log = self.run_dir.parent / f"{self.run_dir.name}.attempt{self.attempt}.log"
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", WANDB_MODE="disabled",
                   TRAIN_EXIT_CODE_FILE=str(self.codes), MALLOC_MMAP_THRESHOLD_="4294967296",
                   MALLOC_TRIM_THRESHOLD_="68719476736")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--master_port", str(free_port()), *self.args]
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=open(log, "w"),
                                stderr=subprocess.STDOUT, start_new_session=True)
        return proc, log

    def last_step(self) -> int:
        metrics = self.run_dir / "metrics.jsonl"
        steps = [json.loads(line).get("step", 0) for line in metrics.read_text().splitlines()
                 if '"loss"' in line] if metrics.is_file() else []
        return max(steps, default=0)

    def losses(self) -> dict[int, float]:
        metrics = self.run_dir / "metrics.jsonl"
        return {r["step"]: r["loss"] for r in map(json.loads, metrics.read_text().splitlines())
                if "loss" in r}

    def pids(self) -> dict[int, int]:
        out = {}
        for path in (self.run_dir / "heartbeats").glob("rank*.json"):
            try:
                beat = json.loads(path.read_text())
                out[beat["rank"]] = beat["pid"]
            except (OSError, ValueError, KeyError):
                pass
        return out

    def recorded_codes(self) -> set[str]:
        """The ranks' exit codes: the first word of each line ("CODE RANK [NOTE]")."""
        if not self.codes.is_file():
            return set()
        return {line.split()[0] for line in self.codes.read_text().splitlines() if line.strip()}


def _wait_for_step(run: Run, proc, step: int, timeout: float = 300) -> bool:
    """Until ``step`` is logged and every rank's heartbeat names this attempt's pid; False if the
    attempt ended first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        if run.last_step() >= step and len(run.pids()) == 2:
            return True
        time.sleep(0.02)
    raise TimeoutError(f"{run.run_dir}: step {step} not reached in {timeout:.0f} s")


def _kill(pid: int, signum) -> None:
    try:
        os.kill(pid, signum)
    except OSError:
        pass


def _kill_job(proc, run: Run) -> None:
    for pid in run.pids().values():
        _kill(pid, signal.SIGKILL)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    proc.wait()


def _verified(run: Run) -> list[Path]:
    """The published checkpoints (those with a manifest), oldest first."""
    ckpt = run.run_dir / "checkpoints"
    return sorted(p for p in ckpt.glob("step*") if (p / "manifest.json").is_file())


def _truncate_newest(run: Run) -> str | None:
    done = _verified(run)
    if len(done) < 2:
        return None
    largest = max((p for p in done[-1].rglob("*") if p.is_file() and p.name != "manifest.json"),
                  key=lambda p: p.stat().st_size)
    os.truncate(largest, largest.stat().st_size // 2)
    return done[-1].name


def _resumed_from(log: Path) -> int:
    match = re.search(r"resumed from \S*step(\d+)", log.read_text())
    return int(match.group(1)) if match else 0


def soak(layout: str, faults: int, steps: int, seed: int, work: Path, say) -> dict:
    t0 = time.monotonic()
    control = Run(work / layout / "control", layout, steps)
    proc, log = control.start()
    if proc.wait(timeout=900) != 0:
        raise RuntimeError(f"{layout}: the control run failed; see {log}")
    run, rng = Run(work / layout / "faulted", layout, steps), random.Random(f"{seed}-{layout}")
    tried, survived, recomputed, rc = [], 0, 0, None
    while True:
        shutil.rmtree(run.run_dir / "heartbeats", ignore_errors=True)   # this attempt's pids only
        proc, log = run.start()
        target = min(steps - 1, run.last_step() + rng.randint(1, 4))
        if len(tried) == faults or not _wait_for_step(run, proc, target):
            rc = proc.wait(timeout=900)            # the last attempt, or no room left for a fault
            if tried:
                recomputed += max(0, tried[-1]["last"] - _resumed_from(log))
            break
        if tried:
            recomputed += max(0, tried[-1]["last"] - _resumed_from(log))
        # Cutting the only verified checkpoint leaves nothing to resume from: the rerun refuses
        # (exit 2, as documented in checkpoints.md), so that fault waits for a second one.
        kinds = FAULTS if len(_verified(run)) >= 2 else tuple(f for f in FAULTS if f != "truncate_newest")
        fault, victim = rng.choice(kinds), rng.randrange(2)
        pids, t_fault = run.pids(), time.monotonic()
        if fault in ("kill_job", "truncate_newest"):
            _kill_job(proc, run)
        elif fault == "kill_rank":
            _kill(pids[victim], signal.SIGKILL)
        elif fault == "stop_rank":
            _kill(pids[victim], signal.SIGSTOP)
        else:
            for pid in pids.values():
                _kill(pid, signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        finally:
            for pid in pids.values():             # a stopped rank, if its peer did not kill it
                _kill(pid, signal.SIGKILL)
            _kill_job(proc, run)
        cut = _truncate_newest(run) if fault == "truncate_newest" else None
        codes = run.recorded_codes()
        ok = codes == EXPECTED[fault] or (fault == "kill_rank" and codes <= {"76"})
        entry = {"fault": fault, "rank": victim, "step": target, "last": run.last_step(),
                 "codes": sorted(codes), "exit_s": round(time.monotonic() - t_fault, 1),
                 "ok": ok, "truncated": cut}
        tried.append(entry)
        survived += ok
        rate = (time.monotonic() - t0) / len(tried)
        say(f"{layout}: fault {len(tried)}/{faults} {fault} (rank {victim}) at step {target}: "
            f"exit codes {sorted(codes) or 'none (killed)'} in {entry['exit_s']} s, "
            f"{'as documented' if ok else 'NOT as documented'}; ETA {rate * (faults - len(tried)) / 60:.1f} min")
    ref, got = control.losses(), run.losses()
    worst = max((abs(got[s] - ref[s]) / abs(ref[s]) for s in ref if s in got), default=float("inf"))
    complete = rc == 0 and sorted(got) == sorted(ref) == list(range(1, steps + 1))
    equal = complete and worst <= RTOL
    return {"layout": layout, "tried": len(tried), "survived": survived if equal else 0,
            "recomputed": recomputed, "attempts": run.attempt, "max_rel_diff": worst,
            "complete": complete, "seconds": round(time.monotonic() - t0), "faults": tried}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
    p.add_argument("--faults", type=int, default=20, help="faults per layout")
    p.add_argument("--steps", type=int, default=0, help="steps per run (default: 4 per fault + 6)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", default=None, help="working directory (default: a temporary one, removed)")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    layouts = [x for x in args.layouts.split(",") if x]
    unknown = [x for x in layouts if x not in LAYOUTS]
    if unknown or args.faults < 1:
        print(f"error: --layouts: unknown {unknown} (choose from {', '.join(LAYOUTS)})" if unknown
              else "error: --faults must be >= 1", file=sys.stderr)
        return 2
    steps = args.steps or 4 * args.faults + 6
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="fault_soak."))
    say = lambda line: print(line, file=sys.stderr, flush=True)    # noqa: E731
    results = [soak(layout, args.faults, steps, args.seed, work, say) for layout in layouts]
    print("| layout | faults tried | survived | steps recomputed | attempts | max rel. loss diff | s |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        kinds = ", ".join(f"{k} {sum(f['fault'] == k for f in r['faults'])}" for k in FAULTS)
        print(f"| {r['layout']} ({kinds}) | {r['tried']} | {r['survived']} | {r['recomputed']} | "
              f"{r['attempts']} | {r['max_rel_diff']:.1e} | {r['seconds']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if all(r["survived"] == r["tried"] and r["complete"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
