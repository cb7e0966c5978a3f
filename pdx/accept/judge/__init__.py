"""Stage 4: the verdict from what the load measured.

``stats`` (per-step statistics from the exact per-request records), ``confidence`` (one-sided
bounds and the sample each criterion needs), ``criteria`` (validity, then each criterion),
``gates`` and ``engine_kv`` (the P/D failures other stacks are known for), ``link`` (the link
verdict on every step), ``baseline`` (each step beside its colocated twin), ``repeat`` (how far
whole runs agree).
"""

__all__ = ["baseline", "confidence", "criteria", "engine_kv", "gates", "link", "repeat", "stats"]
