"""Run by test_global_balance.py in its own process: the real engine and ``Stepper`` on a tiny
Mixtral with ``model.moe.balance_over: global_batch`` and 2 accumulation steps. Prints one JSON
line: after each optimizer step, every MoE layer's count of micro-batches in its running window
(``StepCounts``), which ``Stepper.train_step`` must reset at the start of each step."""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from model.moe.layer import MoELayer  # noqa: E402
from training.run.preflight import plan_for  # noqa: E402
from training.run.trainer import Run  # noqa: E402

run = Run(plan_for("ds_configs/zero1_fp32.json", sets=[
    "model.hidden_size=32", "model.num_layers=2", "model.ffn_hidden_size=32", "model.max_seq_len=16",
    "data.seq_len=16", "train.steps=3", "model.moe.balance_over=global_batch",
    "ds.train_micro_batch_size_per_gpu=2", "ds.gradient_accumulation_steps=2"]))
run.join_job()
run.build_model()
stepper, model = run.build_stepper(), run.model
gen = torch.Generator().manual_seed(0)
windows = []
for step in (1, 2, 3):
    batches = [(ids, ids) for ids in (torch.randint(0, 4096, (2, 16), generator=gen) for _ in range(2))]
    stepper.train_step(step, batches)
    windows.append([m.step_counts.micro_batches for m in model.modules() if isinstance(m, MoELayer)])
print("RESULT " + json.dumps(windows))
