"""Discrete-event simulation of colocated vs disaggregated serving (``pdx simulate``).

Public modules: ``config`` (the scenario), ``engine`` (the event loop), ``workload``,
``metrics``, ``runner`` and ``sweep`` (one run, a grid), ``calibrate`` (fitting to a measured
run), ``plot``.
"""

__all__ = ["calibrate", "config", "engine", "metrics", "plot", "runner", "sweep", "workload"]
