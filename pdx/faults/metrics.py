"""Proxy metrics: per-toxic bytes and packets affected, in a registry each proxy owns.

Counters are kept twice on purpose: plain integers for :meth:`ProxyMetrics.snapshot` (cheap,
exact, used by reports) and Prometheus counters for scraping. Each proxy has its own
``CollectorRegistry`` so several proxies can live in one process.
"""

from __future__ import annotations

from collections import defaultdict, deque
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest


class ProxyMetrics:
    """Counters for one proxy: traffic per direction, connections, and what each toxic did."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._bytes = Counter(
            "pdx_faults_bytes",
            "Bytes received by the proxy, per direction",
            ["direction"],
            registry=self.registry,
        )
        self._packets = Counter(
            "pdx_faults_packets",
            "Chunks (TCP reads) or datagrams (UDP) received by the proxy, per direction",
            ["direction"],
            registry=self.registry,
        )
        self._toxic_bytes = Counter(
            "pdx_faults_toxic_bytes_affected",
            "Bytes a toxic acted on (delayed, dropped, corrupted, ...)",
            ["toxic", "type", "direction"],
            registry=self.registry,
        )
        self._toxic_packets = Counter(
            "pdx_faults_toxic_packets_affected",
            "Chunks or datagrams a toxic acted on",
            ["toxic", "type", "direction"],
            registry=self.registry,
        )
        self._connections = Counter(
            "pdx_faults_connections",
            "Client connections (TCP) or sessions (UDP) accepted",
            registry=self.registry,
        )
        self._active = Gauge(
            "pdx_faults_connections_active", "Connections open now", registry=self.registry
        )
        self._link_down = Gauge(
            "pdx_faults_link_down", "1 while the link is down", registry=self.registry
        )
        self._link_events = Counter(
            "pdx_faults_link_down_events",
            "Times the link was taken down",
            registry=self.registry,
        )
        self._children: dict[str, tuple[Any, Any]] = {}
        self.bytes_in: dict[str, int] = defaultdict(int)
        self.packets_in: dict[str, int] = defaultdict(int)
        self.toxic_counts: dict[tuple[str, str, str], list[int]] = {}
        self.connections_total = 0
        self.connections_active = 0
        self.connections_refused = 0
        self.link_down_events = 0
        self.timer_late_s: deque[float] = deque(maxlen=2000)

    def traffic(self, direction: str, nbytes: int, npackets: int = 1) -> None:
        """Count data the proxy received in ``direction``."""
        self.bytes_in[direction] += nbytes
        self.packets_in[direction] += npackets
        children = self._children.get(direction)
        if children is None:
            children = self._children[direction] = (
                self._bytes.labels(direction),
                self._packets.labels(direction),
            )
        children[0].inc(nbytes)
        children[1].inc(npackets)

    def affected(
        self, name: str, kind: str, direction: str, nbytes: int, npackets: int = 1
    ) -> None:
        """Count what a toxic did: ``nbytes`` bytes in ``npackets`` chunks or datagrams."""
        key = (name, kind, direction)
        row = self.toxic_counts.get(key)
        if row is None:
            row = self.toxic_counts[key] = [0, 0]
        row[0] += nbytes
        row[1] += npackets
        self._toxic_bytes.labels(name, kind, direction).inc(nbytes)
        self._toxic_packets.labels(name, kind, direction).inc(npackets)

    def lateness(self, late_s: float) -> None:
        """How late a delayed chunk went out versus its scheduled time (host scheduling)."""
        self.timer_late_s.append(late_s)

    def lateness_summary(self) -> dict[str, float | int]:
        """p50/p99 of recent timer lateness in ms: the host's share of latency error."""
        ordered = sorted(self.timer_late_s)
        if not ordered:
            return {"samples": 0}

        def pick(q: float) -> float:
            return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3, 4)

        return {"samples": len(ordered), "p50": pick(0.5), "p99": pick(0.99)}

    def connection_opened(self) -> None:
        """A client connection or UDP session started."""
        self.connections_total += 1
        self.connections_active += 1
        self._connections.inc()
        self._active.inc()

    def connection_closed(self) -> None:
        """A client connection or UDP session ended."""
        self.connections_active -= 1
        self._active.dec()

    def link_state(self, down: bool) -> None:
        """Record the link going down or up."""
        if down:
            self.link_down_events += 1
            self._link_events.inc()
        self._link_down.set(1 if down else 0)

    def snapshot(self) -> dict[str, Any]:
        """Plain-data view of every counter (what ``stats()`` and ``/stats`` return)."""
        return {
            "bytes_in": dict(self.bytes_in),
            "packets_in": dict(self.packets_in),
            "connections_total": self.connections_total,
            "connections_active": self.connections_active,
            "connections_refused": self.connections_refused,
            "link_down_events": self.link_down_events,
            "timer_lateness_ms": self.lateness_summary(),
            "toxics": [
                {"name": n, "type": t, "direction": d, "bytes": row[0], "packets": row[1]}
                for (n, t, d), row in sorted(self.toxic_counts.items())
            ],
        }

    def exposition(self) -> bytes:
        """Prometheus text format of this proxy's registry."""
        return generate_latest(self.registry)
