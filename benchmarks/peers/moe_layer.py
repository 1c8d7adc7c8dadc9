"""Forward+backward throughput of our ``MoELayer`` against transformers' ``MixtralSparseMoeBlock``.

Hardware: any CPU (results in docs/performance/moe-layer.md are from a 2-core CPU) or one CUDA GPU.
Launch:   python -m benchmarks.peers.moe_layer                 # CPU fp32, T=4096 H=512 I=1024, E=8,32,64
          python -m benchmarks.peers.moe_layer --threads 1 --timer cpu        # steadier on a shared CPU
          python -m benchmarks.peers.moe_layer --device cuda --dtype bf16     # T=16384 H=2048 I=4096

Mixtral semantics throughout: top-2, renormalized, dropless. For each expert count E, the
transformers block gets *our* weights (copied into its layout), the outputs and every gradient are
checked to match, and only then is each implementation timed: ``warmup`` rounds, then ``repeats``
rounds of ``iters`` steps, every (E, implementation) interleaved inside each round so that noise
from other processes hits all of them alike; the median round is reported, with the fastest
step beside it, and each ratio is also taken within rounds (median of per-round ratios). A step is
``zero grads -> forward -> backward(dy)`` with the input requiring grad, as inside a model.

A dense SwiGLU MLP with inner size ``k*I`` does the same matmul FLOPs per token as the k experts a
token visits: its FLOP rate is the limit an MoE layer can approach on the same hardware.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.nn as nn


from model.config import MoEConfig
from model.moe.layer import MoELayer
from model.moe.router import route
from model.transformer import MLP

TOP_K = 2
HF_IMPLS = ("eager", "grouped_mm", "batched_mm")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Tolerances of the parity check: |a - b| <= atol + rtol * max|b|, per tensor.
TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 5e-2)}
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
# (cpu, cuda) defaults: a size a 2-core CPU runs in minutes, and one that keeps an H200 busy.
DEVICE_DEFAULTS = {"tokens": (4096, 16384), "hidden": (512, 2048), "ffn": (1024, 4096),
                   "iters": (1, 20)}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=None,
                   help="T = batch * seq tokens per step (default: cpu 4096, cuda 16384)")
    p.add_argument("--hidden", type=int, default=None, help="H (default: cpu 512, cuda 2048)")
    p.add_argument("--ffn", type=int, default=None,
                   help="I, inner size of each expert (default: cpu 1024, cuda 4096)")
    p.add_argument("--experts", default="8,32,64", help="comma-separated expert counts E")
    p.add_argument("--top-k", type=int, default=TOP_K,
                   help="experts per token (fine-grained MoEs: 8 with a small --ffn)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--iters", type=int, default=None,
                   help="timed steps per round (default: cpu 1, cuda 20)")
    p.add_argument("--repeats", type=int, default=5, help="rounds; the median round is reported")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds before the timed ones")
    p.add_argument("--slow-step-s", type=float, default=5.0,
                   help="a transformers impl slower than this per step, and than 5x ours, is timed "
                        "once (its parity step), not in the rounds")
    p.add_argument("--timer", choices=sorted(CLOCKS), default="wall",
                   help="wall: elapsed time; cpu: this process's CPU time (user+sys, all "
                        "threads), steadier than wall time when other jobs share the cores; "
                        "use it with --threads 1, since idle OpenMP threads spin")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads; default: torch's default (all cores)")
    p.add_argument("--batched-mm-max-gib", type=float, default=4.0,
                   help="skip transformers' batched_mm when its per-token weight copies exceed this")
    p.add_argument("--profile", action="store_true",
                   help="also print a torch.profiler table of our layer's step at each E")
    p.add_argument("--json", default=None, help="write rows and ratios to this file")
    args = p.parse_args(argv)
    for name, (cpu, cuda) in DEVICE_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, cuda if args.device == "cuda" else cpu)
    return args


# ----------------------------------------------------------------------------- modules

def build_ours(num_experts: int, hidden: int, ffn: int, seed: int) -> MoELayer:
    """Our Mixtral-style MoE layer with fp32 weights scaled so that activations stay O(1)."""
    moe = MoEConfig(num_experts=num_experts, top_k=TOP_K, capacity_factor=None,
                    eval_capacity_factor=None, normalize_top_k=True, router_jitter=0.0)
    layer = MoELayer(moe, hidden, ffn)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        # Router std 1/sqrt(H): logits ~ N(0, 1), so routing is random but decisive (few near-ties).
        layer.gate.weight.normal_(0.0, hidden ** -0.5, generator=g)
        layer.experts.gate_proj.normal_(0.0, hidden ** -0.5, generator=g)
        layer.experts.up_proj.normal_(0.0, hidden ** -0.5, generator=g)
        layer.experts.down_proj.normal_(0.0, ffn ** -0.5, generator=g)
    return layer


def build_hf(ours: MoELayer) -> nn.Module:
    """transformers' ``MixtralSparseMoeBlock`` holding a copy of ``ours``'s weights.

    Layouts: HF ``gate_up_proj`` (E, 2I, H) = cat(gate_proj, up_proj on the last dim) transposed;
    HF ``down_proj`` (E, H, I) = our down_proj (E, I, H) transposed; ``gate.weight`` (E, H) as is.
    The experts implementation is chosen per call through ``block.experts.config``.
    """
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    e = ours.experts
    num_experts, hidden, ffn = e.gate_proj.shape
    cfg = MixtralConfig(hidden_size=hidden, intermediate_size=ffn, num_local_experts=num_experts,
                        num_experts_per_tok=ours.moe.top_k, router_jitter_noise=0.0,
                        hidden_act="silu")
    cfg._experts_implementation = "eager"
    block = MixtralSparseMoeBlock(cfg)
    with torch.no_grad():
        block.gate.weight.copy_(ours.gate.weight)
        block.experts.gate_up_proj.copy_(
            torch.cat([e.gate_proj, e.up_proj], dim=-1).transpose(1, 2))     # (E, 2I, H)
        block.experts.down_proj.copy_(e.down_proj.transpose(1, 2))           # (E, H, I)
    return block


def hf_grads_in_our_layout(block: nn.Module) -> dict[str, torch.Tensor]:
    """The HF block's parameter gradients mapped back to our names and layouts."""
    gu = block.experts.gate_up_proj.grad.transpose(1, 2)                     # (E, H, 2I)
    ffn = gu.shape[-1] // 2
    return {"gate.weight": block.gate.weight.grad,
            "experts.gate_proj": gu[..., :ffn], "experts.up_proj": gu[..., ffn:],
            "experts.down_proj": block.experts.down_proj.grad.transpose(1, 2)}


def set_impl(module: nn.Module, impl: str | None) -> None:
    if impl is not None:
        module.experts.config._experts_implementation = impl


# ----------------------------------------------------------------------------- steps

def step(module: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """One training step of the layer alone: zero grads, forward, backward. Returns the output."""
    module.zero_grad(set_to_none=True)
    x.grad = None
    out = module(x)
    out = out[0] if isinstance(out, tuple) else out                          # ours: (out, aux)
    out.backward(dy)
    return out


def max_violation(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> tuple[float, bool]:
    """Max |a - b| and whether it is within the dtype's tolerance relative to max |b|."""
    atol, rtol = TOLERANCE[dtype]
    diff = (a.float() - b.float()).abs().max().item()
    return diff, diff <= atol + rtol * b.float().abs().max().item()


def timed_step(module: nn.Module, x: torch.Tensor, dy: torch.Tensor,
               clock=time.perf_counter) -> tuple[torch.Tensor, float]:
    """``step`` and its seconds on ``clock`` (synchronizing CUDA on both sides)."""
    if x.is_cuda:
        torch.cuda.synchronize()
    t0 = clock()
    out = step(module, x, dy)
    if x.is_cuda:
        torch.cuda.synchronize()
    return out, clock() - t0


def check_parity(ours: MoELayer, hf: nn.Module, impl: str, x: torch.Tensor, dy: torch.Tensor,
                 clock=time.perf_counter) -> tuple[float, float, str]:
    """Assert that the HF block (with ``impl``) matches ours in output, dx and every weight grad.

    Tokens the two routers send to different experts are excluded (only possible in bf16: our
    router runs in fp32, transformers' in the model dtype), and then gradients are not compared.
    Returns max |out diff| on the compared tokens, the seconds of the HF step and what was checked.
    """
    dtype = x.dtype
    with torch.no_grad():
        ours_idx = route(x.reshape(-1, x.shape[-1]), ours.gate.weight, TOP_K, True).expert_idx
        _, _, hf_idx = hf.gate(x)
        same = (ours_idx.sort(-1).values == hf_idx.sort(-1).values).all(-1).reshape(x.shape[:-1])
    out_ours = step(ours, x, dy).detach()
    dx_ours = x.grad.clone()
    set_impl(hf, impl)
    out_hf, seconds = timed_step(hf, x, dy, clock)
    out_hf = out_hf.detach()
    dx_hf = x.grad.clone()
    diff, ok = max_violation(out_ours[same], out_hf[same], dtype)
    if not ok:
        raise AssertionError(f"HF {impl}: output differs from ours by {diff:.3g} ({dtype})")
    num_rerouted = int((~same).sum())
    if num_rerouted == 0:   # gradients only comparable when every token is routed alike
        grads = hf_grads_in_our_layout(hf)
        named = {"dx": (dx_ours, dx_hf)}
        named.update({n: (p.grad, grads[n]) for n, p in ours.named_parameters()})
        for name, (a, b) in named.items():
            d, ok = max_violation(a, b, dtype)
            if not ok:
                raise AssertionError(f"HF {impl}: grad {name} differs from ours by {d:.3g}")
    elif dtype == torch.float32:
        raise AssertionError(f"HF {impl}: routing differs on {num_rerouted} tokens in fp32")
    checked = ("matches: out, dx, all weight grads" if num_rerouted == 0 else
               f"matches: out on tokens routed alike ({num_rerouted} routed differently by the "
               f"{dtype} router)")
    return diff, seconds, checked


def flops_per_step(tokens: int, hidden: int, ffn: int, num_experts: int | None) -> float:
    """Matmul FLOPs of forward+backward (backward = 2x forward): k experts' SwiGLU + router.

    ``num_experts=None`` is the dense MLP with inner size k*I: the same expert FLOPs, no router.
    """
    fwd = 2 * tokens * 3 * hidden * TOP_K * ffn
    if num_experts is not None:
        fwd += 2 * tokens * hidden * num_experts
    return 3.0 * fwd


def profile_ours(ours: MoELayer, x: torch.Tensor, dy: torch.Tensor, num_experts: int) -> None:
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if x.is_cuda else [])
    with profile(activities=acts) as prof:
        for _ in range(2):
            step(ours, x, dy)
    key = "self_device_time_total" if x.is_cuda else "self_cpu_time_total"
    print(f"\n### profile: ours, E={num_experts} (2 steps)\n")
    print(prof.key_averages().table(sort_by=key, row_limit=18))


# ----------------------------------------------------------------------------- main

@dataclass
class Run:
    """One (expert count, implementation) cell of the table and its measurements."""

    experts: int | None               # None for the dense MLP
    name: str                         # "ours", "hf eager", ...
    module: nn.Module | None
    impl: str | None                  # transformers experts implementation, None for ours/dense
    flops: float                      # matmul FLOPs of one forward+backward step
    diff: float = float("nan")        # max |out - ours| of the parity check
    note: str = ""
    times: list[float] = field(default_factory=list)   # s/step on --timer, one entry per round
    other_times: list[float] = field(default_factory=list)   # s/step on the other clock

    @property
    def seconds(self) -> float:
        return statistics.median(self.times)


def build_runs(args, x: torch.Tensor, dy: torch.Tensor) -> list[Run]:
    """Build every module, check each transformers implementation against ours, return the runs.

    An implementation whose parity step took longer than ``--slow-step-s`` and than 5x ours is
    not put into the timed rounds; its parity step is its single measurement (flagged).
    """
    dtype, device = DTYPES[args.dtype], torch.device(args.device)
    tokens = x.numel() // x.shape[-1]
    g = torch.Generator().manual_seed(0)
    dense = MLP(args.hidden, TOP_K * args.ffn)
    with torch.no_grad():
        dense.gate_proj.weight.normal_(0.0, args.hidden ** -0.5, generator=g)
        dense.up_proj.weight.normal_(0.0, args.hidden ** -0.5, generator=g)
        dense.down_proj.weight.normal_(0.0, (TOP_K * args.ffn) ** -0.5, generator=g)
    runs = [Run(None, "dense k*I", dense.to(device=device, dtype=dtype), None,
                flops_per_step(tokens, args.hidden, args.ffn, None),
                note=f"SwiGLU MLP, inner {TOP_K}*I: same FLOPs/token")]
    for e in args.experts:
        ours = build_ours(e, args.hidden, args.ffn, seed=e)
        hf = build_hf(ours)
        ours.to(device=device, dtype=dtype)
        hf.to(device=device, dtype=dtype)
        flops = flops_per_step(tokens, args.hidden, args.ffn, e)
        with torch.no_grad():
            counts = ours(x)[1].routed_per_expert.float()                  # (E,)
        ours_seconds = timed_step(ours, x, dy, CLOCKS[args.timer])[1]
        runs.append(Run(e, "ours", ours, None, flops, diff=0.0,
                        note=f"load max/mean {(counts.max() / counts.mean()).item():.2f}"))
        # batched_mm gathers one (2I, H) and one (H, I) weight copy per (token, slot).
        gathered_gib = TOP_K * tokens * 3 * args.hidden * args.ffn * x.element_size() / 2 ** 30
        for impl in HF_IMPLS:
            run = Run(e, f"hf {impl}", hf, impl, flops)
            if impl == "batched_mm" and gathered_gib > args.batched_mm_max_gib:
                run.module, run.note = None, f"skipped: would gather {gathered_gib:.0f} GiB of weights"
            else:
                run.diff, seconds, run.note = check_parity(ours, hf, impl, x, dy,
                                                           CLOCKS[args.timer])
                if seconds > max(args.slow_step_s, 5 * ours_seconds):
                    run.module, run.times = None, [seconds]
                    run.note += f"; {seconds:.0f} s/step > --slow-step-s: timed once, not in rounds"
            runs.append(run)
        print(f"built and checked E={e}", file=sys.stderr)
    return runs


def time_rounds(runs: list[Run], x: torch.Tensor, dy: torch.Tensor, args) -> None:
    """``warmup`` untimed rounds, then ``repeats`` timed rounds of ``iters`` steps per run.

    Every run is measured once per round, back to back, so that other load on the machine hits
    all of them alike, and ratios can be taken within a round.
    """
    timed = [r for r in runs if r.module is not None]
    for i in range(args.warmup + args.repeats):
        for r in timed:
            set_impl(r.module, r.impl)
            wall0, cpu0 = time.perf_counter(), time.process_time()
            for _ in range(args.iters):
                timed_step(r.module, x, dy)                                  # syncs CUDA
            wall = (time.perf_counter() - wall0) / args.iters
            cpu = (time.process_time() - cpu0) / args.iters
            if i >= args.warmup:
                r.times.append(cpu if args.timer == "cpu" else wall)
                r.other_times.append(wall if args.timer == "cpu" else cpu)
        print(f"round {i + 1}/{args.warmup + args.repeats}", file=sys.stderr)


def paired_ratio(a: Run, b: Run) -> float:
    """Median over rounds of a's step time / b's, or the ratio of medians if not paired."""
    if len(a.times) == len(b.times) > 1:
        return statistics.median(ta / tb for ta, tb in zip(a.times, b.times))
    return a.seconds / b.seconds


def min_ratio(a: Run, b: Run) -> float:
    """a's fastest step / b's fastest step: other load only ever adds time, so on a shared
    machine this is the better estimate of the uncontended ratio."""
    return min(a.times) / min(b.times)


Ratio = tuple[str, float, float, str]   # name, paired-median value, min-time value, target


def ratios(runs: list[Run], experts: list[int]) -> list[Ratio]:
    """The ratios the project tracks, all from this one run, each as a paired median and from
    the fastest steps."""
    cell = {(r.experts, r.name): r for r in runs if r.times}
    lo, hi = min(experts), max(experts)
    ours, dense = cell[(lo, "ours")], cell[(None, "dense k*I")]

    def both(a: Run, b: Run) -> tuple[float, float]:
        return paired_ratio(a, b), min_ratio(a, b)

    out = []
    hf_lo = [r for (e, n), r in cell.items() if e == lo and n.startswith("hf")]
    if hf_lo:
        best = min(hf_lo, key=lambda r: r.seconds)
        out.append((f"ours speedup over the fastest transformers impl ({best.name}) at E={lo}",
                    *both(best, ours), ">= 1.2"))
    if hi != lo:
        out.append((f"ours step time E={hi} / E={lo}", *both(cell[(hi, "ours")], ours), "<= 1.2"))
        for impl in HF_IMPLS:
            if (hi, f"hf {impl}") in cell and (lo, f"hf {impl}") in cell:
                out.append((f"hf {impl} step time E={hi} / E={lo}",
                            *both(cell[(hi, f"hf {impl}")], cell[(lo, f"hf {impl}")]), ""))
    for e in experts:
        r = cell[(e, "ours")]
        # (flops_ours / t_ours) / (flops_dense / t_dense)
        scale = r.flops / dense.flops
        out.append((f"ours FLOP rate / dense k*I MLP FLOP rate, E={e}",
                    *(scale * v for v in both(dense, r)), ">= 0.7"))
    return out


def fmt_ms(seconds: float) -> str:
    ms = 1e3 * seconds
    return f"{ms:.0f}" if ms >= 100 else f"{ms:.1f}" if ms >= 10 else f"{ms:.2f}"


def meets(value: float, target: str) -> str:
    if not target:
        return ""
    op, bound = target.split()
    return "yes" if (value >= float(bound) if op == ">=" else value <= float(bound)) else "NO"


def print_report(args, tokens: int, runs: list[Run], rats: list[Ratio],
                 load: tuple[float, ...]) -> None:
    print(f"\nT={tokens} tokens, H={args.hidden}, I={args.ffn}, top-{TOP_K}, {args.dtype}, "
          f"{args.device}, fwd+bwd step, median of {args.repeats} interleaved rounds x "
          f"{args.iters} step(s) after {args.warmup} warmup round(s), torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {args.timer} clock\n")
    other = "wall" if args.timer == "cpu" else "CPU"
    print(f"| E | implementation | ms/step | min ms | {other} ms/step | tokens/s | GFLOP/s | "
          "ours faster by | max abs out diff | note |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---|")
    ours_s = {r.experts: r.seconds for r in runs if r.name == "ours"}
    for r in runs:
        e = "-" if r.experts is None else r.experts
        if not r.times:
            print(f"| {e} | {r.name} | | | | | | | | {r.note} |")
            continue
        s = r.seconds
        faster = "" if r.experts is None else f"{s / ours_s[r.experts]:.2f}x"
        diff = "" if math.isnan(r.diff) else f"{r.diff:.1e}"
        other = fmt_ms(statistics.median(r.other_times)) if r.other_times else ""
        print(f"| {e} | {r.name} | {fmt_ms(s)} | {fmt_ms(min(r.times))} | {other} | "
              f"{tokens / s:,.0f} | {r.flops / s / 1e9:.1f} | {faster} | {diff} | {r.note} |")
    print(f"\nload average (1 min) before/after: {load[0]:.2f} / {os.getloadavg()[0]:.2f} on "
          f"{os.cpu_count()} CPUs (other processes share the cores if it exceeds the threads)")
    print("\n| ratio | median of per-round ratios | from fastest steps | target | met (median / "
          "fastest) |")
    print("|---|---:|---:|---|---|")
    for name, med, fast, target in rats:
        met = f"{meets(med, target)} / {meets(fast, target)}" if target else ""
        print(f"| {name} | {med:.2f} | {fast:.2f} | {target} | {met} |")


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def main(argv=None) -> None:
    global TOP_K
    args = parse_args(argv)
    TOP_K = args.top_k
    args.experts = [int(e) for e in args.experts.split(",")]
    dtype, device = DTYPES[args.dtype], torch.device(args.device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device visible")
    if device.type == "cuda" and args.timer == "cpu":
        raise SystemExit("--timer cpu measures host CPU time: use --timer wall with --device cuda")
    t_start, load = time.perf_counter(), os.getloadavg()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, args.tokens, args.hidden, generator=g).to(device=device, dtype=dtype)
    x.requires_grad_(True)                                                   # (1, T, H)
    dy = torch.randn(1, args.tokens, args.hidden, generator=g).to(device=device, dtype=dtype)

    runs = build_runs(args, x, dy)
    time_rounds(runs, x, dy, args)
    if args.profile:
        for r in runs:
            if r.name == "ours":
                profile_ours(r.module, x, dy, r.experts)
    # Ours first within each E, then transformers', then the dense reference.
    runs.sort(key=lambda r: (r.experts is None, r.experts or 0))
    rats = ratios(runs, args.experts)
    print_report(args, args.tokens, runs, rats, load)
    wall = time.perf_counter() - t_start
    print(f"\nwall time {wall:.0f} s", file=sys.stderr)

    if args.json:
        import transformers
        meta = {"date": datetime.date.today().isoformat(), "argv": sys.argv,
                "torch": torch.__version__, "transformers": transformers.__version__,
                "threads": torch.get_num_threads(), "cpu": cpu_name(),
                "cuda": torch.cuda.get_device_name() if device.type == "cuda" else None,
                "args": vars(args), "wall_s": wall,
                "loadavg_before": load, "loadavg_after": os.getloadavg()}
        rows = [{"experts": r.experts, "impl": r.name, "times_s": r.times,
                 "other_clock_times_s": r.other_times, "flops": r.flops,
                 "max_abs_out_diff": None if math.isnan(r.diff) else r.diff, "note": r.note}
                for r in runs]
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows,
                       "ratios": [{"name": n, "paired_median": m, "from_fastest": f, "target": t}
                                  for n, m, f, t in rats]},
                      f, indent=1)


if __name__ == "__main__":
    main()
