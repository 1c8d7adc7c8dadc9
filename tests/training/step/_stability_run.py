"""Run by test_stability.py in its own process, one of:

    _stability_run.py CONFIG ACTION [SCALES]
        steps with a poisoned (NaN) and a spiking loss through the real engine and Stepper: the
        final norm's output is multiplied by SCALES[i] in step i + 1 (default 1,1,1,nan,30,1);
        prints one JSON line of what happened, with the fp16 loss scale after each step.
    _stability_run.py --trainer SPIKE_STEP TRAIN_ARGS...
        ``launch.train.main(TRAIN_ARGS)`` with the final norm's output scaled 30x in every
        training forward of optimizer step SPIKE_STEP (a finite loss spike), as a user's run
        would meet one; also under torchrun, e.g. with a pipeline (the last stage's norm).
        ``--trainer-grad``: block 0's gradients scaled by GRAD_SCALE in that step instead.
    _stability_run.py --grad CONFIG ACTION BLOCK
        six steps through the real engine and Stepper with train.grad_spike_factor 3 (window 2):
        in step 5 the gradients of block BLOCK's parameters are multiplied by GRAD_SCALE (the
        loss is unchanged); prints one JSON line of each step's row fields.
"""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from training.run import trainer  # noqa: E402
from training.run.distributed import exit_now  # noqa: E402
from training.run.preflight import plan_for  # noqa: E402
from training.step.stepper import Stepper  # noqa: E402

SPIKE_SCALE = 30.0
GRAD_SCALE = 100.0


def local(p: torch.Tensor) -> torch.Tensor:
    """The weights this rank holds: under ZeRO-3 the parameter is an empty placeholder between
    uses and its values live in the partition ``ds_tensor`` (all of them on one rank)."""
    return (p.ds_tensor if hasattr(p, "ds_tensor") else p).detach()


def stepper_run(config: str, action: str, scales: str = f"1,1,1,nan,{SPIKE_SCALE},1") -> None:
    values = [float(v) for v in scales.split(",")]
    run = trainer.Run(plan_for(config, sets=[
        "model.hidden_size=32", "model.num_layers=2", "model.ffn_hidden_size=32", "model.max_seq_len=16",
        "data.seq_len=16", f"train.spike_action={action}", "train.spike_window=2",
        "train.spike_factor=1.5", f"train.steps={len(values)}"]))
    run.join_job()
    run.build_model()
    stepper, model, engine, ds = run.build_stepper(), run.model, run.engine, run.plan.ds
    gen = torch.Generator().manual_seed(0)
    batch = [(torch.randint(0, 4096, (ds["train_micro_batch_size_per_gpu"], 16), generator=gen),) * 2]
    scale = {"value": 1.0}
    model.norm.register_forward_hook(lambda mod, inp, out: out * scale["value"])
    out = []
    for step, value in enumerate(values, start=1):
        scale["value"] = value
        before = {n: local(p).clone() for n, p in model.named_parameters()}
        row, _ = stepper.train_step(step, batch)
        changed = any(not torch.equal(before[n], local(p)) for n, p in model.named_parameters())
        finite = all(torch.isfinite(local(p)).all() for p in model.parameters())
        out.append({"step": step, "loss": row["loss"], "skipped": row.get("skipped"),
                    "stopped": row.get("stopped"), "spike": row.get("spike", False), "changed": changed,
                    "finite": bool(finite), "loss_scale": getattr(engine.optimizer, "cur_scale", None)})
    print("RESULT " + json.dumps(out))


def grad_spike_run(config: str, action: str, block: str) -> None:
    run = trainer.Run(plan_for(config, sets=[
        "model.hidden_size=32", "model.num_layers=2", "model.ffn_hidden_size=32", "model.max_seq_len=16",
        "data.seq_len=16", f"train.spike_action={action}", "train.spike_window=2", "train.steps=6",
        "train.grad_spike_factor=3", "train.log_every=1"]))
    run.join_job()
    run.build_model()
    stepper, model, ds = run.build_stepper(), run.model, run.plan.ds
    gen = torch.Generator().manual_seed(0)
    batch = [(torch.randint(0, 4096, (ds["train_micro_batch_size_per_gpu"], 16), generator=gen),) * 2]
    now = {"step": 0}
    for p in model.layers[int(block)].parameters():
        p.register_hook(lambda g: g * GRAD_SCALE if now["step"] == 5 else g)
    out = []
    for step in range(1, 7):
        now["step"] = step
        before = {n: local(p).clone() for n, p in model.named_parameters()}
        row, extra = stepper.train_step(step, batch)
        changed = any(not torch.equal(before[n], local(p)) for n, p in model.named_parameters())
        out.append({"changed": changed, "wandb_blocks": sorted(k for k in extra if k.startswith("grad_norm/")),
                    **{k: row.get(k) for k in ("step", "loss", "grad_norm", "grad_norm_layers",
                                               "grad_spike", "spike", "skipped", "stopped")}})
    print("RESULT " + json.dumps(out))


def trainer_run(spike_step: int, argv: list[str], grad: bool = False) -> int:
    """``grad``: block 0's gradients scaled by GRAD_SCALE in step ``spike_step`` instead."""
    from launch import train
    now = {"step": None}                 # the optimizer step being trained
    build_model, train_step = trainer.build_model, Stepper.train_step

    def build_with_spike(*args, **kwargs):
        model = build_model(*args, **kwargs)
        if grad:
            for p in model.layers[0].parameters():
                p.register_hook(lambda g: g * GRAD_SCALE if now["step"] == spike_step else g)
            return model
        # The final norm: the model's, or under pipeline parallelism the last stage's head.
        norms = [model.norm] if hasattr(model, "norm") else [
            m.norm for m in model.modules() if type(m).__name__ in ("HeadPipe", "FinalNormPipe")]
        for norm in norms:                     # evaluation passes (eval mode) are left alone
            norm.register_forward_hook(
                lambda mod, inp, out: out * SPIKE_SCALE if mod.training and now["step"] == spike_step else out)
        return model

    def train_step_recorded(self, step, batches):
        now["step"] = step
        return train_step(self, step, batches)

    trainer.build_model = build_with_spike
    Stepper.train_step = train_step_recorded
    return train.main(argv)


if __name__ == "__main__":
    if sys.argv[1] in ("--trainer", "--trainer-grad"):     # leaves as the trainer does
        exit_now(trainer_run(int(sys.argv[2]), sys.argv[3:], grad=sys.argv[1] == "--trainer-grad"))
    if sys.argv[1] == "--grad":
        sys.exit(grad_spike_run(*sys.argv[2:]))
    stepper_run(*sys.argv[1:])
