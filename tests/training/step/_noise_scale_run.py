"""Run by test_noise_scale.py on every rank: ``launch.train.main(argv)``, and at step 1, before the
trainer's step, an independent computation of this rank's first micro-batch gradient: plain
autograd of the mean token cross-entropy on the same (initial) weights, with
``torch.autograd.grad`` so that no ``.grad`` and no DeepSpeed hook is touched. Writes
``{"small_sq": |g|^2, "tokens": n}`` to ``$GNS_REPLAY.<rank>.json``.
"""

import json
import os
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

from launch import train  # noqa: E402
from training.step import stepper  # noqa: E402

_original = stepper.Stepper.train_step


def _replay_then_step(self, step, batches):
    if step == 1:
        input_ids, labels = batches[0]
        params = [p for p in self.model.parameters() if p.requires_grad]
        with torch.random.fork_rng():
            out = self.model(input_ids.to(self.ctx.device), labels.to(self.ctx.device))
        loss = out.ce_sum / out.num_target_tokens
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        small_sq = sum(float(g.double().pow(2).sum()) for g in grads if g is not None)
        result = {"small_sq": small_sq, "tokens": int(out.num_target_tokens),
                  "nominal": input_ids.numel()}
        Path(f"{os.environ['GNS_REPLAY']}.{self.ctx.rank}.json").write_text(json.dumps(result))
    return _original(self, step, batches)


stepper.Stepper.train_step = _replay_then_step

if __name__ == "__main__":
    sys.exit(train.main(sys.argv[1:]))
