"""Out of memory during training: a report on every rank that hit it, and the next layout to try.

``launch/train.py`` catches ``torch.OutOfMemoryError`` (GPU) and the CPU allocator's "can't
allocate memory" ``RuntimeError`` (``is_out_of_memory``) around the run and calls ``report``, which
writes ``<run-dir>/oom_report.md`` and ``oom_report.json`` (``oom_report.rank<R>.*`` on ranks
R > 0) and returns the one line the trainer prints before it exits with code ``EXIT_CODE``:

    error: out of memory at step 3 (rank 0); report: runs/x/oom_report.md; next try: ...

The report holds:

- where: step, micro-batch and phase (forward, backward, optimizer step, pipeline schedule,
  evaluation, checkpoint save or load, start-up), as the trainer last recorded them in its
  ``training.step.stepper.StepContext``; a field the run had not reached yet is null;
- the layout: world, tp/ep/cp/pp/dp, ZeRO stage, precision, micro-batch, accumulation, sequence
  length, activation checkpointing;
- the estimator's per-GPU breakdown for this run (``planning/estimator.estimate``) next to the
  allocator's figures: ``torch.cuda.memory_stats`` and ``mem_get_info`` on a GPU, and the
  process's RSS and peak RSS (``/proc/self/status``) always;
- the ``TOP_TENSORS`` largest live tensors of a ``gc`` scan (``planning/live_tensors.py``), one row
  per storage, named when they are model parameters, their gradients, optimizer states or
  buffers of DeepSpeed's ZeRO optimizer;
- on a GPU, ``torch.cuda.memory._dump_snapshot`` (with the stack trace of every allocation when
  ``train.memory_snapshot`` switched the allocator's history on at start, see
  ``training.run.host.record_memory_history``); drop the file on https://pytorch.org/memory_viz;
- the next layout to try (``planning/next_layout.py``): "fits" compares the estimate, with its
  activations and buffers scaled by how far the estimator fell short on this run (the allocator
  needed at least what it held plus the failed request), with the device's memory less
  ``RESERVE_FRACTION``; on a CPU the device is this process's share of the machine's memory;
- the traceback.

Besides the report only ``oom_snapshot*.pickle`` and ``oom_next_ds_config.json`` are written:
``checkpoints/`` and ``metrics.jsonl`` stay as the last completed step left them, so the same
command resumes from the last checkpoint. Ranks still waiting in a collective for this one are
stopped by the launcher (torchrun and deepspeed end the job when a process exits non-zero).
"""

from __future__ import annotations

import json
import os
import re
import resource
import traceback
from pathlib import Path

import torch

from planning import live_tensors
from planning import memory_model as mm
from planning.estimator import GB, RESERVE_FRACTION, estimate
from planning.next_layout import atomic_write, cost, gpus_per_node, suggest
from training.gpus import GPUS
from training.step.stepper import StepContext

EXIT_CODE = 3
TOP_TENSORS = 20
_CPU_OOM = re.compile(r"DefaultCPUAllocator: (can't allocate memory|not enough memory)")
_REQUEST = re.compile(r"[Tt]ried to allocate ([\d.]+) (bytes|KiB|MiB|GiB|TiB)")
_UNITS = {"bytes": 1, "KiB": 2 ** 10, "MiB": 2 ** 20, "GiB": 2 ** 30, "TiB": 2 ** 40}


def is_out_of_memory(err: BaseException) -> bool:
    """A GPU OOM, or the CPU allocator failing (a plain ``RuntimeError`` from c10)."""
    return isinstance(err, torch.OutOfMemoryError) or (
        isinstance(err, RuntimeError) and bool(_CPU_OOM.search(str(err))))


def report(err: BaseException, plan, args, where: StepContext | None = None) -> str:
    """Write this rank's OOM report into ``plan.run_dir``; return the one-line error message.

    Args:
        err: the out-of-memory exception, with its traceback.
        plan: ``training.run.preflight.Plan`` (recipe, resolved DeepSpeed config, run dir, world).
        args: the trainer's parsed arguments (to print the next command).
        where: what the trainer last recorded: step, micro-batch, phase, and the objects it
            had built (process groups, model, engine); None before it started.
    """
    where = where if where is not None else StepContext()
    ctx = where.dist
    rank = ctx.rank if ctx is not None else int(os.environ.get("RANK", "0"))
    device = ctx.device if ctx is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    suffix = "" if rank == 0 else f".rank{rank}"
    run_dir = Path(plan.run_dir)
    _safe(lambda: run_dir.mkdir(parents=True, exist_ok=True))     # an OOM at start-up
    rep = {"error": str(err).strip(), "rank": rank, "where": _where(where),
           "layout": _safe(_layout, plan, device, ctx), "allocator": _safe(_allocator, device)}
    rep["estimate"] = _safe(_estimate, plan, ctx, device, rep["allocator"], _requested_bytes(str(err)))
    rep["largest_tensors"] = _safe(live_tensors.largest, where.model, where.engine, TOP_TENSORS)
    rep["snapshot"] = _safe(_snapshot, device, run_dir / f"oom_snapshot{suffix}.pickle",
                            plan.recipe.train.memory_snapshot)
    rep["suggestion"] = (_safe(suggest, plan, args, device, rep["estimate"]) if "error" not in rep["estimate"]
                         else {"error": f"no estimate: {rep['estimate']['error']}"})
    rep["traceback"] = "".join(traceback.format_exception(err))
    md_path = _write(rep, run_dir, suffix)
    next_try = rep["suggestion"].get("next_try") or "see the report"
    return f"error: out of memory at {rep['where']['at']} (rank {rank}); report: {md_path}; next try: {next_try}"


def _write(rep: dict, run_dir: Path, suffix: str) -> Path | str:
    """Write the JSON and markdown report; return the markdown's path (or why it is missing)."""
    try:
        text = _markdown(rep)
    except Exception as e:                                  # noqa: BLE001
        text = f"# Out of memory\n\nNot rendered ({type(e).__name__}: {e}); see oom_report{suffix}.json.\n"
    md_path = run_dir / f"oom_report{suffix}.md"
    try:
        atomic_write(run_dir / f"oom_report{suffix}.json", json.dumps(rep, indent=1, default=str) + "\n")
        atomic_write(md_path, text)
    except OSError as e:
        return f"not written ({e})"
    return md_path


# ---------------------------------------------------------------------------------------------
# Where, layout, allocator.

def _where(where: StepContext) -> dict:
    out = {"step": where.step, "micro_batch": where.micro_batch,
           "micro_batches": where.micro_batches, "phase": where.phase}
    out["at"] = f"step {where.step}" if where.step is not None else where.phase
    return out


def _layout(plan, device: torch.device, ctx) -> dict:
    recipe, ds = plan.recipe, plan.ds
    par, zero = recipe.parallel, ds.get("zero_optimization") or {}
    return {"world_size": plan.world_size, "tp": par.tensor_parallel_size,
            "ep": par.expert_parallel_size, "cp": par.context_parallel_size, "pp": par.pipeline_parallel_size,
            "dp": plan.dp_size,
            "zero_stage": int(zero.get("stage", 0)), "precision": mm.precision_of(ds),
            "micro_batch": ds["train_micro_batch_size_per_gpu"],
            "accumulation": ds["gradient_accumulation_steps"],
            "train_batch_size": ds["train_batch_size"], "seq_len": recipe.seq_len,
            "activation_checkpointing": recipe.train.activation_checkpointing,
            "offload_optimizer": mm._offloaded(zero, "offload_optimizer"),
            "offload_param": mm._offloaded(zero, "offload_param"), "device": device.type,
            "gpu": ctx.gpu.name if ctx is not None and ctx.gpu is not None else None}


def _allocator(device: torch.device) -> dict:
    out = {"cpu": _cpu_memory()}
    if device.type == "cuda":
        s = torch.cuda.memory_stats(device)
        free, total = torch.cuda.mem_get_info(device)
        out["gpu"] = {"allocated": s.get("allocated_bytes.all.current", 0),
                      "allocated_peak": s.get("allocated_bytes.all.peak", 0),
                      "reserved": s.get("reserved_bytes.all.current", 0),
                      "reserved_peak": s.get("reserved_bytes.all.peak", 0),
                      "inactive_split": s.get("inactive_split_bytes.all.current", 0),
                      "alloc_retries": s.get("num_alloc_retries", 0), "ooms": s.get("num_ooms", 0),
                      "device_free": free, "device_total": total}
    return out


def _cpu_memory() -> dict:
    """Process RSS and peak RSS, and the machine's (or cgroup's) memory, in bytes."""
    status = _kib_fields("/proc/self/status", ("VmRSS", "VmHWM"))
    info = _kib_fields("/proc/meminfo", ("MemTotal", "MemAvailable"))
    peak = status.get("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    limit = None
    try:
        text = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        limit = int(text) if text.isdigit() else None
    except OSError:
        pass
    return {"rss": status.get("VmRSS"), "peak_rss": peak, "machine_total": info.get("MemTotal"),
            "machine_available": info.get("MemAvailable"), "cgroup_limit": limit}


def _kib_fields(path: str, names: tuple[str, ...]) -> dict:
    out = {}
    try:
        for line in Path(path).read_text().splitlines():
            key, _, value = line.partition(":")
            if key in names:
                out[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def _requested_bytes(message: str) -> int:
    """The failed request: "Tried to allocate 20.00 GiB" (CUDA), "tried to allocate N bytes"."""
    m = _REQUEST.search(message)
    return int(float(m.group(1)) * _UNITS[m.group(2)]) if m else 0


# ---------------------------------------------------------------------------------------------
# The estimate next to the allocator, and the budget a next layout must fit.

def _gpu_key(ctx, allocator: dict) -> str:
    if ctx is not None and ctx.gpu is not None:
        return ctx.gpu.name
    total = (allocator.get("gpu") or {}).get("device_total")
    if total:      # an unknown GPU: the table's entry closest in memory
        return min(GPUS, key=lambda k: abs(GPUS[k].memory_gb * GB - total))
    return "h100-80gb"       # on a CPU only the byte figures are used, not the GPU's size


def _estimate(plan, ctx, device: torch.device, allocator: dict, requested: int) -> dict:
    gpu = _gpu_key(ctx, allocator)
    est = estimate(plan.recipe, plan.ds, plan.world_size, gpus_per_node(plan), gpu)
    w = est["worst"]
    s, act, buf = w["states"], w["activations"], w["buffers"]
    if device.type == "cuda":
        g = allocator["gpu"]
        budget, held = g["device_total"] * (1 - RESERVE_FRACTION), g["allocated"]
    else:
        c = allocator["cpu"]
        total = min(x for x in (c["machine_total"], c["cgroup_limit"]) if x)
        local = int(os.environ.get("LOCAL_WORLD_SIZE", plan.world_size))
        budget, held = total / local * (1 - RESERVE_FRACTION), c["rss"]
    states, transient = cost(est, device)
    need = held + requested
    # How far the estimator fell short on this run, put on the part it models least well.
    scale = max(1.0, (need - states) / transient) if transient > 0 else 1.0
    return {"gpu_table_entry": gpu, "device": device.type, "stage": w["stage"],
            "breakdown": {"parameters": s["params"], "gradients": s["grads"],
                          "optimizer states": s["optimizer"],
                          "gradient compression state": s.get("compression", 0.0),
                          "activations": act["total"],
                          "  blocks kept for backward": act["blocks"],
                          "  recompute of one block/sub-layer": act["recompute"],
                          "  final norm, fp32 logits, token ids": act["head"],
                          "  returned logits + their fp32 grad": act["logits_transient"],
                          "buffers: reduce bucket(s)": buf["reduce_bucket"],
                          "buffers: ZeRO-3 gathered params": buf["zero3_gather"],
                          "buffers: all-to-all": buf["all_to_all"],
                          "buffers: optimizer step": buf["optimizer_step"],
                          "total per GPU": w["gpu_total"], "offloaded to CPU": w["cpu"]},
            "total": states + transient, "requested": requested, "held": held, "need": need,
            "budget": budget, "scale": scale}


# ---------------------------------------------------------------------------------------------
# The memory snapshot and the output.

def _snapshot(device: torch.device, path: Path, history: bool) -> dict:
    if device.type != "cuda":
        return {"path": None, "note": "no GPU: the CUDA allocator snapshot applies to GPU runs"}
    torch.cuda.memory._dump_snapshot(str(path))
    note = ("allocation stack traces included (train.memory_snapshot)" if history else
            "segments only; rerun with --set train.memory_snapshot=true for stack traces")
    return {"path": str(path), "note": f"{note}; open it on https://pytorch.org/memory_viz"}


def _safe(fn, *args) -> dict | list:
    """A section of the report; a failure is recorded in its place, never raised (the report is
    written while memory is exhausted)."""
    try:
        return fn(*args)
    except Exception as e:                                  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"}


def _gb(x) -> str:
    return "-" if x is None else f"{x / GB:.3f}"


def _markdown(rep: dict) -> str:
    w, snap = rep["where"], rep["snapshot"]
    micro = f"{w['micro_batch']} of {w['micro_batches']}" if w["micro_batch"] else "-"
    lines = [f"# Out of memory at {w['at']}, rank {rep['rank']}", "",
             "```", rep["error"].splitlines()[0] if rep["error"] else "", "```", "",
             "## Where", "", f"- step: {w['step']}", f"- micro-batch: {micro}",
             f"- phase: {w['phase']}", "", "## Layout", "", "| key | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in rep["layout"].items()]
    lines += _md_memory(rep["estimate"], rep["allocator"])
    lines += _md_tensors(rep["largest_tensors"])
    lines += ["", "## Memory snapshot", "",
              f"{snap.get('path') or '-'}: {snap.get('note') or snap.get('error')}"]
    lines += _md_next(rep["suggestion"])
    lines += ["", "## Traceback", "", "```", rep["traceback"].rstrip(), "```", ""]
    return "\n".join(lines)


def _md_memory(est: dict, alloc: dict) -> list[str]:
    lines = ["", "## Memory: estimate vs allocator (GB = 1e9 bytes)", ""]
    if "error" in est:
        lines.append(f"estimate unavailable: {est['error']}")
    else:
        lines += [f"Estimator (`planning/estimator.py`, heaviest pipeline stage {est['stage']}, "
                  f"{est['device']} device):", "", "| per GPU | GB |", "|---|---|"]
        lines += [f"| {k} | {_gb(v)} |" for k, v in est["breakdown"].items()]
    lines += ["", "Allocator:", "", "| figure | GB |", "|---|---|"]
    for group in ("gpu", "cpu"):
        lines += [f"| {group}: {k} | {v if k in ('alloc_retries', 'ooms') else _gb(v)} |"
                  for k, v in (alloc.get(group) or {}).items()]
    if "error" not in est:
        lines += ["", f"The failed request: {_gb(est['requested'])} GB on top of {_gb(est['held'])} GB "
                      f"held, so this rank needed at least {_gb(est['need'])} GB against an estimate "
                      f"of {_gb(est['total'])} GB; usable here: {_gb(est['budget'])} GB. The next "
                      f"layout's activations and buffers are scaled by {est['scale']:.2f} (the "
                      f"estimator's miss on this run)."]
    return lines


def _md_tensors(tensors: list | dict) -> list[str]:
    lines = ["", f"## Largest live tensors (gc scan, one row per storage, top {TOP_TENSORS})", "",
             "| MB | shape | dtype | device | name |", "|---|---|---|---|---|"]
    if isinstance(tensors, list):
        lines += [f"| {r['mb']:.2f} | {tuple(r['shape'])} | {r['dtype']} | {r['device']} "
                  f"| {r['name'] or ''} |" for r in tensors]
    else:
        lines.append(f"| - | - | - | - | {tensors['error']} |")
    return lines


def _md_next(sug: dict) -> list[str]:
    lines = ["", "## Next layout to try", ""]
    if "rungs" in sug:
        lines += ["| rung | change | estimate GB | status |", "|---|---|---|---|"]
        for r in sug["rungs"]:
            gb = "-" if r["estimate_gb"] is None else f"{r['estimate_gb']:.3f}"
            why = f": {r['reason']}" if r["reason"] else ""
            lines.append(f"| {r['rung']} | {r['change'] or '-'} | {gb} | {r['status']}{why} |")
        lines += ["", f"Usable: {sug['budget_gb']:.3f} GB; {'fits' if sug['fits'] else 'DOES NOT FIT'} "
                      f"at {sug['estimate_gb']:.3f} GB.", ""]
    lines.append(f"Next try: {sug.get('summary') or sug.get('next_try') or sug.get('error')}")
    if sug.get("command"):
        lines += ["", "```bash", sug["command"], "```"]
    if sug.get("ds_json_changes"):
        lines += ["", f"DeepSpeed JSON keys changed (written to `{sug['config']}`):", "", "```json",
                  json.dumps(sug["ds_json_changes"], indent=1), "```"]
    if sug.get("note"):
        lines += ["", f"Note: {sug['note']}."]
    return lines
