"""What the gateway measures live for ``router.offload.policy: break_even``.

Every figure is an exponentially weighted mean of what recent requests showed (none assumed):

- ``rtt_ms``: the prefill call's round trip, its first-token event's time less prefill's own
  queue and compute time;
- ``goodput_bytes_per_ms``: a transfer's bytes over its time less one round trip (at most half
  of it) and less the time a streamed Get waited for prefill to write;
- ``prefill_ms_per_token``, ``prefill_queue_ms``: the prefill site's compute per uncached token,
  and its queue;
- ``local_ms_per_token``: decode's own prefill per uncached token (the model's time, without
  its wait for the model thread).

Remote: ``queue + uncached × prefill_ms_per_token + 2 RTT + KV bytes ÷ goodput``; local:
``(pending + uncached) × local_ms_per_token``, ``pending`` the uncached tokens of the requests
this gateway sent that decode to prefill itself and that have no first token yet (decode
prefills one at a time). While one side has no sample yet, or none for
``explore_after_s``, one request in flight at a time is sent that way to measure it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

#: Weight of each new sample: five recent ones carry three quarters of the estimate, so a link
#: that halves moves it within a few transfers.
ALPHA = 0.25


@dataclass
class Ewma:
    """An exponentially weighted mean; ``None`` until the first sample."""

    value: float | None = None
    at_s: float = 0.0  # monotonic time of the last sample

    def add(self, x: float, now_s: float) -> None:
        """Fold one sample in."""
        self.value = x if self.value is None else self.value + ALPHA * (x - self.value)
        self.at_s = now_s


@dataclass
class Prediction:
    """The two paths' predicted time to the first token's KV being ready, ms."""

    remote_ms: float
    local_ms: float

    @property
    def remote(self) -> bool:
        """Whether the remote path is predicted faster."""
        return self.remote_ms < self.local_ms


@dataclass
class LiveRates:
    """The estimates, fed from each finished request."""

    explore_after_s: float = 5.0
    rtt_ms: Ewma = field(default_factory=Ewma)
    goodput_bytes_per_ms: Ewma = field(default_factory=Ewma)
    prefill_ms_per_token: Ewma = field(default_factory=Ewma)
    prefill_queue_ms: Ewma = field(default_factory=Ewma)
    local_ms_per_token: Ewma = field(default_factory=Ewma)
    exploring: str = ""  # the path a request is measuring now ("remote"/"local"), or ""

    def observe_remote(
        self,
        *,
        prefill_ms: float,
        queue_ms: float,
        computed_tokens: int,
        first_event_ms: float,
        kv_bytes: int,
        transfer_ms: float,
        wait_ms: float = 0.0,
    ) -> None:
        """One disaggregated request whose transfer succeeded."""
        now = time.monotonic()
        rtt = max(0.0, first_event_ms - prefill_ms - queue_ms)
        self.rtt_ms.add(rtt, now)
        self.prefill_queue_ms.add(queue_ms, now)
        if computed_tokens > 0:
            self.prefill_ms_per_token.add(prefill_ms / computed_tokens, now)
        wire_ms = max(0.0, transfer_ms - wait_ms)
        wire_ms -= min(rtt, wire_ms / 2)  # the Get's own round trip (at most half of it: on a
        # short path the call's overhead measured in the RTT can exceed the transfer's)
        if kv_bytes > 0 and wire_ms > 0:
            self.goodput_bytes_per_ms.add(kv_bytes / wire_ms, now)

    def observe_local(self, *, local_prefill_ms: float, computed_tokens: int) -> None:
        """One request prefilled on decode."""
        if computed_tokens > 0 and local_prefill_ms > 0:
            self.local_ms_per_token.add(local_prefill_ms / computed_tokens, time.monotonic())

    def predict(
        self, uncached_tokens: int, kv_bytes: float, pending_tokens: int = 0
    ) -> Prediction | None:
        """Both paths' predicted cost, or None while a figure is missing."""
        figures = (self.rtt_ms.value, self.goodput_bytes_per_ms.value,
                   self.prefill_ms_per_token.value, self.local_ms_per_token.value)  # fmt: skip
        rtt, goodput, prefill, local = figures
        if rtt is None or goodput is None or prefill is None or local is None or goodput <= 0:
            return None
        queue = self.prefill_queue_ms.value or 0.0
        remote = queue + uncached_tokens * prefill + 2 * rtt + kv_bytes / goodput
        return Prediction(remote_ms=remote, local_ms=(pending_tokens + uncached_tokens) * local)

    def stale(self) -> str:
        """The path with no recent sample ("remote", "local"), or "" when both are fresh."""
        now = time.monotonic()
        remote = min(self.goodput_bytes_per_ms.at_s, self.prefill_ms_per_token.at_s)
        for path, at in (("local", self.local_ms_per_token.at_s), ("remote", remote)):
            if not at or now - at > self.explore_after_s:
                return path
        return ""
