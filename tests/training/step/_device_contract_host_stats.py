"""``_device_contract_run.py`` with the trainer's statistics vector made on the host (the bug
the contract guards against): test_device_contract.py checks that it is reported."""

import runpy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from training.step import stepper  # noqa: E402


def host_stats(self, device):
    return torch.zeros(self.stats.size, dtype=torch.float64, device="cpu")


stepper.Stepper._stats_vector = host_stats
runpy.run_path(str(Path(__file__).with_name("_device_contract_run.py")), run_name="__main__")
