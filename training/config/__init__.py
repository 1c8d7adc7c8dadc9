"""What to run: the recipe YAML and the DeepSpeed JSON, read and checked before anything starts.

``schema`` holds one frozen dataclass per recipe section (each field with its one-line
docstring), ``recipe`` reads YAML and ``--set`` overrides into them, ``ds_config`` loads and checks
the DeepSpeed JSON. Every mistake is a one-line ``ValueError`` naming the key and the fix.

Imports: ``model/``, ``training.optim`` (the schedule names it checks) and ``training.data``
(``data.source`` is parsed here, once).
"""
