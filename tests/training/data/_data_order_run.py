"""Run by tests/launch/test_train_data.py, on one process or under torchrun:

    _data_order_run.py OUT STEPS TRAIN_ARGS...

builds the trainer's data exactly as ``launch/train.py`` does (``train.prepare``, the process
groups, ``Run.build_data``) and writes ``OUT.rank<r>.npz``: this
rank's input ids of optimizer steps 0..STEPS-1 (STEPS x per-rank samples x seq_len), its
validation inputs, and ``tokens_by_source`` after each step (as JSON).
"""

import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from launch import train  # noqa: E402
from training.run.distributed import exit_now  # noqa: E402
from training.run.trainer import Run  # noqa: E402


def main() -> None:
    out, steps, argv = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    run = Run.prepare(train.parse_args(argv))
    ctx = run.join_job()
    run.build_data()
    sampler, val = run.sampler, run.val_batches
    ids = np.stack([torch.cat([i for i, _ in sampler.batches_for_step(s)]).numpy() for s in range(steps)])
    seen = [sampler.tokens_by_source(s + 1) for s in range(steps)]
    np.savez(f"{out}.rank{ctx.rank}.npz", ids=ids, val=torch.cat([i for i, _ in val]).numpy(),
             seen=json.dumps(seen), dp_rank=ctx.groups.dp_rank)
    run.finish()


if __name__ == "__main__":
    main()
    exit_now(0)
