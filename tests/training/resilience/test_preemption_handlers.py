"""``training/resilience/preemption.py``'s handlers, in a process of their own."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]

LATE_SIGNAL = """
import os, signal, sys
from training.resilience.preemption import Preemption
p = Preemption(("SIGTERM", "SIGUSR1"), announce=False)
os.kill(os.getpid(), signal.SIGUSR1)      # during the run: recorded
assert p.received == "SIGUSR1", p.received
p.close()
os.kill(os.getpid(), signal.SIGUSR1)      # after the run, as it exits: ignored
assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL    # the others put back as they were
sys.exit(0)
"""


def test_a_launch_scripts_signal_after_the_run_does_not_kill_it():
    """A SIGUSR1 (the launch scripts' warning) that reaches a rank after ``Preemption.close``,
    while the finished run exits, is ignored: exit code 0, not -10 (the signal's default, which
    the script would read as a preempted run that saved nothing). SIGTERM gets its previous
    handler back."""
    done = subprocess.run([sys.executable, "-c", LATE_SIGNAL], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
