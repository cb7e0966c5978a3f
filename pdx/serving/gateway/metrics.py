"""The gateway's Prometheus series (one registry per gateway, so several fit in a process).

Two families. ``pdx_gateway_*``: the disaggregation view (routes, degradations, transfers,
the breaker). ``pdx:*``: the request-latency view, named like vLLM's ``vllm:*`` series
where the meaning is the same, with a ``model_name`` label, so a vLLM dashboard needs only
the prefix changed (the mapping is in docs/deploy.md). Under ``pdx deploy`` the supervisor's
``pdx_restarts_total`` and ``pdx_role_*`` series join the same registry
(:meth:`pdx.serving.restarts.RestartBoard.export`).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# 1 ms to 60 s: fine steps where a tiny model lives, coarse ones out to a long generation.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.06, 0.08,
                   0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                   60.0)  # fmt: skip


class GatewayMetrics:
    """Prometheus series of one gateway (its own registry, so several can live in a process)."""

    def __init__(self, model_name: str = "") -> None:
        r = self.registry = CollectorRegistry()
        self.model_name = model_name
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
        self.http_errors = Counter(
            "pdx_gateway_http_errors",
            "Responses with an error status (400, 404, 405, 413, 429, 5xx ...), by status",
            ["status"],
            registry=r,
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
        self.cached_blocks = Gauge(
            "pdx_gateway_decode_cached_blocks",
            "Prefix-cache blocks the router knows a decode instance holds (from its cache "
            "events; 0 while they are not followed)",
            ["instance"],
            registry=r,
        )
        self._vllm_like(r)

    def cached_blocks_changed(self, decode: Any) -> None:
        """What the router now knows ``decode`` (a router.DecodeInstance) holds."""
        self.cached_blocks.labels(decode.name).set(len(decode.cached_blocks))

    def _vllm_like(self, r: CollectorRegistry) -> None:
        """The ``pdx:*`` series (vLLM's names and meanings; one ``model_name`` label)."""
        label = ["model_name"]

        def hist(name: str, doc: str) -> Histogram:
            h = Histogram(name, doc, label, buckets=LATENCY_BUCKETS, registry=r)
            return h

        self._ttft = hist("pdx:time_to_first_token_seconds", "Request in -> first token out")
        self._itl = hist("pdx:inter_token_latency_seconds", "Gap between consecutive tokens")
        self._tpot = hist("pdx:request_time_per_output_token_seconds",
                          "Per request: (E2E - TTFT) / (tokens - 1)")  # fmt: skip
        self._e2e = hist("pdx:e2e_request_latency_seconds", "Request in -> last token out")
        self._running = Gauge("pdx:num_requests_running", "Requests generating tokens", label,
                              registry=r)  # fmt: skip
        self._waiting = Gauge("pdx:num_requests_waiting",
                              "Requests admitted, first token not out yet (queue + prefill)",
                              label, registry=r)  # fmt: skip
        self._prompt_tokens = Counter("pdx:prompt_tokens", "Prompt tokens of finished requests",
                                      label, registry=r)  # fmt: skip
        self._generation_tokens = Counter("pdx:generation_tokens", "Tokens generated", label,
                                          registry=r)  # fmt: skip
        self._success = Counter("pdx:request_success", "Finished requests by finish reason",
                                [*label, "finished_reason"], registry=r)  # fmt: skip
        m = self.model_name
        self.itl = self._itl.labels(m)
        self.running = self._running.labels(m)
        self.waiting = self._waiting.labels(m)
        self.generation_tokens = self._generation_tokens.labels(m)
        # Every finished request records into these: the children are looked up once, not
        # through labels() (its validation and lock) on every request.
        self._ttft_m, self._tpot_m = self._ttft.labels(m), self._tpot.labels(m)
        self._e2e_m, self._prompt_tokens_m = self._e2e.labels(m), self._prompt_tokens.labels(m)
        self._by_label: dict[tuple[object, tuple[str, ...]], Any] = {}

    def _child(self, metric: Any, *values: str) -> Any:
        """``metric.labels(*values)``, looked up once."""
        key = (metric, values)
        child = self._by_label.get(key)
        if child is None:
            child = self._by_label[key] = metric.labels(*values)
        return child

    def finished(
        self,
        route: str,
        finish_reason: str,
        ttft_s: float | None,
        e2e_s: float,
        tokens: int,
        prompt_tokens: int,
    ) -> None:
        """Record one finished choice (``prompt_tokens`` only for a request's first choice)."""
        if ttft_s is not None:
            self._child(self.ttft, route).observe(ttft_s)
            self._ttft_m.observe(ttft_s)
            if tokens > 1:
                tpot = (e2e_s - ttft_s) / (tokens - 1)
                self._child(self.tpot, route).observe(tpot)
                self._tpot_m.observe(tpot)
        self._e2e_m.observe(e2e_s)
        if prompt_tokens:
            self._prompt_tokens_m.inc(prompt_tokens)
        self._child(self._success, self.model_name, finish_reason or "abort").inc()
