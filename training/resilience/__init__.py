"""Failures at scale: the step watchdog and lost ranks (``watchdog``), the heartbeat files it
reads and their writer thread (``heartbeats``), preemption signals (``preemption``).

Imports: ``training.files`` only (no collective, no GPU).
"""
