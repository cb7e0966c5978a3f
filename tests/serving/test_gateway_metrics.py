"""The gateway's finished-request series land under the right labels (children are cached)."""

from __future__ import annotations

from prometheus_client import generate_latest

from pdx.serving.gateway.metrics import GatewayMetrics


def test_finished_requests_are_counted_per_route_and_reason() -> None:
    m = GatewayMetrics("tiny")
    m.finished("disaggregated", "length", 0.01, 0.05, 8, 100)
    m.finished("disaggregated", "", 0.01, 0.05, 8, 0)
    m.finished("local", "stop", 0.02, 0.04, 1, 50)
    t = generate_latest(m.registry).decode()
    assert 'pdx:request_success_total{finished_reason="length",model_name="tiny"} 1.0' in t
    assert 'pdx:request_success_total{finished_reason="abort",model_name="tiny"} 1.0' in t
    assert 'pdx_gateway_ttft_seconds_count{route="disaggregated"} 2.0' in t
    assert 'pdx_gateway_ttft_seconds_count{route="local"} 1.0' in t
    assert 'pdx_gateway_tpot_seconds_count{route="local"} 0.0' not in t  # one token: no TPOT
    assert 'pdx:prompt_tokens_total{model_name="tiny"} 150.0' in t
    assert 'pdx:e2e_request_latency_seconds_count{model_name="tiny"} 3.0' in t
