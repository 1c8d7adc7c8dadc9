"""What one device's tensor cores and memory reach: matmul TFLOP/s by dtype and memory bandwidth,
beside the datasheet peaks, and the roofline arithmetic of this repo's kernels (docs/gpu.md).

Hardware: one CUDA GPU (the GPU suite's step `gpu microbench`, benchmarks/gpu_suite.sh part 1), or
the CPU at tiny sizes (the suite's rehearsal).
Launch:   python -m benchmarks.gpu.gpu_microbench                         # CUDA: 8192^3 and this repo's GEMMs
          python -m benchmarks.gpu.gpu_microbench --size tiny --device cpu
          python -m benchmarks.gpu.gpu_microbench --roofline              # no timing: ridge points, intensities

Matmuls: C = A @ B for each (M, K, N) and dtype, timed by ``torch.utils.benchmark`` (it calibrates
the repetitions and synchronizes CUDA); TFLOP/s = 2 M K N / the fastest block's time per call
(other load only ever adds time: on a shared CPU the median swings tenfold). fp32 runs with TF32 off
(``torch.set_float32_matmul_precision("highest")``: CUDA cores), tf32 with it on ("high"); bf16
and fp16 are plain matmuls; fp8 is ``torch._scaled_mm`` on e4m3 operands (B column-major, as it
requires), tensor-wise scales of 1, bf16 output, exact accumulation (``use_fast_accum=False``).
A dtype the device refuses is reported as unsupported, with the error's first line. The shapes
are 8192^3 and the GEMMs of this repo's GPU-suite models at their micro-batch x sequence, read
from the recipes and the DeepSpeed JSON (``repo_gemms``).

Bandwidth: a copy (``dst.copy_(src)``: reads and writes N bytes, 2N moved) and an add
(``torch.add(a, b, out=c)``: 3N moved) of fp32 buffers far larger than the GPU's L2 (1 GiB each;
on the CPU 32 MiB, which sits in this machine's caches: the CPU figure is not DRAM bandwidth).

The datasheet peaks: ``training/gpus.py``'s dense bf16 tensor-core figure and HBM bandwidth,
times ``TENSOR_RATE`` for the other tensor-core dtypes, and ``FP32_TFLOPS`` (CUDA cores, no tensor
cores) for fp32; sources in docs/gpu.md. Hand-written rather than a library: the FLOP and byte
counts are two lines each, and no maintained package measures these against this repo's shapes.
"""

from __future__ import annotations

import time

T0 = time.perf_counter()                    # the --budget-s clock starts before torch's import

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import yaml  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

from training.gpus import GPUS, detect_gpu  # noqa: E402

DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")
ELEMENT_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
# Dense tensor-core rate as a multiple of the bf16 rate: the same on the H100, H200 and B200
# datasheets (their sparse figures halved): tf32 half, fp16 equal, fp8 double.
TENSOR_RATE = {"tf32": 0.5, "bf16": 1.0, "fp16": 1.0, "fp8": 2.0}
# fp32 on CUDA cores (FMA), TFLOP/s: H100/H200 SXM 67, HGX B200 75 (datasheets).
FP32_TFLOPS = {"h100-80gb": 67.0, "h200-141gb": 67.0, "b200-192gb": 75.0}
ROOFLINE_GPUS = ("h100-80gb", "h200-141gb", "b200-192gb")
# The models each size measures: (dense recipe, MoE recipe, DeepSpeed JSON with the micro-batch,
# micro-batch used: None = the JSON's). The tiny size takes one sequence: the CPU's fp8 and fp16
# matmuls run reference kernels at tens of MFLOP/s.
MODELS = {"gpu": ("recipes/dense_1p3b.yaml", "recipes/gpu_mixtral_1b_active.yaml", "ds_configs/zero1.json", None),
          "tiny": ("recipes/tiny_dense.yaml", "recipes/tiny_mixtral.yaml", "ds_configs/zero1_fp32.json", 1)}
SQUARE = {"gpu": 8192, "tiny": 128}
STREAM_BYTES = {"gpu": 2**30, "tiny": 32 * 2**20}        # per buffer
# Rows of a query block in a tiled (FlashAttention-2-style) attention forward at head dim 128.
QUERY_BLOCK = 128


# ----------------------------------------------------------------------------- arithmetic

def matmul_flops(m: int, k: int, n: int) -> int:
    """FLOPs of (M, K) @ (K, N): one multiply and one add per term."""
    return 2 * m * k * n


def matmul_bytes(m: int, k: int, n: int, in_bytes: float, out_bytes: float) -> float:
    """The least memory traffic of one matmul: A and B read once, C written once."""
    return (m * k + k * n) * in_bytes + m * n * out_bytes


def intensity(m: int, k: int, n: int, in_bytes: float, out_bytes: float | None = None) -> float:
    """Arithmetic intensity, FLOP per byte of memory traffic (output in the input dtype by default)."""
    return matmul_flops(m, k, n) / matmul_bytes(m, k, n, in_bytes, in_bytes if out_bytes is None else out_bytes)


def stream_bytes(op: str, nbytes: int) -> int:
    """Bytes moved by ``op`` over buffers of ``nbytes``: copy reads one and writes one, add reads
    two and writes one."""
    return {"copy": 2, "add": 3}[op] * nbytes


def peak_tflops(gpu: str, dtype: str) -> float:
    """Dense datasheet peak of ``dtype`` on ``gpu`` (a key of ``training.gpus.GPUS``)."""
    if dtype == "fp32":
        return FP32_TFLOPS[gpu]
    return GPUS[gpu].bf16_tflops * TENSOR_RATE[dtype]


def ridge_point(gpu: str, dtype: str) -> float:
    """FLOP per byte above which a kernel on ``gpu`` is compute-bound: peak FLOP/s over HBM B/s."""
    return peak_tflops(gpu, dtype) / GPUS[gpu].hbm_tb_s


def attention_hbm_bytes(batch: int, heads: int, seq: int, head_dim: int, elem: int, kind: str) -> float:
    """HBM bytes of one attention forward. ``unfused``: Q, K, V read, O written, and the (S, S)
    scores written, read, the probabilities written, read (the least eager code moves; the mask
    and scaling add passes). ``tiled``: Q read, O written, K and V read once per query block of
    ``QUERY_BLOCK`` rows, none kept in L2 (FlashAttention's accounting). ``tiled_l2``: K and V
    read once (the blocks of one head share them in L2)."""
    bh, sd = batch * heads, seq * head_dim
    per_head = {"unfused": 4 * sd + 4 * seq * seq,
                "tiled": 2 * sd + 2 * sd * math.ceil(seq / QUERY_BLOCK),
                "tiled_l2": 4 * sd}[kind]
    return float(elem * bh * per_head)


def _load(path: str) -> dict:
    text = (ROOT / path).read_text()
    return json.loads(text) if path.endswith(".json") else yaml.safe_load(text)


def repo_gemms(size: str) -> list[tuple[str, int, int, int]]:
    """(label, M, K, N) of the forward GEMMs of this size's dense and MoE recipes at the JSON's
    micro-batch x sequence (``MODELS``): attention projections, the MLP, the output head, and one
    expert's share of the MoE layer when routing is balanced (tokens x top_k / experts rows)."""
    dense_path, moe_path, ds_path, micro = MODELS[size]
    dense, moe = _load(dense_path), _load(moe_path)
    micro = micro or _load(ds_path)["train_micro_batch_size_per_gpu"]
    tokens = micro * dense["data"]["seq_len"]
    m = dense["model"]
    h, heads, kv = m["hidden_size"], m["num_heads"], m.get("num_kv_heads") or m["num_heads"]
    hd = m.get("attn_head_dim") or h // heads
    e = moe["model"]
    rows = micro * moe["data"]["seq_len"] * e["moe"]["top_k"] // e["moe"]["num_experts"]
    return [("q/o proj", tokens, h, heads * hd), ("k/v proj", tokens, h, kv * hd),
            ("gate/up proj", tokens, h, m["ffn_hidden_size"]), ("down proj", tokens, m["ffn_hidden_size"], h),
            ("output head", tokens, h, m["vocab_size"]),
            (f"expert gate/up ({e['moe']['num_experts']} experts, top-{e['moe']['top_k']})",
             rows, e["hidden_size"], e["ffn_hidden_size"])]


# ----------------------------------------------------------------------------- measurement

def _timer(stmt: str, env: dict, min_run_time: float) -> float:
    import torch.utils.benchmark as bench
    blocks = bench.Timer(stmt, globals=env, num_threads=torch.get_num_threads()).blocked_autorange(
        min_run_time=min_run_time)
    return min(blocks.times)           # the fastest block's time per call: other load only adds time


def time_matmul(dtype: str, m: int, k: int, n: int, device: torch.device, min_run_time: float) -> float:
    """Seconds of one (M, K) @ (K, N) in ``dtype`` (fastest block); RuntimeError if unsupported."""
    if dtype == "tf32" and not (device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 8):
        raise RuntimeError(f"no tf32 on {device.type if device.type != 'cuda' else 'this GPU'}")
    gen = torch.Generator(device=device).manual_seed(0)
    if dtype == "fp8":
        a = torch.randn(m, k, device=device, generator=gen).to(torch.float8_e4m3fn)
        b = torch.randn(n, k, device=device, generator=gen).to(torch.float8_e4m3fn).t()   # (K, N) column-major
        one = torch.ones((), device=device)
        env = {"torch": torch, "a": a, "b": b, "one": one}
        stmt = "torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)"
    else:
        t = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
        a = torch.randn(m, k, device=device, generator=gen, dtype=t)
        b = torch.randn(k, n, device=device, generator=gen, dtype=t)
        env, stmt = {"torch": torch, "a": a, "b": b}, "torch.mm(a, b)"
    torch.set_float32_matmul_precision("high" if dtype == "tf32" else "highest")
    try:
        eval(stmt, env)                        # first call: library handles, kernel choice
        return _timer(stmt, env, min_run_time)
    finally:
        torch.set_float32_matmul_precision("highest")


def time_stream(op: str, nbytes: int, device: torch.device, min_run_time: float) -> float:
    """Seconds of one copy or add over fp32 buffers of ``nbytes`` each (fastest block)."""
    numel = nbytes // 4
    a, b, c = (torch.ones(numel, device=device) for _ in range(3))
    stmt = "c.copy_(a)" if op == "copy" else "torch.add(a, b, out=c)"
    env = {"torch": torch, "a": a, "b": b, "c": c}
    eval(stmt, env)
    return _timer(stmt, env, min_run_time)


def measure(size: str, device: torch.device, budget_s: float | None) -> dict:
    """Every bandwidth op, then every (dtype, shape) matmul, smallest shape first. Past a dtype's
    first (smallest, always measured) cell, a cell whose predicted time (three calls at the rate
    of the dtype's last cell: the first call, the timer's calibration, one block) would end past
    ``budget_s`` from the process start is skipped."""
    min_run_time = 0.05 if device.type == "cuda" else 0.02
    gpu = detect_gpu(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    out = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name(),
           "device_type": device.type, "gpu_key": gpu.name if gpu else None, "size": size,
           "torch": torch.__version__, "threads": torch.get_num_threads(), "bandwidth": [], "matmul": []}
    for op in ("copy", "add"):
        sec = time_stream(op, STREAM_BYTES[size], device, min_run_time)
        moved = stream_bytes(op, STREAM_BYTES[size])
        out["bandwidth"].append({"op": op, "buffer_bytes": STREAM_BYTES[size], "bytes": moved,
                                 "seconds": sec, "gb_s": moved / sec / 1e9,
                                 "peak_gb_s": gpu.hbm_tb_s * 1e3 if gpu else None})
    shapes = sorted([(f"square {SQUARE[size]}", SQUARE[size], SQUARE[size], SQUARE[size]), *repo_gemms(size)],
                    key=lambda s: matmul_flops(*s[1:]))
    for dtype in ("bf16", "fp8", "tf32", "fp32", "fp16"):      # most telling first, in case the budget ends
        rate = None                                            # FLOP/s of this dtype's last cell
        for label, m, k, n in shapes:
            row = {"shape": label, "m": m, "k": k, "n": n, "dtype": dtype, "flops": matmul_flops(m, k, n),
                   "intensity": intensity(m, k, n, ELEMENT_BYTES[dtype], 2 if dtype == "fp8" else None),
                   "peak_tflops": peak_tflops(gpu.name, dtype) if gpu and gpu.name in FP32_TFLOPS else None}
            if budget_s is not None and rate and time.perf_counter() - T0 + 3 * row["flops"] / rate > budget_s:
                row["status"] = f"skipped: past the {budget_s:g} s budget"
            else:
                try:
                    row["seconds"] = time_matmul(dtype, m, k, n, device, min_run_time)
                    row["tflops"], row["status"] = row["flops"] / row["seconds"] / 1e12, "ok"
                    rate = row["flops"] / row["seconds"]
                except torch.OutOfMemoryError:
                    row["status"] = "out of memory"
                except (RuntimeError, NotImplementedError, TypeError) as err:
                    row["status"] = "unsupported: " + (str(err).strip().splitlines() or ["?"])[0][:120]
            out["matmul"].append(row)
    return out


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"CPU: {line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    except OSError:
        pass
    return "CPU"


# ----------------------------------------------------------------------------- tables

def _cell(row: dict) -> str:
    if row["status"] != "ok":
        return row["status"].split(":")[0]
    pct = f" ({row['tflops'] / row['peak_tflops']:.0%})" if row.get("peak_tflops") else ""
    return f"{row['tflops']:.3g}{pct}"


def tables(result: dict) -> str:
    lines = [f"device: {result['device']}, torch {result['torch']}, {result['size']} sizes"
             + (f", {result['threads']} thread(s)" if result["device_type"] == "cpu" else "")
             + ("" if result["gpu_key"] else " (no datasheet peak for this device)"), "",
             "| memory op | buffer | bytes moved | GB/s | of datasheet HBM |", "|---|---|---|---|---|"]
    for b in result["bandwidth"]:
        of = f"{b['gb_s'] / b['peak_gb_s']:.0%}" if b["peak_gb_s"] else "n/a"
        lines.append(f"| {b['op']} | {b['buffer_bytes'] / 2**20:g} MiB | {b['bytes'] / 2**20:g} MiB "
                     f"| {b['gb_s']:.1f} | {of} |")
    lines += ["", "TFLOP/s" + (" (of the dense datasheet peak)" if result["gpu_key"] else "") + ":", "",
              "| matmul | M x K x N | FLOP/byte (bf16) | " + " | ".join(DTYPES) + " |",
              "|---|---|---|" + "---|" * len(DTYPES)]
    by = {(r["shape"], r["dtype"]): r for r in result["matmul"]}
    for shape in dict.fromkeys(r["shape"] for r in result["matmul"]):
        r0 = by[(shape, "bf16")]
        lines.append(f"| {shape} | {r0['m']} x {r0['k']} x {r0['n']} | {intensity(r0['m'], r0['k'], r0['n'], 2):.0f} | "
                     + " | ".join(_cell(by[(shape, d)]) for d in DTYPES) + " |")
    notes = sorted({f"{r['dtype']}: {r['status']}" for r in result["matmul"] if r["status"].startswith("unsupported")})
    return "\n".join(lines + ([""] + notes if notes else []))


def roofline_text() -> str:
    """The ridge points of H100/H200/B200 per dtype and where this repo's kernels sit."""
    out = ["Ridge point (FLOP/byte) = dense peak TFLOP/s / HBM TB/s:", "",
           "| GPU | HBM TB/s | " + " | ".join(DTYPES) + " |", "|---|---|" + "---|" * len(DTYPES)]
    for g in ROOFLINE_GPUS:
        out.append(f"| {g} | {GPUS[g].hbm_tb_s:g} | " + " | ".join(
            f"{peak_tflops(g, d):g} TFLOP/s: {ridge_point(g, d):.0f}" for d in DTYPES) + " |")
    out += ["", "This repo's forward GEMMs (recipes/dense_1p3b.yaml, recipes/gpu_mixtral_1b_active.yaml at "
            "ds_configs/zero1.json's micro-batch; bf16 in and out):", "",
            "| GEMM | M x K x N | GFLOP | FLOP/byte | h200 bf16 | h200 fp8 |", "|---|---|---|---|---|---|"]
    side = lambda ai, d: "compute-bound" if ai > ridge_point("h200-141gb", d) else "memory-bound"  # noqa: E731
    for label, m, k, n in repo_gemms("gpu"):
        ai, ai8 = intensity(m, k, n, 2), intensity(m, k, n, 1, 2)
        out.append(f"| {label} | {m} x {k} x {n} | {matmul_flops(m, k, n) / 1e9:.1f} | {ai:.0f} (fp8 {ai8:.0f}) "
                   f"| {side(ai, 'bf16')} | {side(ai8, 'fp8')} |")
    for label, m, k, n in [("decode, 1 token x 8 sequences", 8, 2048, 5504),
                           ("64 experts, top-2: 512 rows each", 512, 2048, 2752),
                           ("128 experts, top-1: 128 rows each", 128, 2048, 2752)]:
        ai, ai8 = intensity(m, k, n, 2), intensity(m, k, n, 1, 2)
        out.append(f"| {label} | {m} x {k} x {n} | {matmul_flops(m, k, n) / 1e9:.2f} | {ai:.0f} (fp8 {ai8:.0f}) "
                   f"| {side(ai, 'bf16')} | {side(ai8, 'fp8')} |")
    b, h, s, d = 8, 16, 2048, 128                          # dense_1p3b at micro-batch 8
    flops = 2 * b * h * s * s * d                          # causal: half of 4 B H S^2 d
    h200 = GPUS["h200-141gb"]
    out += ["", f"Attention forward, one layer of dense_1p3b (B {b}, {h} heads, S {s}, head dim {d}, bf16): "
            f"{flops / 1e9:.0f} GFLOP causal, {flops / h200.bf16_tflops / 1e9:.3f} ms at the H200's bf16 peak", "",
            "| kernel | HBM bytes | ms at 4.8 TB/s | kept for backward |", "|---|---|---|---|"]
    kept = {"unfused": f"{b * h * s * s * 2 / 1e9:.2f} GB (the probabilities; x 24 layers: "
                       f"{24 * b * h * s * s * 2 / 1e9:.1f} GB)",
            "tiled": f"{b * h * s * 4 / 1e6:.2f} MB (the log-sum-exp)", "tiled_l2": "as tiled"}
    names = {"unfused": "unfused (eager math)", "tiled": f"tiled, {QUERY_BLOCK}-row query blocks, no L2 reuse",
             "tiled_l2": "tiled, K and V from L2"}
    for kind in ("unfused", "tiled", "tiled_l2"):
        nbytes = attention_hbm_bytes(b, h, s, d, 2, kind)
        out.append(f"| {names[kind]} | {nbytes / 1e9:.3f} GB | {nbytes / h200.hbm_tb_s / 1e9:.3f} | {kept[kind]} |")
    t, f, hid = 8 * 2048, 5504, 2048
    # model/transformer.py's RMSNorm in eager, bytes per element of the (T, h) input: x.float()
    # 2 + 4, pow 4 + 4, mean 4, x * rsqrt 4 + 4, .to(bf16) 4 + 2, weight * 2 + 2; fused: 2 + 2.
    norm = {"eager (6 kernels)": 36, "fused (one kernel)": 4}
    out += ["", f"RMSNorm of dense_1p3b ({t} x {hid}, bf16 in and out, fp32 inside): "
            + "; ".join(f"{k}: {n * t * hid / 1e6:.0f} MB, {n * t * hid / h200.hbm_tb_s / 1e9:.3f} ms at 4.8 TB/s"
                        for k, n in norm.items())]
    swiglu = {"eager (silu writes a temporary)": 5, "fused (one kernel)": 3}      # tensor passes of (T, F)
    gemms_ms = 2 * matmul_flops(t, hid, f) / h200.bf16_tflops / 1e9
    out += ["", f"SwiGLU product silu(gate) * up of dense_1p3b ({t} x {f}, bf16; about 0.8 FLOP/byte): "
            + "; ".join(f"{k}: {n * t * f * 2 / 1e6:.0f} MB, {n * t * f * 2 / h200.hbm_tb_s / 1e9:.3f} ms "
                        "at 4.8 TB/s" for k, n in swiglu.items())
            + f"; its gate and up GEMMs: {gemms_ms:.3f} ms at the bf16 peak"]
    return "\n".join(out)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    p.add_argument("--size", choices=sorted(MODELS), default=None,
                   help="gpu or tiny (default: gpu on cuda, tiny on cpu)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="skip a measurement predicted to end past this many seconds from the process "
                        "start (the suite's cap less a margin); each dtype's smallest one always runs")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads for the CPU's kernels (default 1: on a shared CPU a second OpenMP "
                        "thread waits for a core and stalls every call)")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--roofline", action="store_true", help="print the roofline arithmetic only (no device)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.roofline:
        print(roofline_text())
        return 0
    name = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cuda", "cpu") or (name == "cuda" and not torch.cuda.is_available()):
        print(f"error: gpu_microbench.py: --device {name}: not a device here; use --device cpu, or cuda "
              "on a machine with a GPU", file=sys.stderr)
        return 2
    device = torch.device(name)
    torch.set_num_threads(args.threads)
    size = args.size or ("gpu" if device.type == "cuda" else "tiny")
    result = measure(size, device, args.budget_s)
    result["wall_s"] = time.perf_counter() - T0
    print(tables(result))
    print(f"\n{result['wall_s']:.1f} s in all")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
