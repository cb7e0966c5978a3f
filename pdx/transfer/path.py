"""What a client knows about its path to one store: RTT, goodput, and the deadline that fits.

A fixed loopback-sized deadline (300 ms) cannot move 300 MB at 1 Gbit/s (2.4 s), nor set
up a TLS connection at 300 ms RTT (four round trips). Unless ``kv_transfer_timeout_ms`` is
given, each request's deadline is derived from the object's size and what this client has
measured on the path (documented in docs/kv-transfer.md, recorded in every transfer record):

    deadline_ms = 300                                   the contract's floor
                + 3000           while no exchange has succeeded yet (connection set-up)
                + 10 x RTT_ms    request round trips, slow start, a retry's backoff
                + 2 x size x 8 / goodput x 1000        the bytes, with a factor 2 of margin

RTT samples are TCP's handshake RTT of each data-plane connection and the time of small gRPC
calls (upper bounds of the path's RTT). The path's RTT is the smallest sample of the last
10 s (BBR's min-RTT filter: a path whose RTT rose is seen as it is within 10 s); a deadline
uses the larger of that and the newest sample, so the first request after the path's RTT
rose (a reroute, a failover to a farther site) is not judged on the old one: its own first
round trip extends its deadline. Goodput is a moving average over transfers of at least
1 MiB, or ``link_gbps`` when configured, or 100 Mbit/s before anything is measured.

A link that slows for good would otherwise never be learned: every transfer sized on the old
goodput times out, and only successes taught the estimate. So a Get that runs out of its
deadline having moved some bytes drops the estimate to the rate it achieved (bytes over the
time since it began: at most what the path gives now, so the next deadlines err long), and it
is retried, within the retry budget, under a new deadline derived from that estimate and
doubled per timeout already spent, as long as each timed-out attempt moved bytes (one that
moved nothing met a dead link: KV_TIMEOUT, as before). A re-granted deadline is at most
``MAX_REGRANT_MS`` (the store's default cap on a call), so a peer that drips bytes cannot hold
a Get for longer than the store itself would. Successes raise the estimate again when the link
recovers.

A streamed Get (of an object its writer is still writing, e.g. a prefill computing layer by
layer) cannot be judged on that deadline from its start: the bytes do not exist yet. While the
writer writes, the Get's deadline is ``WRITER_IDLE_S`` plus the derived deadline past the last
message it received (the store ends a writer that makes no progress for its
``stall_timeout_s``, 10 s by default, and the reader then gets KV_INCOMPLETE); from the closed
object's info on, the bytes still missing get the derived deadline, counted from that moment.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

DEADLINE_FLOOR_MS = 300.0
COLD_SETUP_MS = 3000.0
RTT_FACTOR = 10.0
BYTES_FACTOR = 2.0
ASSUMED_GOODPUT_BPS = 100e6
MIN_SAMPLE_BYTES = 1 << 20
_EWMA = 0.3
RTT_WINDOW_S = 10.0
WRITER_IDLE_S = 10.0  # the store's default stall_timeout_s
MAX_REGRANT_MS = 300_000.0  # the store's default max_request_timeout_ms: it cuts a longer call


def derived_deadline_ms(size_bytes: int, rtt_ms: float, goodput_bps: float, cold: bool) -> float:
    """The documented formula (module docstring)."""
    setup = COLD_SETUP_MS if cold else 0.0
    bytes_ms = BYTES_FACTOR * size_bytes * 8 / goodput_bps * 1e3
    return DEADLINE_FLOOR_MS + setup + RTT_FACTOR * rtt_ms + bytes_ms


def regranted_ms(derived_ms: float, timeouts: int) -> float:
    """A timed-out Get's next deadline: the derived one, doubled per timeout spent before this
    one, at most ``MAX_REGRANT_MS``."""
    return min(derived_ms * 2 ** max(0, timeouts - 1), MAX_REGRANT_MS)


@dataclass(frozen=True)
class Deadline:
    """One request's deadline and where it came from."""

    ms: float
    source: str  # "explicit" (kv_transfer_timeout_ms) or "derived"
    rtt_ms: float | None
    goodput_gbps: float | None


class PathEstimate:
    """RTT and goodput seen by one client on its path to one store (thread-safe)."""

    def __init__(self, link_gbps: float | None = None) -> None:
        self.link_bps = link_gbps * 1e9 if link_gbps else None
        self._rtts: deque[tuple[float, float]] = deque(maxlen=256)  # (monotonic s, ms)
        self.goodput_bps: float | None = None
        self.largest_bytes = 0  # the largest object seen, for a Get of unknown size
        self.warm = False
        self._lock = threading.Lock()

    def observe_rtt(self, rtt_ms: float) -> None:
        """A round trip (an upper bound of the path's RTT)."""
        if rtt_ms <= 0:
            return
        with self._lock:
            self._rtts.append((time.monotonic(), rtt_ms))

    @property
    def rtt_ms(self) -> float | None:
        """The path's RTT: the smallest sample of the last ``RTT_WINDOW_S`` (else the newest)."""
        with self._lock:
            return self._windowed_min()

    def _windowed_min(self) -> float | None:
        if not self._rtts:
            return None
        since = time.monotonic() - RTT_WINDOW_S
        recent = [ms for t, ms in self._rtts if t >= since]
        return min(recent) if recent else self._rtts[-1][1]

    def observe_success(self, nbytes: int, seconds: float) -> None:
        """A request that worked; one of at least 1 MiB also measures goodput."""
        with self._lock:
            self.warm = True
            self.largest_bytes = max(self.largest_bytes, nbytes)
            if nbytes >= MIN_SAMPLE_BYTES and seconds > 0:
                rate = nbytes * 8 / seconds
                g = self.goodput_bps
                self.goodput_bps = rate if g is None else (1 - _EWMA) * g + _EWMA * rate

    def observe_timeout(self, nbytes: int, seconds: float) -> None:
        """A request that ran out of its deadline after moving ``nbytes`` in ``seconds``: the
        path gave it no more, so the estimate drops to that rate."""
        if nbytes <= 0 or seconds <= 0:
            return  # nothing moved: a cut link, not a slow one
        rate = nbytes * 8 / seconds
        with self._lock:
            g = self.goodput_bps or self.link_bps or ASSUMED_GOODPUT_BPS
            self.goodput_bps = min(g, rate)

    def deadline(self, size_bytes: int | None, explicit_ms: float | None) -> Deadline:
        """The deadline of a request moving ``size_bytes`` (None: the largest seen so far)."""
        with self._lock:
            rtt = self._windowed_min()
            if rtt is not None:  # never judged on an RTT older than the newest round trip
                rtt = max(rtt, self._rtts[-1][1])
            measured, warm = self.goodput_bps, self.warm
            size = self.largest_bytes if size_bytes is None else size_bytes
        goodput = measured or self.link_bps or ASSUMED_GOODPUT_BPS
        gbps = round(goodput / 1e9, 4)
        if explicit_ms is not None:
            return Deadline(float(explicit_ms), "explicit", rtt, gbps)
        ms = derived_deadline_ms(size, rtt or 0.0, goodput, cold=not warm)
        return Deadline(round(ms, 1), "derived", rtt, gbps)
