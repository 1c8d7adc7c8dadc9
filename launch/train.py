"""Train a dense, Switch or Mixtral transformer with DeepSpeed.

    deepspeed [launcher args] launch/train.py --config DS_JSON [--recipe RECIPE.yaml]
              [--run-dir DIR] [--steps N] [--set dotted.key=value ...] [--init-from DIR]

Also runs as ``torchrun --nproc_per_node N launch/train.py ...`` and as plain
``python launch/train.py ...`` (one process). The run is ``training/run/trainer.py`` (preflight ->
setup -> loop); this file reads the command line and turns the run's outcome into exit codes:
0 done; 2 bad input, one line, the run directory untouched; 3 out of memory, with a report and
the next layout to try (``planning/oom.py``); 74 a needed checkpoint could not be written; 75
preempted, its step saved; 76 a rank lost or stopped (``training/resilience/watchdog.py``). The
same command with the same run directory resumes from the newest checkpoint that verifies.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from planning import oom  # noqa: E402
from training.run.distributed import exit_now  # noqa: E402
from training.run.trainer import Run  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="DeepSpeed JSON (ZeRO, precision, batch, optimizer, scheduler)")
    p.add_argument("--recipe", default=None, help="recipe YAML (default: recipes/tiny_mixtral.yaml)")
    p.add_argument("--run-dir", default=None, help="output directory (default: runs/<recipe name>)")
    p.add_argument("--steps", type=int, default=None, help="override train.steps (optimizer steps)")
    p.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                   help="override recipe keys, e.g. --set train.seed=1 model.moe.top_k=1, and "
                        "DeepSpeed JSON keys with a ds. prefix, e.g. ds.optimizer.params.lr=3e-4")
    p.add_argument("--init-from", default=None,
                   help="init dir written by `convert_hf.py import` (weights + tokenizer)")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        run = Run.prepare(args)            # every check, before any process group or file
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        return run.train()
    except (ValueError, FileNotFoundError) as err:   # found late, e.g. a corrupted checkpoint
        print(f"error: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:                      # torch.OutOfMemoryError is one
        if oom.is_out_of_memory(err):
            print(oom.report(err, run.plan, args, run.where), file=sys.stderr)   # <run-dir>/oom_report.md
            return oom.EXIT_CODE
        raise                                        # (a lost peer is named and exits 76 inside run.train)


if __name__ == "__main__":
    exit_now(main())     # no interpreter finalization: see training/run/distributed.py exit_now
