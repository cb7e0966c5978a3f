"""Stage 5 (``--search PARAM``): the limit of one parameter, the bracket from the last GO to
the first NO-GO, found by judged probes.

``limit`` (the axis, the next probe, the bracket), ``run`` (a run whose steps are the search's
probes), ``predict`` (the simulator's limit, calibrated on the first probe).
"""

__all__ = ["limit", "predict", "run"]
