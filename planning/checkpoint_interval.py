"""How often to save: the checkpoint interval that minimises the expected lost time (Young, Daly).

    python launch/estimate_memory.py --checkpoint-interval --failures-per-node-day F --nodes N
                                     (--run-dir D | --save-stall-s S --step-time-s T) [--restart-s R]

The model (J. W. Young, "A first order approximation to the optimum checkpoint interval", Comm.
ACM 17(9), 1974; J. T. Daly, "A higher order estimate of the optimum checkpoint interval for
restart dumps", Future Generation Computer Systems 22(3), 2006): the job computes for ``tau``
seconds, then stops for ``delta`` seconds to save (the save stall, ``save_stall_s`` in the run's
``metrics.jsonl``); failures of the job arrive independently of each other and of the job's
progress, exponentially distributed with mean ``M`` seconds (``M = 1 / (failures per node-day x
nodes)`` days: any node's failure stops the synchronous job); each failure costs ``R`` seconds
(``restart_s``: the requeue, the restart, the load, and for a save in the background the time until
its files are durable) and the work done since the last checkpoint.

- Young: ``tau = sqrt(2 delta M)``, the minimum of the first-order loss ``delta/tau + tau/(2M)``.
- Daly: ``tau = sqrt(2 delta M) (1 + sqrt(delta/(2M))/3 + delta/(18 M)) - delta`` for
  ``delta < 2M``, else ``tau = M``: the minimum of the exact loss below, to higher order.
- The expected fraction of wall time lost at an interval ``tau`` (``lost_fraction``), from
  Daly's expected wall time per segment of ``tau`` seconds of work, ``M e^(R/M) (e^((tau+delta)/M) - 1)``:
  ``1 - tau / (M e^(R/M) (e^((tau+delta)/M) - 1))``. ``R`` scales the loss but does not move
  the minimum.

In steps: ``tau / step_time_s`` (the median ``step_time_s`` of the run, which does not include the
save), rounded: the recipe key ``train.save_every``. Bad inputs raise ``ValueError`` with one line.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

DAY_S = 86400.0
MULTIPLES = (0.25, 0.5, 1.0, 2.0, 4.0)      # the intervals, as multiples of Daly's, the curve is shown at


def mtbf_s(failures_per_node_day: float, nodes: int) -> float:
    """The job's mean time between failures in seconds: any of its ``nodes`` failing stops it."""
    if not failures_per_node_day > 0 or not math.isfinite(failures_per_node_day):
        raise ValueError(f"--failures-per-node-day must be a positive number, not {failures_per_node_day}")
    if nodes < 1:
        raise ValueError(f"--nodes must be at least 1, not {nodes}")
    return DAY_S / (failures_per_node_day * nodes)


def young_interval(delta: float, mtbf: float) -> float:
    """Young's first-order optimum: ``sqrt(2 delta M)`` seconds of work between checkpoints."""
    return math.sqrt(2.0 * delta * mtbf)


def daly_interval(delta: float, mtbf: float) -> float:
    """Daly's higher-order optimum (``M`` itself once ``delta >= 2M``)."""
    if delta >= 2.0 * mtbf:
        return mtbf
    ratio = delta / (2.0 * mtbf)
    return young_interval(delta, mtbf) * (1.0 + math.sqrt(ratio) / 3.0 + ratio / 9.0) - delta


def lost_fraction(tau: float, delta: float, mtbf: float, restart: float = 0.0) -> float:
    """The expected fraction of wall time not spent on new work (save stalls, work redone after
    failures, restarts) when saving after every ``tau`` seconds of work."""
    if not tau > 0:
        raise ValueError(f"the checkpoint interval must be positive, not {tau}")
    wall_per_segment = mtbf * math.exp(restart / mtbf) * math.expm1((tau + delta) / mtbf)
    return 1.0 - tau / wall_per_segment


def _positive(name: str, value: float) -> float:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive number of seconds, not {value}")
    return float(value)


def read_run(run_dir: str | Path) -> dict:
    """The median save stall and step time a run logged in ``<run_dir>/metrics.jsonl``: the rows
    ``{"step", "save_stall_s"}`` the trainer writes after each save (``training/run/trainer.py``)
    and ``step_time_s`` of every step row (``training/step/stepper.py``). The run's last save
    waits for its files in both save modes, so it is left out when others were logged."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{path} does not exist: --run-dir must name a run that has trained "
                         f"(or give --save-stall-s and --step-time-s)")
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:        # a killed run's last line may be cut
            continue
        if isinstance(row, dict):
            rows.append(row)
    saves = [(r.get("step", 0), r["save_stall_s"]) for r in rows
             if isinstance(r.get("save_stall_s"), (int, float))]
    steps = [r["step_time_s"] for r in rows if isinstance(r.get("step_time_s"), (int, float))]
    if not saves:
        raise ValueError(f"{path} has no save_stall_s row: the run saved no checkpoint "
                         f"(train.save_every: 0?); give --save-stall-s")
    if not steps:
        raise ValueError(f"{path} has no step_time_s row: give --step-time-s")
    last = max(step for step, _ in saves)
    kept = [s for step, s in saves if step != last] or [s for _, s in saves]
    return {"save_stall_s": statistics.median(kept), "saves": len(kept),
            "step_time_s": statistics.median(steps), "steps": len(steps)}


def checkpoint_interval(failures_per_node_day: float, nodes: int, save_stall_s: float | None = None,
                        step_time_s: float | None = None, run_dir: str | Path | None = None,
                        restart_s: float = 0.0) -> dict:
    """Young's and Daly's intervals in seconds, Daly's in steps and as ``train.save_every``, and
    the expected lost fraction at multiples of it. ``save_stall_s`` and ``step_time_s`` given
    override the run's figures (``run_dir``); without a run both are needed."""
    if failures_per_node_day is None:
        raise ValueError("--checkpoint-interval needs --failures-per-node-day F "
                         "(failures of one node per day; docs/checkpoints.md#how-often-to-save)")
    mtbf = mtbf_s(failures_per_node_day, nodes)
    measured = {}
    if save_stall_s is None or step_time_s is None:
        if run_dir is None:
            raise ValueError("--checkpoint-interval needs --run-dir D, or both --save-stall-s S "
                             "and --step-time-s T")
        measured = read_run(run_dir)
    delta = _positive("--save-stall-s", measured["save_stall_s"] if save_stall_s is None else save_stall_s)
    step = _positive("--step-time-s", measured["step_time_s"] if step_time_s is None else step_time_s)
    if not (math.isfinite(restart_s) and restart_s >= 0):
        raise ValueError(f"--restart-s must be zero or a positive number of seconds, not {restart_s}")
    young, daly = young_interval(delta, mtbf), daly_interval(delta, mtbf)
    save_every = max(1, round(daly / step))
    return {
        "failures_per_node_day": failures_per_node_day, "nodes": nodes, "mtbf_s": mtbf,
        "save_stall_s": delta, "step_time_s": step, "restart_s": restart_s,
        "measured": measured or None, "run_dir": str(run_dir) if measured else None,
        "young_s": young, "daly_s": daly, "daly_steps": daly / step, "save_every": save_every,
        "lost_at_save_every": lost_fraction(save_every * step, delta, mtbf, restart_s),
        "curve": [{"multiple": k, "interval_s": k * daly,
                   "lost_fraction": lost_fraction(k * daly, delta, mtbf, restart_s)} for k in MULTIPLES],
    }


def _pct(x: float) -> str:
    return f"{100 * x:.3g}%"


def format_interval(r: dict) -> str:
    """The report ``launch/estimate_memory.py --checkpoint-interval`` prints."""
    source = "given"
    if r["measured"]:
        m = r["measured"]
        source = (f"from {r['run_dir']}/metrics.jsonl: median of {m['saves']} saves, "
                  f"{m['steps']} steps")
    lines = [
        (f"checkpoint interval: save stall {r['save_stall_s']:.4g} s, step {r['step_time_s']:.4g} s "
         f"({source}); restart {r['restart_s']:.4g} s per failure"),
        (f"{r['nodes']} nodes x {r['failures_per_node_day']:.4g} failures per node-day: mean time "
         f"between failures {r['mtbf_s']:,.0f} s ({r['mtbf_s'] / 3600:.3g} h)"),
        f"  Young  sqrt(2 x stall x MTBF): {r['young_s']:,.1f} s",
        f"  Daly   (higher order):         {r['daly_s']:,.1f} s = {r['daly_steps']:,.1f} steps",
        "expected time lost (save stalls, work redone after failures, restarts), by interval:",
    ]
    for point in r["curve"]:
        mark = "   <- Daly" if point["multiple"] == 1.0 else ""
        lines.append(f"  {point['multiple']:>5g} x {point['interval_s']:>12,.1f} s   "
                     f"{_pct(point['lost_fraction']):>8}{mark}")
    lines.append(f"set: train.save_every={r['save_every']} ({r['save_every'] * r['step_time_s']:,.1f} s "
                 f"of steps between saves; expected {_pct(r['lost_at_save_every'])} of the time lost)")
    return "\n".join(lines)
