"""Which requests of a trace a replay sends, and when.

A window of the trace (``start_s`` after its first request, for ``duration_s``, then at most
``max_requests``) is sent at the trace's own times multiplied by ``time_scale`` (0.05 replays
20× faster), measured from the replay's start. ``rate_rps`` instead of a time scale picks the
scale that gives the window that mean rate (the trace's shape kept, its pace changed): what
``--search rate`` moves on a trace step.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdx.errors import InputError
from pdx.traces.formats import Trace, TraceRequest


@dataclass(frozen=True)
class Window:
    """What part of a trace to replay, and how fast."""

    start_s: float = 0.0
    duration_s: float | None = None
    max_requests: int | None = None
    time_scale: float = 1.0
    rate_rps: float | None = None  # overrides time_scale: the window's mean rate


@dataclass(frozen=True)
class Planned:
    """One request to send ``send_s`` after the replay starts."""

    send_s: float
    request: TraceRequest


def plan(trace: Trace, window: Window) -> tuple[list[Planned], float]:
    """The window's requests with their send times, and the time scale used."""
    if window.time_scale <= 0:
        raise InputError("time_scale", window.time_scale, "a number > 0")
    begin = trace.requests[0].arrival_s + window.start_s
    end = begin + window.duration_s if window.duration_s is not None else float("inf")
    chosen = [r for r in trace.requests if begin <= r.arrival_s < end]
    if window.max_requests is not None:
        chosen = chosen[: window.max_requests]
    if not chosen:
        raise InputError(
            "window", f"start_s={window.start_s:g}, duration_s={window.duration_s}",
            f"a window holding requests (the trace spans 0 to {trace.duration_s:g} s)",
        )  # fmt: skip
    t0 = chosen[0].arrival_s
    scale = window.time_scale
    if window.rate_rps is not None:
        span = chosen[-1].arrival_s - t0
        if window.rate_rps <= 0 or span <= 0:
            raise InputError("rate_rps", window.rate_rps, "a rate > 0 over a window of 2+ times")
        scale = (len(chosen) - 1) / window.rate_rps / span
    return [Planned((r.arrival_s - t0) * scale, r) for r in chosen], scale
