"""Stage 6: what the simulator predicts beside what was measured, and what to change.

``prediction`` (the simulator beside every step), ``calibrate`` (the simulator fitted to vLLM's
own timings), ``forecast`` (a run's predictions and recommendations assembled), ``advice``
(settings to use, from the measured link and load), ``remedies`` (what would change a failed
criterion or an invalid step).
"""

__all__ = ["advice", "calibrate", "forecast", "prediction", "remedies"]
