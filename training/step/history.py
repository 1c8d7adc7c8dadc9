"""What the step carries from one optimizer step to the next, and a checkpoint keeps.

``StepHistory`` is one registered part of the checkpoint (``"monitor"``,
``training/checkpoint/state.py``): the spike tests' windows of recent losses and gradient norms
(``SpikeMonitor``),
the tokens trained on so far, and the gradient noise scale's EMAs (``noise_scale.py``). It is the
same on every rank (each value comes from the step's summed statistics), so it rides in
DeepSpeed's ``client_state``; a resumed run continues all three exactly.
"""

from __future__ import annotations

import math

from training.step import noise_scale


class SpikeMonitor:
    """Flags a value (a loss, a gradient norm) above ``factor`` x the running mean of the last
    ``window`` recorded ones."""

    def __init__(self, factor: float, window: int):
        self.factor, self.window = factor, window
        self.history: list[float] = []

    def is_spike(self, loss: float) -> bool:
        # Judge only once the window has filled: early-training losses fall too fast to compare.
        if len(self.history) < self.window:
            return False
        return loss > self.factor * (sum(self.history) / len(self.history))

    def record(self, loss: float) -> None:
        self.history = (self.history + [loss])[-self.window:]


class StepHistory:
    """The spike windows, the token count and the noise-scale EMAs of one run.

    Args:
        spikes: the loss-spike test (``train.spike_factor``, ``train.spike_window``).
        noise: the noise-scale estimator, or None where it is off or the layout cannot measure it.
        grad_spikes: the gradient-norm spike test (``train.grad_spike_factor``), None when off.
    """

    def __init__(self, spikes: SpikeMonitor, noise: noise_scale.NoiseScale | None = None,
                 grad_spikes: SpikeMonitor | None = None):
        self.spikes, self.noise, self.grad_spikes = spikes, noise, grad_spikes
        self.tokens = 0                     # input tokens of every step applied or skipped so far

    @classmethod
    def for_run(cls, recipe, ds: dict, ctx, dp_size: int) -> StepHistory:
        """A fresh history for the run's recipe, DeepSpeed JSON and layout (``ctx``: the run's
        ``training.run.distributed.DistContext``)."""
        tcfg = recipe.train
        grad = (SpikeMonitor(tcfg.grad_spike_factor, tcfg.spike_window)
                if tcfg.grad_spike_factor is not None else None)
        return cls(SpikeMonitor(tcfg.spike_factor, tcfg.spike_window),
                   noise_scale.for_run(recipe, ds, ctx, dp_size), grad)

    def grad_spike(self, grad_norm: float | None) -> bool:
        """Whether a step's gradient norm is a spike (False when the test is off or the norm is
        not finite)."""
        return (self.grad_spikes is not None and grad_norm is not None and math.isfinite(grad_norm)
                and self.grad_spikes.is_spike(grad_norm))

    def record(self, loss: float, grad_norm: float | None) -> None:
        """A step the trainer did not skip enters the spike windows."""
        self.spikes.record(loss)
        if self.grad_spikes is not None and grad_norm is not None and math.isfinite(grad_norm):
            self.grad_spikes.record(grad_norm)

    def state_dict(self) -> dict:
        noise = {"noise_scale": self.noise.state_dict()} if self.noise else {}
        grad = {"grad_norm_history": list(self.grad_spikes.history)} if self.grad_spikes else {}
        return {"history": list(self.spikes.history), "tokens": self.tokens, **noise, **grad}

    def load_state_dict(self, state: dict) -> None:
        self.spikes.history = list(state.get("history", []))
        self.tokens = int(state.get("tokens", 0))
        if self.grad_spikes is not None:    # a checkpoint of a run without it: an empty window
            self.grad_spikes.history = list(state.get("grad_norm_history", []))
        if self.noise is not None:
            self.noise.load_state_dict(state.get("noise_scale") or {})


def spike_fields(spike: bool, grad_spike: bool, skip_reason: str | None, applied: bool,
                 grad_norm: float | None, action: str) -> dict:
    """A step's row fields of the spike tests: ``spike`` and ``grad_spike`` (logged in every
    case), ``skipped`` with the reason for a step not applied, and under ``spike_action: stop``
    ``stopped``: a skipped spike (the run saves the weights from before it), or a gradient-norm
    spike found inside DeepSpeed's optimizer step, after the update (the run saves nothing)."""
    row = {key: True for key, on in (("spike", spike), ("grad_spike", grad_spike)) if on}
    if not applied:
        row["skipped"] = skip_reason or "optimizer skipped the step (overflow)"
    if action == "stop":
        if skip_reason and skip_reason.startswith(("loss spike", "grad-norm spike")):
            row["stopped"] = skip_reason
        elif grad_spike and skip_reason is None:
            row["stopped"] = (f"grad-norm spike ({grad_norm:.4g}) found inside DeepSpeed's optimizer "
                              f"step, so the update was applied and not saved; change the settings "
                              f"(e.g. a lower lr)")
    return row
