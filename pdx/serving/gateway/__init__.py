"""The gateway: an OpenAI-compatible HTTP API in front of the prefill and decode services.

``POST /v1/completions`` and ``/v1/chat/completions`` (through the model's chat template),
``stream: true`` as server-sent events ending ``data: [DONE]``, ``GET /v1/models[/{id}]``,
``GET /openapi.json`` (generated from the request and response models), ``/metrics``, and
the pdx request field ``pdx_route``. Every response carries a ``pdx`` object (route,
kv_bytes, transfer_ms, retries, degraded and why). Errors use OpenAI's shape, answered once
in :func:`pdx.serving.gateway.app.openai_errors`.

Modules: :mod:`.app` (HTTP routes, lifecycle, health polling), :mod:`.protocol` (request
and response models, the error shape), :mod:`.flow` (one choice through prefill and
decode), :mod:`.responses` (bodies and server-sent events), :mod:`.openapi` (the OpenAPI
document), :mod:`.metrics` (Prometheus series).
"""

from pdx.serving.gateway.app import Gateway, build_gateway
from pdx.serving.gateway.flow import MARKS, Flow, Outcome
from pdx.serving.gateway.metrics import GatewayMetrics
from pdx.serving.gateway.protocol import UNSUPPORTED, CompletionRequest, HTTPProblem

__all__ = [
    "MARKS",
    "UNSUPPORTED",
    "CompletionRequest",
    "Flow",
    "Gateway",
    "GatewayMetrics",
    "HTTPProblem",
    "Outcome",
    "build_gateway",
]
