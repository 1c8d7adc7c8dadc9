"""Failures at scale: the step watchdog, heartbeats and lost ranks (``watchdog``), preemption
signals (``preemption``).

Imports: ``training.files`` only (no collective, no GPU).
"""
