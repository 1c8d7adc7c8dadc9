"""GPipe vs 1F1B pipeline schedules on CPU: bubble fraction and in-flight activation memory.

Hardware: any CPU with 2 free cores (docs/PERFORMANCE.md figures: a shared 2-core CPU).
Launch:   python benchmarks/pipeline_schedules.py                 # p=2, m in 2,4,8; ~1 min
          python benchmarks/pipeline_schedules.py --micro-batches 2 4 8 16 --json sched.json

Two gloo ranks on 127.0.0.1 each hold one stage of the same dense transformer, built from the
pipeline layers the trainer uses (``training/engine/pipeline.py``: stage 0 = embedding + half the blocks,
stage 1 = the other half + norm + head + loss; stage I/O ``(hidden, aux_sum, z_sum)``). One
harness runs both schedules as instruction streams with plain blocking send/recv
(``model/parallel/p2p.py``):

- 1F1B: DeepSpeed's own ``TrainSchedule`` (``deepspeed.runtime.pipe.schedule``, what
  ``engine.train_batch`` executes), instruction for instruction.
- GPipe: every forward (micro-batches 0..m-1), then every backward (m-1..0), written with the same
  instruction classes. DeepSpeed has no GPipe schedule.

Measured per stage and step (median over steps, and at the fastest step, the one least disturbed
by other processes): the bubble fraction, ``1 - busy / step time``, where busy is the wall time
inside that stage's forward and backward computations and the step time runs from a common
barrier to the last computation of any stage; the analytic value for
equal stages is ``(p-1)/(m+p-1)`` for both schedules, and ``model`` is the same count with each
stage's measured forward and backward times (unequal stages, free communication). Activation
memory: every tensor that autograd saves for backward (its storage counted once per micro-batch,
parameters excluded) is held from that micro-batch's forward until its backward; the peak of the
sum over in-flight micro-batches, and the most micro-batches in flight (1F1B: at most p - stage;
GPipe: m).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from deepspeed.runtime.pipe import schedule as ds_schedule  # noqa: E402

from training.engine.pipeline import BlockPipe, EmbeddingPipe, HeadPipe, PipelineLoss  # noqa: E402
from model.config import DenseConfig  # noqa: E402
from model.parallel import p2p  # noqa: E402
from model.parallel.groups import ParallelGroups  # noqa: E402
from tests.distributed import free_port  # noqa: E402

STAGES = 2


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--micro-batches", type=int, nargs="+", default=[2, 4, 8], help="m values")
    p.add_argument("--micro-batch-size", type=int, default=4, help="sequences per micro-batch")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4, help="transformer blocks, split evenly")
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--steps", type=int, default=10, help="timed steps per (schedule, m)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per (schedule, m)")
    p.add_argument("--json", default=None, help="write the result rows to this file")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- schedules

def gpipe_steps(micro_batches: int, stages: int, stage_id: int):
    """GPipe as DeepSpeed instructions: all forwards, then all backwards (last first)."""
    first, last = stage_id == 0, stage_id == stages - 1
    for i in range(micro_batches):
        yield ([] if first else [ds_schedule.RecvActivation(i)]) + \
              ([ds_schedule.LoadMicroBatch(i)] if first or last else []) + \
              [ds_schedule.ForwardPass(i)] + ([] if last else [ds_schedule.SendActivation(i)])
    for i in reversed(range(micro_batches)):
        yield ([] if last else [ds_schedule.RecvGrad(i)]) + [ds_schedule.BackwardPass(i)] + \
              ([] if first else [ds_schedule.SendGrad(i)])


def one_f_one_b_steps(micro_batches: int, stages: int, stage_id: int):
    """DeepSpeed's synchronous 1F1B ``TrainSchedule``, unchanged."""
    return ds_schedule.TrainSchedule(micro_batches=micro_batches, stages=stages,
                                     stage_id=stage_id).steps()


SCHEDULES = {"gpipe": gpipe_steps, "1f1b": one_f_one_b_steps}


# ----------------------------------------------------------------------------- one stage

class Stage:
    """This rank's layers, and an executor of pipeline instructions with activation accounting."""

    def __init__(self, args, rank: int):
        cfg = DenseConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
                          num_heads=4, num_kv_heads=4, ffn_hidden_size=4 * args.hidden,
                          max_seq_len=args.seq_len)
        groups, half = ParallelGroups(), args.layers // 2
        self.rank, self.first, self.last = rank, rank == 0, rank == STAGES - 1
        blocks = range(half) if self.first else range(half, args.layers)
        layers = [EmbeddingPipe(cfg, groups, 0)] if self.first else []
        layers += [BlockPipe(cfg, i, groups, 0) for i in blocks]
        layers += [] if self.first else [HeadPipe(cfg, groups, 0)]
        self.layers = torch.nn.Sequential(*layers)
        self.loss_fn = PipelineLoss(cfg, groups)
        self.loss_fn.ce_scale = 1.0 / (args.micro_batch_size * args.seq_len)
        shape = (args.micro_batch_size, args.seq_len)
        self.act_like = (torch.empty(*shape, args.hidden), torch.empty(()), torch.empty(()))
        self.shape, self.vocab = shape, args.vocab
        self.param_storages = {p.untyped_storage().data_ptr() for p in self.layers.parameters()}

    def batch(self, i: int):
        gen = torch.Generator().manual_seed(i)
        ids = torch.randint(0, self.vocab, self.shape, generator=gen)
        return ids, torch.roll(ids, -1, dims=1)

    def run(self, steps) -> dict:
        """Execute one step's instruction stream; return compute intervals and memory peaks."""
        buf: dict[int, dict] = {}
        live: dict[int, int] = {}                # buffer id -> saved activation bytes
        seen: dict[int, set] = {}
        busy, peak, peak_live, loaded = [], 0, 0, 0
        for cmds in steps:
            for cmd in cmds:
                b = getattr(cmd, "buffer_id", None)
                kind = type(cmd).__name__
                if kind == "LoadMicroBatch":
                    ids, labels = self.batch(loaded)
                    loaded += 1
                    buf.setdefault(b, {}).update(ids=ids, labels=labels)
                elif kind == "RecvActivation":
                    x = p2p.recv_tensors(self.act_like, self.rank - 1)
                    buf.setdefault(b, {})["inputs"] = tuple(t.requires_grad_() for t in x)
                elif kind == "ForwardPass":
                    live[b], seen[b] = 0, set()

                    def pack(t, b=b):
                        s = t.untyped_storage()
                        if s.data_ptr() not in self.param_storages and s.data_ptr() not in seen[b]:
                            seen[b].add(s.data_ptr())
                            live[b] += s.nbytes()
                        return t
                    t0 = time.perf_counter()
                    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                        out = self.layers(buf[b]["ids"] if self.first else buf[b]["inputs"])
                        if self.last:
                            out = self.loss_fn(out, buf[b]["labels"])
                    busy.append(("F", t0, time.perf_counter()))
                    buf[b]["outputs"] = out
                    peak = max(peak, sum(live.values()))
                    peak_live = max(peak_live, len(live))
                elif kind == "SendActivation":
                    p2p.send_tensors(buf[b]["outputs"], self.rank + 1)
                elif kind == "RecvGrad":
                    buf[b]["grads"] = p2p.recv_tensors(self.act_like, self.rank + 1)
                elif kind == "BackwardPass":
                    t0 = time.perf_counter()
                    if self.last:
                        buf[b]["outputs"].backward()
                    else:
                        torch.autograd.backward(buf[b]["outputs"], buf[b]["grads"])
                    busy.append(("B", t0, time.perf_counter()))
                    del live[b]                  # the graph, and what it saved, is freed
                    buf[b].pop("outputs")
                elif kind == "SendGrad":
                    p2p.send_tensors(tuple(t.grad for t in buf.pop(b)["inputs"]), self.rank - 1)
                # ReduceTiedGrads / ReduceGrads / OptimizerStep: nothing to reduce or step here.
        self.layers.zero_grad(set_to_none=True)
        return {"busy": busy, "peak_bytes": peak, "peak_in_flight": peak_live}


def _worker(rank: int, port: int, args, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=STAGES)
    stage = Stage(args, rank)
    rows = []
    for m in args.micro_batches:
        for rep in range(args.warmup + args.steps):
            for name, steps_fn in SCHEDULES.items():     # interleaved: noise hits both alike
                dist.barrier()
                start = time.perf_counter()
                got = stage.run(steps_fn(m, STAGES, rank))
                if rep >= args.warmup:
                    rows.append({"schedule": name, "m": m, "stage": rank, "start": start, **got})
    queue.put((rank, rows))
    dist.barrier()
    dist.destroy_process_group()


def schedule_model_step(work: list[float], micro_batches: int) -> float:
    """Step time of a synchronous pipeline with free communication, ``work[s]`` one micro-batch's
    forward + backward on stage s: the slowest stage paces the m - 1 steady micro-batches, and
    every stage's work fills the ramp up and down (``planning.cost_model.pipeline_seconds``)."""
    return (micro_batches - 1) * max(work) + sum(work)


def summarize(rows: list[dict], args) -> list[dict]:
    """Per (schedule, m, stage): median bubble fraction and busy share, memory peaks."""
    by_step: dict[tuple, list] = {}
    for r in rows:      # the k-th timed step of (schedule, m) on each stage
        key = (r["schedule"], r["m"])
        by_step.setdefault(key, []).append(r)
    out = []
    for (name, m), rs in by_step.items():
        per_stage = {s: [r for r in rs if r["stage"] == s] for s in range(STAGES)}
        bubbles = {s: [] for s in range(STAGES)}
        step_times = []
        for k in range(args.steps):
            step = [per_stage[s][k] for s in range(STAGES)]
            start = min(r["start"] for r in step)
            end = max(r["busy"][-1][2] for r in step)
            step_times.append(end - start)
            for s, r in enumerate(step):
                busy = sum(b - a for _, a, b in r["busy"])
                bubbles[s].append(1 - busy / (end - start))
        ms = [{k: 1e3 * statistics.median(b - a for r in per_stage[s] for kind, a, b in r["busy"]
                                          if kind == k) for k in "FB"} for s in range(STAGES)]
        # Zero-cost communication, each micro-batch taking this stage's median F + B.
        work = [t["F"] + t["B"] for t in ms]
        model_step = schedule_model_step(work, m)
        fastest = step_times.index(min(step_times))   # the step least disturbed by other load
        for s in range(STAGES):
            r0 = per_stage[s][0]
            out.append({"schedule": name, "m": m, "stage": s,
                        "bubble": statistics.median(bubbles[s]),
                        "bubble_fastest": bubbles[s][fastest], "fastest_step_s": min(step_times),
                        "bubble_model": 1 - m * work[s] / model_step,
                        "forward_ms": ms[s]["F"], "backward_ms": ms[s]["B"],
                        "analytic": (STAGES - 1) / (m + STAGES - 1),
                        "step_s": statistics.median(step_times),
                        "peak_act_mb": r0["peak_bytes"] / 2**20,
                        "peak_in_flight": r0["peak_in_flight"]})
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, args, queue)) for r in range(STAGES)]
    for p in procs:
        p.start()
    rows = []
    for _ in procs:
        rows += queue.get()[1]
    for p in procs:
        p.join()
    table = summarize(rows, args)
    print(f"p={STAGES} stages, micro-batch {args.micro_batch_size} x {args.seq_len} tokens, "
          f"hidden {args.hidden}, {args.layers} blocks; median of {args.steps} steps "
          f"(load average {os.getloadavg()[0]:.1f} at the end)")
    print(f"{'schedule':>8} {'m':>3} {'stage':>5} {'bubble':>7} {'fastest':>7} "
          f"{'(p-1)/(m+p-1)':>14} {'model':>6} "
          f"{'step s':>7} {'F ms':>6} {'B ms':>6} {'peak act MiB':>13} {'in flight':>9}")
    for r in sorted(table, key=lambda r: (r["m"], r["schedule"] != "gpipe", r["stage"])):
        print(f"{r['schedule']:>8} {r['m']:>3} {r['stage']:>5} {r['bubble']:>7.3f} "
              f"{r['bubble_fastest']:>7.3f} "
              f"{r['analytic']:>14.3f} {r['bubble_model']:>6.3f} {r['step_s']:>7.3f} "
              f"{r['forward_ms']:>6.1f} "
              f"{r['backward_ms']:>6.1f} {r['peak_act_mb']:>13.1f} "
              f"{r['peak_in_flight']:>9}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": table}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
