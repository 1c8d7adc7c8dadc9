"""Run by test_stability.py in its own process: steps with a poisoned (NaN) and a spiking loss
through the real engine and Stepper; prints one JSON line of what happened."""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from training import ds_config, run_setup, stepping  # noqa: E402
from training.recipe import load_recipe  # noqa: E402


def main(config: str, action: str) -> None:
    recipe = load_recipe(None, ["model.hidden_size=32", "model.num_layers=2", "model.ffn_hidden_size=32",
                                "model.max_seq_len=16", "data.seq_len=16", f"train.spike_action={action}",
                                "train.spike_window=2", "train.spike_factor=1.5", "train.steps=6"])
    ds = run_setup.resolve_ds_config(ds_config.validate_ds_config(ds_config.load_ds_config(config), 1), recipe)
    ctx = run_setup.init_distributed(recipe)
    model = run_setup.build_model(recipe, None, ctx.groups)
    engine = run_setup.build_engine(model, ds, recipe.train.steps, ctx.groups)
    stepper = stepping.Stepper(engine, recipe, ds, ctx, 1, tokens_per_step=ds["train_batch_size"] * 16)
    gen = torch.Generator().manual_seed(0)
    batch = [(torch.randint(0, 4096, (ds["train_micro_batch_size_per_gpu"], 16), generator=gen),) * 2]
    scale = {"value": 1.0}
    model.norm.register_forward_hook(lambda mod, inp, out: out * scale["value"])
    out = []
    for step, value in enumerate([1.0, 1.0, 1.0, float("nan"), 30.0, 1.0], start=1):
        scale["value"] = value
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        row, _ = stepper.train_step(step, batch)
        changed = any(not torch.equal(before[n], p.detach()) for n, p in model.named_parameters())
        finite = all(torch.isfinite(p).all() for p in model.parameters())
        out.append({"step": step, "loss": row["loss"], "skipped": row.get("skipped"),
                    "stopped": row.get("stopped"), "spike": row.get("spike", False), "changed": changed, "finite": bool(finite)})
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
