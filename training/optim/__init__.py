"""How the weights move: parameter groups and weight decay, LAMB, lr scaling rules
(``optimizers``), and the lr schedules beside DeepSpeed's own (``schedules``).

Imports: ``model/`` only.
"""
