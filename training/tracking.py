"""Run tracking: ``metrics.jsonl`` (always), Weights & Biases (optional), a progress line.

Only global rank 0 writes. ``metrics.jsonl`` is flushed after every row so a killed run keeps
every step it logged; on resume, rows after the checkpoint's step are dropped so the file reads
like one uninterrupted run.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import time
import uuid
from pathlib import Path

MFU_NOTE = ("MFU counts 6 x active matmul parameters per token (attention, routed experts, "
            "router, output head; not the input embedding) + 3 x layers x seq x (heads x "
            "query-key width + heads x value width) (causal attention; 6 x layers x hidden x seq "
            "when both widths are the hidden size), over the GPU's dense bf16 peak; mfu_full_attn "
            "counts attention whole, 6 x layers x seq x (the two widths), as torchtitan and most "
            "published MFU figures do")


def truncate_metrics(path: Path, last_step: int) -> None:
    """Keep only rows with ``step <= last_step`` (rows written after the resumed checkpoint)."""
    if not path.is_file():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue       # a line cut by a kill mid-write
        if row.get("step", 0) <= last_step:
            keep.append(line)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    os.replace(tmp, path)


def _wandb_mode() -> tuple[str, str | None]:
    """W&B's mode for this run and, when not online, why: ``WANDB_MODE`` when it says offline or
    disabled, else online when wandb itself finds credentials, offline when it finds none."""
    import wandb
    forced = os.environ.get("WANDB_MODE")
    if forced in ("offline", "dryrun", "disabled"):
        return ("disabled" if forced == "disabled" else "offline"), f"WANDB_MODE={forced}"
    # wandb's own lookup (WANDB_API_KEY, an identity token, its settings files, ~/.netrc), with
    # no prompt and no call to the server; wandb.api.api_key on releases before login(prompt=).
    if "prompt" in inspect.signature(wandb.login).parameters:
        found = wandb.login(prompt=False, verify=False)
    else:
        found = bool(wandb.api.api_key)
    return ("online", None) if found else ("offline", "no W&B credentials found")


ROUTER_FIELDS = ("tokens_per_expert", "load_max_over_mean", "router_entropy", "dropped_frac",
                 "router_logit_max", "router_lse")


def router_columns(extra: dict) -> dict:
    """Each MoE layer's router statistics from the W&B keys ``moe/layer{i}/<field>``, as
    ``{"blocks": [i, ...], "<field>": [value per block, ...]}`` for ``metrics.jsonl``
    (``tokens_per_expert``: the step's routed assignments per expert, summed over the ranks;
    ``expert_bias``, with loss-free balancing: the bias each expert's choice was shifted by)."""
    blocks = sorted({int(key.split("/")[1][len("layer"):]) for key in extra
                     if key.startswith("moe/layer")})
    bias = ("expert_bias",) if any(key.endswith("/expert_bias") for key in extra) else ()
    return {"blocks": blocks, **{name: [extra[f"moe/layer{b}/{name}"] for b in blocks]
                                 for name in ROUTER_FIELDS + bias}}


class Tracker:
    """Writes metric rows to ``metrics.jsonl`` and, when enabled, to W&B.

    Args:
        run_dir: the run directory.
        enabled: False on every rank but global rank 0.
        tracking: the recipe's ``tracking`` section (``wandb``, ``project``, ``run_name``,
            ``entity``, ``tags``), or None.
        config: the resolved config, logged to W&B.
        resume_step: the step a resumed run continues from (rows after it are dropped).
        router_every: every this many steps a row also carries each MoE layer's router
            statistics under ``moe_layers`` (``router_columns``); 0 never.
    """

    def __init__(self, run_dir: Path, enabled: bool, tracking=None, config: dict | None = None,
                 resume_step: int | None = None, run_name: str = "run", router_every: int = 0):
        self.enabled, self.router_every = enabled, router_every
        self.wandb_run = None
        self.path = Path(run_dir) / "metrics.jsonl"
        if not enabled:
            return
        if resume_step is not None:
            truncate_metrics(self.path, resume_step)
        elif self.path.exists():
            self.path.unlink()
        self.file = open(self.path, "a")
        if tracking is not None and tracking.wandb:
            self._init_wandb(Path(run_dir), tracking, config or {}, run_name)

    def _init_wandb(self, run_dir: Path, tracking, config: dict, run_name: str) -> None:
        import wandb
        mode, why = _wandb_mode()
        # Reusing the run id lets a resumed run append to the same W&B run.
        id_file = run_dir / "wandb_run_id"
        # A W&B sweep agent names the run it started (WANDB_RUN_ID).
        run_id = (id_file.read_text().strip() if id_file.is_file()
                  else os.environ.get("WANDB_RUN_ID") or uuid.uuid4().hex[:8])
        id_file.write_text(run_id)
        self.wandb_run = wandb.init(
            project=tracking.project, entity=tracking.entity, name=tracking.run_name or run_name,
            tags=list(tracking.tags), config=config, dir=str(run_dir), id=run_id, resume="allow",
            mode=mode)
        if mode == "offline":
            print(f"W&B: {why}, logging offline under {self.wandb_run.dir}; "
                  f"upload later with: wandb sync {Path(self.wandb_run.dir).parent}", flush=True)

    def log(self, row: dict, extra: dict | None = None) -> None:
        """Append one row to metrics.jsonl; W&B also gets ``extra`` (each MoE layer's router
        statistics, ``moe/layer{i}/...``, see ``StatsLayout.moe_metrics`` in training/step/stats.py;
        each layer's gradient norm, ``grad_norm/...``, training/step/layer_grads.py; each MTP
        depth's loss, ``mtp_loss/depth{k}``), and the row without its nested ``grad_norm_layers``
        and ``mtp_loss``, which those keys carry flat."""
        if not self.enabled:
            return
        if (extra and self.router_every and row["step"] % self.router_every == 0
                and any(key.startswith("moe/layer") for key in extra)):
            row = {**row, "moe_layers": router_columns(extra)}
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.wandb_run is not None:
            payload = {k: v for k, v in row.items() if k not in ("step", "grad_norm_layers", "mtp_loss")}
            payload.update(extra or {})
            self.wandb_run.log(payload, step=row["step"])

    def close(self) -> None:
        if not self.enabled:
            return
        self.file.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()


class Progress:
    """A progress line every ``every`` steps: loss, lr, grad norm, tokens/s, ETA."""

    def __init__(self, total_steps: int, every: int, start_step: int, enabled: bool):
        self.total, self.every, self.enabled = total_steps, max(1, every), enabled
        self.start_step, self.start_time = start_step, time.time()

    def update(self, row: dict) -> None:
        step = row["step"]
        if not self.enabled or (step % self.every and step != self.total):
            return
        done = step - self.start_step
        elapsed = time.time() - self.start_time
        eta = elapsed / max(done, 1) * (self.total - step)
        gn = row.get("grad_norm")
        parts = [f"step {step}/{self.total}", f"loss {row['loss']:.4f}", f"lr {row['lr']:.2e}",
                 f"grad_norm {gn:.3f}" if gn is not None and math.isfinite(gn) else "grad_norm n/a",
                 f"{row['tokens_per_s']:,.0f} tok/s"]
        if "aux_loss" in row:
            parts.append(f"aux {row['aux_loss']:.3f} load {row['expert_load_max_over_mean']:.2f}")
        if "mfu" in row:
            parts.append(f"mfu {100 * row['mfu']:.1f}%")
        parts.append(f"ETA {_fmt_time(eta)}")
        print(" | ".join(parts), flush=True)


def _fmt_time(seconds: float) -> str:
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"
