"""W&B tracking: wandb's own credential lookup decides online or offline, offline runs say how
to upload, and ``extra`` (each MoE layer's router statistics) reaches the W&B history.

Each case runs in a fresh process with its own ``HOME``: wandb keeps its credentials and
settings per process.
"""

import json
import os
import subprocess
import sys

from tests.launch.test_train import wandb_history
from tests.runs import REPO

MODE = "from training.tracking import _wandb_mode; print(_wandb_mode())"
OFFLINE_RUN = """
import sys, types
from training.tracking import Tracker
tracking = types.SimpleNamespace(wandb=True, project="p", entity=None, run_name=None, tags=("t",))
tracker = Tracker(sys.argv[1], True, tracking, {"k": 1})
tracker.log({"step": 1, "loss": 2.5}, {"moe/layer1/load_max_over_mean": 1.25,
                                       "moe/layer1/tokens_per_expert": [3, 1, 0, 4]})
tracker.close()
"""


def _python(code: str, home, *args, **env_changes) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(HOME=str(home), WANDB_SILENT="true", **env_changes)
    out = subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_no_credentials_logs_offline_under_the_run_dir_with_the_sync_hint(tmp_path):
    home, run_dir = tmp_path / "home", tmp_path / "run"
    home.mkdir()
    run_dir.mkdir()
    assert _python(MODE, home).strip() == "('offline', 'no W&B credentials found')"
    stdout = _python(OFFLINE_RUN, home, str(run_dir))
    [line] = [x for x in stdout.splitlines() if x.startswith("W&B:")]
    [offline] = list((run_dir / "wandb").glob("offline-run-*"))
    assert line.startswith("W&B: no W&B credentials found, logging offline under ")
    assert line.endswith(f"upload later with: wandb sync {offline}")
    [row] = wandb_history(next(offline.glob("*.wandb")))
    assert row["loss"] == 2.5 and row["moe/layer1/load_max_over_mean"] == 1.25
    assert row["moe/layer1/tokens_per_expert"] == [3, 1, 0, 4]
    assert json.loads((run_dir / "metrics.jsonl").read_text()) == {"step": 1, "loss": 2.5}


def test_credentials_found_by_wandb_mean_online_unless_wandb_mode_says_otherwise(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    netrc = home / ".netrc"
    netrc.write_text(f"machine api.wandb.ai\n  login user\n  password {'0' * 40}\n")
    netrc.chmod(0o600)
    assert _python(MODE, home).strip() == "('online', None)"
    assert _python(MODE, home, WANDB_MODE="offline").strip() == "('offline', 'WANDB_MODE=offline')"
    assert _python(MODE, home, WANDB_MODE="disabled").strip() == "('disabled', 'WANDB_MODE=disabled')"
