"""A lost peer is named by the survivors even when the launcher's SIGTERM comes during the survey.

torchrun sends every surviving worker SIGTERM as soon as it sees one gone, while the survivors'
failed collective is still being turned into the one line that names the lost rank. The run
names it inside ``Run.train``, before its preemption handlers are put back, so that SIGTERM is
recorded, not fatal. Here the survey itself sends that SIGTERM (the worst moment): the process
must print the line and exit 76; with the default SIGTERM disposition it dies with -15 instead.
"""

from __future__ import annotations

import subprocess
import sys

from tests.runs import REPO, env

SCRIPT = r"""
import os, signal, sys
from launch import train
from training.resilience import watchdog
from training.run.distributed import exit_now
from training.run.trainer import Run

def setup(self):      # a collective loses its peer (the run installed its handlers first)
    assert self.signals is not None and signal.getsignal(signal.SIGTERM) == self.signals._handler
    raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer")

survey = watchdog.Watchdog._survey
def survey_under_sigterm(self):
    os.kill(os.getpid(), signal.SIGTERM)       # torchrun ends the survivors
    return survey(self)

Run.setup = setup
watchdog.Watchdog._survey = survey_under_sigterm
exit_now(train.main(["--config", "ds_configs/zero1_fp32.json", "--run-dir", sys.argv[1]]))
"""


def test_the_launchers_sigterm_during_the_survey_does_not_cut_the_line(tmp_path):
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "run")], cwd=REPO, env=env(),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 76, (out.returncode, out.stderr[-3000:])
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "lost during start-up" in errors[0] and "exit code 76" in errors[0], out.stderr
    assert "received SIGTERM" not in out.stderr           # recorded, not announced as a preemption
