"""The trainer: everything ``launch/train.py`` runs, in sub-packages by concern.

Read from the top down; each sub-package imports only from those below it (and from
``model/`` and ``data_pipeline/``), never back up, and no module imports one that imports it:

- ``run/``: the run object (``trainer.Run``: preflight -> setup -> loop), the up-front checks
  (``preflight``), process groups (``distributed``), what a run writes (``outputs``), the host's
  CPU and CUDA checks (``host``), and ranks spawned on one host for tests and benchmarks
  (``spawn``).
- ``step/``: one optimizer step (``stepper``), its statistics vector (``stats``), what it carries
  from step to step (``history``), the gradient noise scale (``noise_scale``).
- ``engine/``: the model at a rank's layout and its DeepSpeed engine (``build``), pipeline stages
  (``pipeline``), the ZeRO-3 partitioned build (``sharded_build``), ``torch.compile`` (``compile``).
- ``config/``: the recipe YAML (``recipe``, ``schema``) and the DeepSpeed JSON (``ds_config``,
  from the file to the engine; its rules in ``ds_checks``).
- ``checkpoint/``: on-disk layout, saving, resuming, manifests, weights-only loading, shard maps
  for layout changes, and what a checkpoint carries besides the engine (``state``).
- ``data/``: the run's sources opened as streams (``streams``), the sampler and batches
  (``batches``), tokenizer and data built at start-up (``build``).
- ``optim/``: parameter groups, LAMB, lr scaling (``optimizers``) and lr schedules (``schedules``).
- ``resilience/``: the step watchdog and lost ranks (``watchdog``), preemption signals.
- Leaf modules: ``files`` (atomic writes, marker waits), ``gpus`` (the GPU table),
  ``tracking`` (metrics.jsonl, W&B, progress).

``tests/test_repo_shape.py`` checks the order and that no circle exists.
"""
