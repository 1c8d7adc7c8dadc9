"""One optimizer step: forward and backward over the micro-batches with exact accumulation, the
skip decision, the metrics row (``stepper``); the statistics vector summed once per step
(``stats``); what the step carries to the next (``history``); the gradient noise scale
(``noise_scale``).

Imports: ``model/``, ``training.config``, ``training.engine`` (the pipeline's hooks).
"""
