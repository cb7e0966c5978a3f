"""What happens to each wire packet of one direction: lost, copied, sent early, or delayed.

Pure logic (no I/O), so it is tested exactly. Independent random events (random loss,
reordering, duplication) are drawn as geometric gaps between events, so an aggregate of 44
segments with no event costs one subtraction, not 44 random draws. The Gilbert model is a
two-state chain walked the same way: good runs of ``Geometric(p)`` packets, bursts of
``Geometric(r)`` lost ones (mean ``loss_burst``).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from pdx.faults.wan.conditions import LinkConditions

LOST, DUPLICATED, EARLY = "lost", "duplicated", "early"
_NEVER = 1 << 62


def geometric(rng: random.Random, p: float) -> int:
    """Packets up to and including the next event of probability ``p`` (>= 1; huge if p = 0)."""
    if p <= 0:
        return _NEVER
    if p >= 1:
        return 1
    u = rng.random()
    return int(math.log1p(-u) / math.log1p(-p)) + 1


class _Countdown:
    """Packets until the next event of a fixed per-packet probability."""

    def __init__(self, rng: random.Random, p: float) -> None:
        self.rng, self.p = rng, p
        self.left = geometric(rng, p)

    def events(self, n: int) -> list[int]:
        """Indices in ``range(n)`` where the event happens; consumes ``n`` packets."""
        hits = []
        pos = 0
        while self.left <= n - pos:
            pos += self.left
            hits.append(pos - 1)
            self.left = geometric(self.rng, self.p)
        self.left -= n - pos
        return hits


class _Gilbert:
    """Good runs of ``Geometric(p)`` delivered packets, then ``Geometric(r)`` lost ones."""

    def __init__(self, rng: random.Random, p: float, r: float) -> None:
        self.rng, self.p, self.r = rng, p, r
        self.bad = False
        self.left = geometric(rng, p) - 1  # delivered packets before the first loss

    def events(self, n: int) -> list[int]:
        """Indices in ``range(n)`` that are lost; consumes ``n`` packets."""
        lost: list[int] = []
        pos = 0
        while pos < n:
            take = min(self.left, n - pos)
            if self.bad:
                lost.extend(range(pos, pos + take))
            pos += take
            self.left -= take
            if self.left == 0:
                self.bad = not self.bad
                # a burst lasts Geometric(r) packets; the packet that ends it is delivered
                # and starts a good run of Geometric(p) delivered packets
                self.left = geometric(self.rng, self.r if self.bad else self.p)
        return lost


@dataclass
class Fate:
    """Per-segment events of one read from the device (indices into its wire packets)."""

    lost: list[int] = field(default_factory=list)
    duplicated: list[int] = field(default_factory=list)
    early: list[int] = field(default_factory=list)

    @property
    def plain(self) -> bool:
        """No event: the whole read travels as it came."""
        return not (self.lost or self.duplicated or self.early)


ETHERNET_HEADER_BYTES = 14  # a rate counts frames as tbf and netem do on a veth


class DirectionModel:
    """Draws each packet's fate and release time for one direction's conditions.

    The order of a real path: the bottleneck queue (``rate_mbit``, tail drop past
    ``queue_ms`` of backlog), then the wide-area part (random loss, duplication, reordering,
    propagation ``delay_ms`` with ``jitter_ms``).
    """

    def __init__(self, cond: LinkConditions, rng: random.Random) -> None:
        self.cond = cond
        self.rng = rng
        if cond.loss_model == "gilbert" and cond.loss > 0:
            p, r = cond.gilbert_p_r()
            self._loss: _Countdown | _Gilbert = _Gilbert(rng, p, r)
        else:
            self._loss = _Countdown(rng, cond.loss)
        self._dup = _Countdown(rng, cond.duplicate)
        self._early = _Countdown(rng, cond.reorder)
        self._delay_s = cond.delay_ms / 1e3
        self._jitter_s = cond.jitter_ms / 1e3
        self._s_per_byte = 8 / (cond.rate_mbit * 1e6)
        self._queue_s = cond.queue_ms / 1e3
        self.busy_until = 0.0  # when the bottleneck has sent everything admitted so far
        self.last_due = 0.0

    def carry_over(self, old: DirectionModel) -> None:
        """Keep the state of the path (its queue, the last release) across a reconfiguration."""
        self.busy_until, self.last_due = old.busy_until, old.last_due

    def bottleneck(self, now: float, n: int, seg_bytes: int, last_bytes: int) -> tuple[int, float]:
        """Admit ``n`` back-to-back wire packets (all ``seg_bytes`` but the last) to the queue.

        Returns how many fit (the rest are tail-dropped) and when the last of those leaves
        the bottleneck.
        """
        start = max(now, self.busy_until)
        backlog = start - now
        if backlog > self._queue_s:
            return 0, start
        seg = (seg_bytes + ETHERNET_HEADER_BYTES) * self._s_per_byte
        room = int((self._queue_s - backlog) / seg) + 1 if seg > 0 else n
        k = min(n, room)
        tail = last_bytes if k == n else seg_bytes
        self.busy_until = start + (k - 1) * seg + (tail + ETHERNET_HEADER_BYTES) * self._s_per_byte
        return k, self.busy_until

    def backlog_s(self, now: float) -> float:
        """How long a packet arriving now would wait in the bottleneck queue."""
        return max(0.0, self.busy_until - now)

    def fate(self, n: int) -> Fate:
        """Events for the next ``n`` wire packets (a lost packet is neither copied nor early)."""
        lost = self._loss.events(n)
        dup = self._dup.events(n)
        early = self._early.events(n)
        if not (lost or dup or early):
            return Fate()
        gone = set(lost)
        return Fate(
            lost=lost,
            duplicated=[i for i in dup if i not in gone],
            early=[i for i in early if i not in gone],
        )

    def due(self, depart: float) -> float:
        """Release time of a packet leaving the bottleneck at ``depart``: plus the delay and
        normal jitter, never before an earlier packet of this direction (no reordering)."""
        d = self._delay_s
        if self._jitter_s:
            d = max(0.0, d + self.rng.gauss(0.0, self._jitter_s))
        due = max(depart + d, self.last_due)
        self.last_due = due
        return due
