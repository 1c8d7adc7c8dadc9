"""What the step carries from one optimizer step to the next, and a checkpoint keeps.

``StepHistory`` is one registered part of the checkpoint (``"monitor"``,
``training/checkpoint/state.py``): the spike test's window of recent losses (``SpikeMonitor``),
the tokens trained on so far, and the gradient noise scale's EMAs (``noise_scale.py``). It is the
same on every rank (each value comes from the step's summed statistics), so it rides in
DeepSpeed's ``client_state``; a resumed run continues all three exactly.
"""

from __future__ import annotations

from training.step import noise_scale


class SpikeMonitor:
    """Flags a loss above ``factor`` x the running mean of the last ``window`` finite losses."""

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
    """The spike window, the token count and the noise-scale EMAs of one run.

    Args:
        spikes: the loss-spike test (``train.spike_factor``, ``train.spike_window``).
        noise: the noise-scale estimator, or None where it is off or the layout cannot measure it.
    """

    def __init__(self, spikes: SpikeMonitor, noise: noise_scale.NoiseScale | None = None):
        self.spikes, self.noise = spikes, noise
        self.tokens = 0                     # input tokens of every step applied or skipped so far

    @classmethod
    def for_run(cls, recipe, ds: dict, ctx, dp_size: int) -> StepHistory:
        """A fresh history for the run's recipe, DeepSpeed JSON and layout (``ctx``: the run's
        ``training.run.distributed.DistContext``)."""
        return cls(SpikeMonitor(recipe.train.spike_factor, recipe.train.spike_window),
                   noise_scale.for_run(recipe, ds, ctx, dp_size))

    def state_dict(self) -> dict:
        noise = {"noise_scale": self.noise.state_dict()} if self.noise else {}
        return {"history": list(self.spikes.history), "tokens": self.tokens, **noise}

    def load_state_dict(self, state: dict) -> None:
        self.spikes.history = list(state.get("history", []))
        self.tokens = int(state.get("tokens", 0))
        if self.noise is not None:
            self.noise.load_state_dict(state.get("noise_scale") or {})
