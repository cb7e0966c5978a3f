"""Transfer metrics (prometheus-client) and the per-transfer record reports read.

Each server and client owns a :class:`KVMetrics` bound to a registry (its own by
default, so several stores in one process never collide); ``kv-serve`` exposes it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


@dataclass
class TransferRecord:
    """One transfer as the client saw it: what acceptance reports aggregate."""

    kv_id: str
    op: str
    bytes: int
    ms: float
    retries: int
    outcome: str
    chunks: int = 0
    resumed_chunks: int = 0
    # how it travelled (Put/Get): transport, the data-plane sockets' congestion control
    # (gRPC's are the system default), stripes and channels
    transport: str | None = None
    congestion_control: str | None = None
    streams: int | None = None
    connections: int | None = None
    # the deadline it ran under: fixed (explicit) or derived from size, RTT and goodput
    rtt_ms: float | None = None
    deadline_ms: float | None = None
    deadline_source: str | None = None
    limited_by: str | None = None  # a Put stream capped by "send buffer" / "receive window"
    # Streamed objects (rpc Open): the Put's bytes sent and time spent while the producer
    # still computed (the overlap); a Get's bytes that were stored only after it began and
    # its time waiting on the writer.
    streamed: bool | None = None
    overlap_bytes: int | None = None
    overlap_ms: float | None = None

    def as_dict(self) -> dict[str, Any]:
        """Plain dict (JSON-ready)."""
        return asdict(self)


class KVMetrics:
    """Counters, gauges and histograms for one store or client, plus transfer records."""

    def __init__(
        self, registry: CollectorRegistry | None = None, *, keep_records: int = 10_000
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.bytes = Counter("pdx_kv_bytes", "KV payload bytes moved", ["op", "side"], registry=r)
        self.chunks = Counter("pdx_kv_chunks", "KV chunks moved", ["op", "side"], registry=r)
        self.duration = Histogram(
            "pdx_kv_transfer_seconds",
            "Transfer duration",
            ["op", "side"],
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.retries = Counter("pdx_kv_retries", "Retried attempts", ["op"], registry=r)
        self.transfers = Counter(
            "pdx_kv_transfers",
            "Put/Get transfers by outcome, transport and TCP congestion control",
            ["op", "outcome", "transport", "congestion_control"],
            registry=r,
        )
        self.errors = Counter(
            "pdx_kv_errors", "Errors by contract code", ["code", "side"], registry=r
        )
        self.corrupt = Counter(
            "pdx_kv_corrupt_chunks", "Chunks failing checksum", ["side"], registry=r
        )
        self.expired = Counter("pdx_kv_expired", "Objects deleted at TTL", registry=r)
        self.evicted = Counter("pdx_kv_evicted", "Objects evicted over budget", registry=r)
        self.released = Counter("pdx_kv_released", "Objects released by consumers", registry=r)
        self.inflight = Gauge("pdx_kv_inflight", "Transfers in flight", ["side"], registry=r)
        self.store_bytes = Gauge("pdx_kv_store_bytes", "Bytes held by the store", registry=r)
        self.store_objects = Gauge("pdx_kv_store_objects", "Objects held by the store", registry=r)
        self.link_cap = Gauge(
            "pdx_kv_link_cap_bits_per_second",
            "The most the store's Gets may send across the link (kv.max_link_gbps; 0: unpaced)",
            registry=r,
        )
        self.paced = Gauge(
            "pdx_kv_paced_connections",
            "Data-plane connections sending a Get under the cap",
            registry=r,
        )
        self._records: deque[TransferRecord] = deque(maxlen=keep_records)

    def add_record(self, rec: TransferRecord) -> None:
        """Keep one per-transfer record (bounded)."""
        self._records.append(rec)

    def records(self) -> list[TransferRecord]:
        """Per-transfer records, oldest first."""
        return list(self._records)

    def value(self, name: str, **labels: str) -> float:
        """Current value of one sample, e.g. ``value("pdx_kv_evicted_total")`` (0 if absent)."""
        got = self.registry.get_sample_value(name, labels)
        return float(got) if got is not None else 0.0
