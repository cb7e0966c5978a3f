"""The gateway's Prometheus series (one registry per gateway, so several fit in a process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class GatewayMetrics:
    """Prometheus series of one gateway (its own registry, so several can live in a process)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "pdx_gateway_requests",
            "Requests by route and outcome",
            ["route", "outcome"],
            registry=r,
        )
        self.degradations = Counter(
            "pdx_gateway_degradations", "Requests degraded to local prefill", ["reason"], registry=r
        )
        self.rejections = Counter(
            "pdx_gateway_rejections", "Requests refused before work", ["reason"], registry=r
        )
        self.client_disconnects = Counter(
            "pdx_gateway_client_disconnects",
            "Streams whose client went away before the end (generation stopped)",
            ["route"],
            registry=r,
        )
        self.ttft = Histogram(
            "pdx_gateway_ttft_seconds", "Time to first token", ["route"],
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.tpot = Histogram(
            "pdx_gateway_tpot_seconds", "(E2E - TTFT) / (tokens - 1)", ["route"],
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.transfer = Histogram(
            "pdx_gateway_kv_transfer_seconds", "KV transfer time reported by decode",
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.transfer_outcomes = Counter(
            "pdx_gateway_kv_transfers", "KV transfers by outcome", ["outcome"], registry=r
        )
        self.kv_bytes = Counter("pdx_gateway_kv_bytes", "KV bytes moved", registry=r)
        self.retries = Counter("pdx_gateway_kv_retries", "KV transfer retries", registry=r)
        self.breaker_open = Gauge(
            "pdx_gateway_circuit_open", "1 while the KV circuit breaker is not closed", registry=r
        )
        self.in_flight = Gauge(
            "pdx_gateway_in_flight", "Requests in flight per decode instance", ["instance"],
            registry=r,
        )  # fmt: skip
