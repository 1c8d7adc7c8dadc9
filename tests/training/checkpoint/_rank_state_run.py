"""Run on every rank by test_checkpoint_state.py: ``launch.train.main(argv)`` with one more part
registered as per-rank checkpoint state, ``Tally`` (this rank's own list of ``rank * 1000 + step``
after every step), standing in for state such as a gradient compressor's error feedback. At the
end writes ``{"loaded": <the state a resume handed it, or null>, "final": <its state>}`` to
``$RANK_STATE_OUT.<rank>.json``."""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from launch import train  # noqa: E402
from training.checkpoint.state import TrainState  # noqa: E402
from training.run import trainer  # noqa: E402
from training.step.stepper import Stepper  # noqa: E402


class Tally:
    def __init__(self, rank: int):
        self.rank, self.steps, self.loaded = rank, [], None

    def state_dict(self) -> dict:
        return {"rank": self.rank, "steps": list(self.steps)}

    def load_state_dict(self, state: dict) -> None:
        self.loaded, self.steps = state, list(state["steps"])


TALLY = Tally(int(os.environ.get("RANK", "0")))


class WithTally(TrainState):
    def __init__(self, rank: int = 0):
        super().__init__(rank)
        self.register("tally", TALLY, per_rank=True)


train_step = Stepper.train_step


def counted(self, step, batches):
    TALLY.steps.append(TALLY.rank * 1000 + step)
    return train_step(self, step, batches)


trainer.TrainState = WithTally
Stepper.train_step = counted

if __name__ == "__main__":
    code = train.main(sys.argv[1:])
    Path(f"{os.environ['RANK_STATE_OUT']}.{TALLY.rank}.json").write_text(
        json.dumps({"loaded": TALLY.loaded, "final": TALLY.state_dict()}))
    sys.exit(code)
