"""Pipeline schedules through the trainer: 1F1B, GPipe and ZB-H1 on DeepSpeed's engine, measured
per instruction, side by side in one run.

Hardware: any CPU (docs/performance/pipeline-schedules.md: the 2-core machine named there).
Launch:   OMP_NUM_THREADS=1 python -m benchmarks.systems.pipeline_schedules --json --plot   # p 2 4, m 4 8: 12 runs, ~9 min
          python -m benchmarks.systems.pipeline_schedules --table      # the saved results' table again
          python -m benchmarks.systems.pipeline_schedules --stages 2 --micro-batches 4 --steps 3 --json r.json
          (``python benchmarks/pipeline_schedules.py`` runs the same, kept at that path.)

``--json``, ``--table`` and ``--plot`` take a file; alone, ``--json`` and ``--table`` name
``benchmarks/systems/results/pipeline_schedules.json`` and ``--plot``
``docs/studies/img/pipeline_timelines.png``. Without ``--json`` or ``--plot`` nothing is written.

Each (p, m, schedule) is one ``launch/train.py`` run under torchrun on p gloo ranks (one
pipeline stage each, ``parallel.pipeline_schedule``), fp32 ZeRO-1, a dense model of
``--layers`` blocks split evenly, m micro-batches per step (DeepSpeed's
``gradient_accumulation_steps``). Each rank is this script (``--rank-out``): the trainer's own
``main``, with ``pipe_schedules.install``'s timeline on (every executed instruction's host time)
and an account of the activation bytes it holds (every tensor autograd saves for backward,
counted once per storage, parameters excluded, from its forward until its graph is freed, plus
the inputs ZB-H1's W queue holds until its W), sampled after every instruction.

Printed per stage, over the steps after the first: the busy time (forward, backward, B and W
instructions), the idle fraction ``1 - busy / step`` where the step runs from the first
instruction of any stage to the last of any stage, the same fraction replayed from the
executed instruction streams with this run's median instruction times and free
communication (``replay``: what the schedule alone does, without the other processes this
machine runs meanwhile), the run's cores in use (its stages' summed busy time over the step:
at p ranks on fewer cores the stages cannot all compute at once, and the wall clock then shows
the cores, not the schedule), the formula ((p-1)/(m+p-1) for 1F1B and GPipe, (p-1)/(3m+p-1) for
ZB-H1, the paper's figure with forward, input-gradient and weight-gradient passes of equal
time), the peak activation bytes, and tokens per second.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCHEDULES = ("1f1b", "gpipe", "zb-h1")
COMPUTE = ("ForwardPass", "BackwardPass", "BackwardInputPass", "WeightPass")
SENDS = {"SendActivation": ("act", +1), "SendGrad": ("grad", -1)}
RECVS = {"RecvActivation": ("act", -1), "RecvGrad": ("grad", +1)}
RESULTS = "benchmarks/systems/results/pipeline_schedules.json"    # from the repository root
FIGURE = "docs/studies/img/pipeline_timelines.png"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stages", type=int, nargs="+", default=[2, 4], help="p values")
    p.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8], help="m values")
    p.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES)
    p.add_argument("--micro-batch-size", type=int, default=4, help="sequences per micro-batch")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=8, help="transformer blocks, split evenly")
    p.add_argument("--steps", type=int, default=6, help="optimizer steps per run (the first untimed)")
    p.add_argument("--json", nargs="?", const=RESULTS, default=None, metavar="FILE",
                   help=f"write the result rows to FILE (alone: {RESULTS})")
    p.add_argument("--plot", nargs="?", const=FIGURE, default=None, metavar="FILE",
                   help=f"write the timelines of the largest p and m to this PNG (alone: {FIGURE})")
    p.add_argument("--table", nargs="?", const=RESULTS, default=None, metavar="FILE",
                   help=f"print (and --plot) a saved --json instead of running (alone: {RESULTS})")
    p.add_argument("--rank-out", default=None, help=argparse.SUPPRESS)   # as a torchrun rank
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- one rank

def _rank_main(out: str, train_argv: list[str]) -> None:
    """The trainer's ``main`` on this rank, recording its pipeline instructions and activation
    bytes into ``out`` (JSON) before it exits."""
    import torch

    from launch import train
    from model.parallel import weight_grad
    from training.engine import pipe_schedules
    from training.run.distributed import exit_now

    timeline, samples, live, params = [], [], {}, set()

    class Held:     # one saved tensor: its storage counted while autograd keeps it
        __slots__ = ("key", "tensor")

        def __init__(self, tensor):
            # detached: a saved output would otherwise hold its own grad_fn (a cycle, freed late)
            self.tensor, self.key = tensor.detach(), tensor.untyped_storage().data_ptr()
            if self.key not in params:
                count, size = live.get(self.key, (0, tensor.untyped_storage().nbytes()))
                live[self.key] = (count + 1, size)

        def __del__(self):
            if self.key in live:
                count, size = live[self.key]
                live[self.key] = (count - 1, size)
                if count == 1:
                    del live[self.key]

    def held_bytes() -> int:
        sizes = {k: s for k, (_, s) in live.items()}
        for entry in weight_grad.STORE._queue:          # W's inputs, until the W
            for _, compute in entry:
                for cell in compute.__closure__ or ():
                    t = cell.cell_contents
                    if isinstance(t, torch.Tensor):
                        key = t.untyped_storage().data_ptr()
                        if key not in params:
                            sizes[key] = t.untyped_storage().nbytes()
        return sum(sizes.values())

    install = pipe_schedules.install

    def recording_install(engine, name, timeline_=None):
        install(engine, name, timeline)
        params.update(p.untyped_storage().data_ptr() for p in engine.module.parameters())

        def sampled(fn):
            def run(self, **kwargs):
                fn(self, **kwargs)
                samples.append(held_bytes())
            return run
        engine._INSTRUCTION_MAP = {c: sampled(f) for c, f in engine._INSTRUCTION_MAP.items()}

    pipe_schedules.install = recording_install
    with torch.autograd.graph.saved_tensors_hooks(Held, lambda held: held.tensor):
        code = train.main(train_argv)
    with open(out, "w") as f:
        json.dump({"rank": int(os.environ["RANK"]), "timeline": timeline, "samples": samples}, f)
    exit_now(code)


# ----------------------------------------------------------------------------- analysis

def split_steps(timeline: list) -> list[list]:
    """One stage's timeline cut at each OptimizerStep (one optimizer step each)."""
    steps, current = [], []
    for entry in timeline:
        current.append(entry)
        if entry[0] == "OptimizerStep":
            steps.append(current)
            current = []
    return steps


def replay(streams: list[list[str]], times: list[dict[str, float]]) -> tuple[float, list[float]]:
    """Run the stages' executed instruction names together, each compute instruction taking
    ``times[stage][name]`` and communication free: a receive waits for the matching send of
    the neighbour (the n-th of its kind). Returns (makespan, busy seconds per stage)."""
    p = len(streams)
    clock, pos, busy = [0.0] * p, [0] * p, [0.0] * p
    sent, received = defaultdict(list), defaultdict(int)
    while any(pos[s] < len(streams[s]) for s in range(p)):
        moved = False
        for s in range(p):
            while pos[s] < len(streams[s]):
                name = streams[s][pos[s]]
                if name in RECVS:
                    kind, delta = RECVS[name]
                    key = (kind, s + delta, s)
                    if len(sent[key]) <= received[key]:
                        break
                    clock[s] = max(clock[s], sent[key][received[key]])
                    received[key] += 1
                elif name in SENDS:
                    kind, delta = SENDS[name]
                    sent[(kind, s, s + delta)].append(clock[s])
                elif name in COMPUTE:
                    clock[s] += times[s][name]
                    busy[s] += times[s][name]
                pos[s] += 1
                moved = True
        if not moved:
            raise RuntimeError(f"replay deadlocked at {[streams[s][pos[s]:pos[s] + 1] for s in range(p)]}")
    return max(clock), busy


def formula(name: str, p: int, m: int) -> float:
    """The bubble fraction of equal stages: (p-1)/(m+p-1) (1F1B, GPipe); ZB-H1's (p-1)(F+B-W)
    over m(F+B+W) + (p-1)(F+B-W), with F = B = W: (p-1)/(3m+p-1)."""
    return (p - 1) / (3 * m + p - 1) if name == "zb-h1" else (p - 1) / (m + p - 1)


def schedule_model_step(work: list[float], micro_batches: int) -> float:
    """Step time of a synchronous 1F1B or GPipe pipeline with free communication, ``work[s]``
    one micro-batch's forward + backward on stage s: the slowest stage paces the m - 1 steady
    micro-batches, and every stage's work fills the ramp up and down
    (``planning.cost_model.pipeline_seconds``)."""
    return (micro_batches - 1) * max(work) + sum(work)


def summarize(name: str, p: int, m: int, ranks: list[dict], tokens_per_step: int) -> list[dict]:
    """Per stage of one run: busy, idle fraction measured and replayed, peak bytes, tokens/s."""
    per_stage = [split_steps(r["timeline"])[1:] for r in sorted(ranks, key=lambda r: r["rank"])]
    n = min(len(s) for s in per_stage)
    windows = [(min(per_stage[s][k][0][2] for s in range(p)), max(per_stage[s][k][-1][3] for s in range(p)))
               for k in range(n)]
    step_s = statistics.median(b - a for a, b in windows)
    times = [{c: statistics.median([e[3] - e[2] for st in steps for e in st if e[0] == c] or [0.0])
              for c in COMPUTE} for steps in per_stage]
    streams = [[e[0] for e in steps[0]] for steps in per_stage]
    makespan, replay_busy = replay(streams, times)
    rows = []
    for s, steps in enumerate(per_stage):
        busy = [sum(e[3] - e[2] for e in st if e[0] in COMPUTE) for st in steps[:n]]
        idle = [1 - b / (w[1] - w[0]) for b, w in zip(busy, windows)]
        rows.append({"schedule": name, "p": p, "m": m, "stage": s,
                     "busy_ms": 1e3 * statistics.median(busy), "step_ms": 1e3 * step_s,
                     "idle": statistics.median(idle), "idle_replay": 1 - replay_busy[s] / makespan,
                     "formula": formula(name, p, m),
                     "forward_ms": 1e3 * times[s]["ForwardPass"],
                     "backward_ms": 1e3 * (times[s]["BackwardPass"] or times[s]["BackwardInputPass"]),
                     "weight_ms": 1e3 * times[s]["WeightPass"],
                     "peak_act_mib": max(ranks[s]["samples"] or [0]) / 2**20,
                     "tokens_per_s": tokens_per_step / step_s,
                     "stream": streams[s],
                     # the last timed step's compute, from that step's window start (seconds)
                     "last_step": [(e[0], e[2] - windows[n - 1][0], e[3] - windows[n - 1][0])
                                   for e in steps[n - 1] if e[0] in COMPUTE]})
    return rows


COLOURS = {"ForwardPass": "#4c72b0", "BackwardPass": "#dd8452", "BackwardInputPass": "#c44e52",
           "WeightPass": "#55a868"}


def plot(rows: list[dict], p: int, m: int, path: Path) -> None:
    """One timeline per schedule at (p, m): a row per stage, a bar per forward (blue), backward
    (orange), B (red) and W (green) instruction of the last timed step, as measured."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = [n for n in SCHEDULES if any(r["schedule"] == n and r["p"] == p and r["m"] == m for r in rows)]
    fig, axes = plt.subplots(len(names), 1, figsize=(10, 1.2 + 0.45 * p * len(names)), sharex=True)
    for ax, name in zip(axes if len(names) > 1 else [axes], names):
        for r in (r for r in rows if (r["schedule"], r["p"], r["m"]) == (name, p, m)):
            for kind, a, b in r["last_step"]:
                ax.barh(r["stage"], 1e3 * (b - a), left=1e3 * a, color=COLOURS[kind], edgecolor="white")
        ax.set_yticks(range(p), [f"stage {s}" for s in range(p)])
        ax.invert_yaxis()
        ax.set_ylabel(name, rotation=0, ha="right", va="center", fontweight="bold")
    axes[-1].set_xlabel("ms from the step's first instruction (measured, one step)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLOURS.values()]
    fig.legend(handles, ["forward", "backward", "B (input grad)", "W (weight grad)"], ncol=4,
               loc="upper center")
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- the runs

def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_one(args, name: str, p: int, m: int, work: Path) -> list[dict]:
    tag = f"{name}-p{p}-m{m}"
    out = work / tag
    train_argv = ["--config", "ds_configs/zero1_fp32.json", "--recipe", "recipes/tiny_dense.yaml",
                  "--run-dir", str(out / "run"), "--steps", str(args.steps), "--set",
                  f"parallel.pipeline_parallel_size={p}", f"parallel.pipeline_schedule={name}",
                  f"ds.gradient_accumulation_steps={m}",
                  f"ds.train_micro_batch_size_per_gpu={args.micro_batch_size}",
                  f"model.hidden_size={args.hidden}", f"model.ffn_hidden_size={4 * args.hidden}",
                  f"model.num_layers={args.layers}", f"model.max_seq_len={args.seq_len}",
                  f"data.seq_len={args.seq_len}", "eval.every=0", f"train.save_every={args.steps * 10}",
                  f"train.log_every={args.steps}", "data.max_bytes=1500000", "tokenizer.train_bytes=1500000"]
    out.mkdir(parents=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(p), "--master_port",
           str(_port()), "-m", "benchmarks.systems.pipeline_schedules", "--rank-out", str(out / "rank{}.json"), "--",
           *train_argv]
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=str(REPO))
    with open(out / "log.txt", "w") as log:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise RuntimeError(f"{tag} exited {proc.returncode}: {(out / 'log.txt').read_text()[-3000:]}")
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(p)]
    rows = summarize(name, p, m, ranks, m * args.micro_batch_size * args.seq_len)
    logged = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    for r in rows:      # what was trained: the same under every schedule
        r["losses"] = [(x["loss"], x["grad_norm"]) for x in logged if "loss" in x]
    return rows


def max_loss_gap(rows: list[dict]) -> float:
    """The largest relative difference of a logged loss or grad norm from 1F1B's run at the
    same (p, m): the schedules train the same arithmetic in another order."""
    ref = {(r["p"], r["m"]): r["losses"] for r in rows if r["schedule"] == "1f1b"}
    gaps = [abs(a - b) / abs(b) for r in rows if (r["p"], r["m"]) in ref
            for pair, base in zip(r["losses"], ref[(r["p"], r["m"])]) for a, b in zip(pair, base)]
    return max(gaps, default=0.0)


def print_table(rows: list[dict], header: str) -> None:
    """The table: one line per (schedule, p, m, stage); ``cores`` is the run's summed busy time
    over its step time (how many cores its stages kept busy at once)."""
    print(header)
    print(f"{'schedule':>8} {'p':>2} {'m':>2} {'stage':>5} {'busy ms':>8} {'step ms':>8} {'cores':>5} "
          f"{'idle':>6} {'replay':>6} {'formula':>7} {'F ms':>6} {'B ms':>6} {'W ms':>6} "
          f"{'peak act MiB':>12} {'tokens/s':>8}")
    for r in rows:
        run = [x for x in rows if (x["schedule"], x["p"], x["m"]) == (r["schedule"], r["p"], r["m"])]
        cores = sum(x["busy_ms"] for x in run) / r["step_ms"]
        print(f"{r['schedule']:>8} {r['p']:>2} {r['m']:>2} {r['stage']:>5} {r['busy_ms']:>8.1f} "
              f"{r['step_ms']:>8.1f} {cores:>5.2f} {r['idle']:>6.3f} {r['idle_replay']:>6.3f} "
              f"{r['formula']:>7.3f} {r['forward_ms']:>6.1f} {r['backward_ms']:>6.1f} "
              f"{r['weight_ms']:>6.1f} {r['peak_act_mib']:>12.2f} {r['tokens_per_s']:>8.0f}")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--rank-out" in argv:            # a torchrun rank: the trainer's own arguments after "--"
        split = argv.index("--")
        out = parse_args(argv[:split]).rank_out.format(os.environ["RANK"])
        _rank_main(out, argv[split + 1:])
    args = parse_args(argv)
    if args.table:                      # a saved run's table and timelines again
        saved = json.loads(Path(args.table).read_text())
        print_table(saved["rows"], saved["header"])
        if args.plot:
            plot(saved["rows"], max(saved["args"]["stages"]), max(saved["args"]["micro_batches"]),
                 Path(args.plot))
        return 0
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for p in args.stages:
            for m in args.micro_batches:
                for name in args.schedules:
                    rows += run_one(args, name, p, m, Path(tmp))
                    print(f"  ran {name} p={p} m={m}", file=sys.stderr, flush=True)
    header = (f"dense, {args.layers} blocks, hidden {args.hidden}, micro-batch {args.micro_batch_size} x "
              f"{args.seq_len} tokens, fp32 ZeRO-1, gloo; median of steps 2-{args.steps}; "
              f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end")
    print_table(rows, header)
    print(f"losses and grad norms, largest relative difference from 1f1b's at the same p and m: "
          f"{max_loss_gap(rows):.1e}")
    if args.plot:
        plot(rows, max(args.stages), max(args.micro_batches), Path(args.plot))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k not in ("rank_out", "table")},
                       "header": header, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
