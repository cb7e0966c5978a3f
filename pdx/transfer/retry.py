"""Retry policy: exponential backoff with full jitter under two budgets.

Per request: at most ``kv_retry_budget`` retries. Global: over a sliding window,
retries may not exceed ``retry_min_per_s * window + ratio * requests`` (the shape of
Finagle's RetryBudget and gRPC's retry throttling), so a network blip that fails many
requests at once cannot turn into a retry storm. Written here rather than taken from
a library because it must share the client's clock and count contract errors.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable


class GlobalRetryBudget:
    """Sliding-window budget shared by every request of one client."""

    def __init__(
        self,
        ratio: float = 0.1,
        min_per_s: float = 10.0,
        window_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ratio = ratio
        self.min_per_s = min_per_s
        self.window_s = window_s
        self._clock = clock
        self._requests: deque[float] = deque()
        self._retries: deque[float] = deque()

    def _trim(self, now: float) -> None:
        cutoff = now - self.window_s
        for q in (self._requests, self._retries):
            while q and q[0] < cutoff:
                q.popleft()

    def on_request(self) -> None:
        """Count one new request (not a retry)."""
        now = self._clock()
        self._trim(now)
        self._requests.append(now)

    def try_retry(self) -> bool:
        """Take one retry from the budget if it allows; False means do not retry."""
        now = self._clock()
        self._trim(now)
        allowed = self.min_per_s * self.window_s + self.ratio * len(self._requests)
        if len(self._retries) + 1 > allowed:
            return False
        self._retries.append(now)
        return True

    @property
    def retries_in_window(self) -> int:
        """Retries counted in the current window."""
        self._trim(self._clock())
        return len(self._retries)


def backoff_s(
    attempt: int, base_ms: float, max_ms: float, rng: random.Random | None = None
) -> float:
    """Full-jitter exponential backoff before retry number ``attempt`` (1-based)."""
    cap_ms = min(max_ms, base_ms * (2 ** (attempt - 1)))
    return (rng or random).uniform(0, cap_ms) / 1000
