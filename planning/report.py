"""What ``launch/estimate_memory.py`` prints: one estimate's per-GPU breakdown and the planner's
ranked layouts (``planning/estimator.py`` computes both)."""

from __future__ import annotations

from planning.estimator import GB


def _gb(x: float) -> str:
    return f"{x / GB:8.2f}"


def format_estimate(est: dict) -> str:
    w = est["worst"]
    p, s, act, buf = w["params"], w["states"], w["activations"], w["buffers"]
    sp = "on" if est["sequence_parallel"] else "off"
    lines = [
        f"{est['recipe']}: {est['params_total'] / 1e9:.2f}B parameters "
        f"({est['params_active'] / 1e9:.2f}B active) on {est['gpus']} x {est['gpu']} "
        f"({est['gpus_per_node']} per node)",
        f"layout: tp {est['tp']} ep {est['ep']} pp {est['pp']} sp {sp}"
        + (f" cp {est['cp']} ({est['cp_comm']})" if est.get("cp", 1) > 1 else "")
        + f" | ZeRO-{est['zero_stage']} over dp x cp = {est['dp']} x {est.get('cp', 1)} = {est['zero_dp']}"
        + f" (dp = gpus / (tp x ep x cp x pp)) | {est['precision']}",
        f"batch: micro {est['micro_batch']} x seq {est['seq_len']} ({act['tokens_per_rank']:.0f} tokens "
        f"per rank), accumulation {est['accumulation']}, activation checkpointing "
        f"{est['activation_checkpointing']}",
        f"pipeline stage {w['stage']} (the heaviest): {p['total'] / 1e9:.3f}B params per rank "
        f"({p['expert'] / 1e9:.3f}B expert, {p['other'] / 1e9:.3f}B other)",
        "", "per GPU                                       GB"]
    rows = [("parameters", s["params"]), ("gradients", s["grads"]),
            ("optimizer states", s["optimizer"]),
            *([("gradient compression state (PowerSGD)", s["compression"])] if s.get("compression") else []),
            (f"activations ({act['in_flight_micro_batches']} micro-batch(es) in flight)", act["total"]),
            ("  blocks kept for backward", act["blocks"]),
            ("  recompute of one block/sub-layer", act["recompute"]),
            ("  final norm, fp32 logits, token ids", act["head"]),
            ("  returned logits + their fp32 grad", act["logits_transient"]),
            ("buffers: reduce bucket(s)", buf["reduce_bucket"]),
            ("buffers: ZeRO-3 gathered params", buf["zero3_gather"]),
            ("buffers: all-to-all", buf["all_to_all"]),
            ("buffers: optimizer step (no activations)", buf["optimizer_step"]),
            ("total", w["gpu_total"])]
    lines += [f"  {name:<44}{_gb(v)}" for name, v in rows]
    per_block = ", ".join(f"{k} {v / GB:.3f}" for k, v in act["per_block"].items())
    lines.append(f"  one block, one micro-batch, no checkpointing: {per_block}")
    lines.append(f"  usable: {est['gpu_memory'] / GB:.0f} GB - {est['reserve_fraction']:.0%} reserve "
                 f"(CUDA context, NCCL, fragmentation) = {est['usable'] / GB:.1f} GB -> "
                 f"{'fits' if est['fits'] else 'DOES NOT FIT'}")
    if len(est["stages"]) > 1:
        lines.append("  totals per stage: " + ", ".join(
            f"stage {st['stage']} {st['gpu_total'] / GB:.2f}" for st in est["stages"]))
    if w["cpu"]:
        lines.append(f"  CPU (offload): {w['cpu'] / GB:.2f} GB per rank, "
                     f"{est['cpu_per_node'] / GB:.1f} GB per node")
    pred = est.get("predicted")
    if pred:
        lines.append(f"  predicted step (planning/cost_model.py, {est['gpu']}): {pred['step_s']:.3f} s, "
                     f"{pred['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU, MFU {pred['mfu']:.1%} "
                     f"(attention whole: {pred['mfu_full_attn']:.1%}); compute "
                     f"{pred['compute_s']:.3f} s, bubble {pred['bubble_s']:.3f} s, exposed "
                     + ", ".join(f"{k} {pred[f'{k}_comm_s']:.3f} s" for k in ("tp", "dp", "ep", "pp", "cp")))
    b = est["build"]
    lines.append(f"  build (before deepspeed.initialize): {b['host_per_rank'] / GB:.2f} GB host per "
                 f"rank ({b['host_per_node'] / GB:.0f} of {b['host_memory'] / GB:.0f} GB per node), "
                 f"{b['device'] / GB:.2f} GB per GPU -> "
                 + ("fits" if b["fits"] else f"DOES NOT FIT: {b['reason']}"))
    return "\n".join(lines)


BREAKDOWN = (("compute", "compute_s"), ("bubble", "bubble_s"), ("tp comm", "tp_comm_s"),
             ("dp comm", "dp_comm_s"), ("ep comm", "ep_comm_s"), ("pp comm", "pp_comm_s"),
             ("cp comm", "cp_comm_s"), ("optimizer", "optimizer_s"))


def why_first(best: dict, second: dict) -> str:
    """One line: where the runner-up's step is longer than the best layout's and where shorter,
    largest first."""
    diffs = [(second[k] - best[k], name) for name, k in BREAKDOWN]
    more = sorted((d, n) for d, n in diffs if d >= 0.005)[::-1]
    less = sorted((d, n) for d, n in diffs if d <= -0.005)
    parts = ([f"more on {', '.join(f'{n} +{d:.2f} s' for d, n in more)}"] if more else []) + \
            ([f"less on {', '.join(f'{n} {d:.2f} s' for d, n in less)}"] if less else [])
    return (f"#1 over #2: {second['step_s'] - best['step_s']:.2f} s shorter per step"
            + (f" (#2 spends {'; '.join(parts)})" if parts else ""))


def format_plan(result: dict, command: str, note: str) -> str:
    lines = [f"{result['recipe']} on {result['nodes']} x {result['gpus_per_node']} {result['gpu']} "
             f"({result['network_gbit_s']:.0f} Gb/s per node): {result['fitting']} of "
             f"{result['considered']} layouts fit; global batch {result['global_batch']} sequences; "
             f"ranked by predicted tokens/s per GPU (planning/cost_model.py; MoE imbalance "
             f"{result['moe_imbalance']:g})", "",
             " # ZeRO tp sp ep pp cp          dp micro  acc ckpt       mem GB  step s compute bubble"
             "  tp-comm dp-comm ep-comm pp-comm cp-comm  optim tok/s/GPU  MFU  MFU-12"]
    for i, r in enumerate(result["layouts"], 1):
        cp = f"{r.get('cp', 1)}" + (f" {r['cp_comm']:<9}" if r.get("cp", 1) > 1 else " " * 10)
        lines.append(f"{i:2d} {r['zero_stage']:4d} {r['tp']:2d} {'on' if r['sp'] else '--'} {r['ep']:2d} {r['pp']:2d} {cp:<11} {r['dp']:3d}"
                     f" {r['micro_batch']:5d} {r['accumulation']:4d} {r['activation_checkpointing']:<9}"
                     f" {r['gpu_total'] / GB:7.1f} {r['step_s']:7.2f} {r['compute_s']:7.2f}"
                     f" {r['bubble_s']:6.2f} {r['tp_comm_s']:8.2f} {r['dp_comm_s']:7.2f}"
                     f" {r['ep_comm_s']:7.2f} {r['pp_comm_s']:7.2f} {r['cp_comm_s']:7.2f} {r['optimizer_s']:6.2f}"
                     f" {r['tokens_per_s_per_gpu']:9.0f} {r['mfu']:4.0%} {r['mfu_full_attn']:6.0%}")
    refused = result.get("refused") or []
    if refused:
        r = refused[0]
        lines.append(f"refused: {len(refused)} (ZeRO stage, tp, ep, pp) whose build does not fit, "
                     f"e.g. ZeRO-{r['zero_stage']} tp {r['tp']} ep {r['ep']} pp {r['pp']}: {r['reason']}")
    if not result["layouts"]:
        return "\n".join(lines + ["no layout fits: add GPUs, or offload (ds_configs/zero3_offload.json)"])
    best = result["layouts"][0]
    b = best["breakdown"]
    lines += ["", "compute of #1 per step: " + ", ".join(
        f"{k} {b[k]:.2f} s" for k in ("gemm", "attention", "elementwise", "recompute", "head")
        if b.get(k)) + "; MFU counts attention causal, 3 L s (w_qk + w_v), and whole (MFU-12), 6 L s (w_qk + w_v)"]
    if len(result["layouts"]) > 1:
        lines.append(why_first(best, result["layouts"][1]))
    return "\n".join(lines + ["", "best:", command] + ([note] if note else []))
