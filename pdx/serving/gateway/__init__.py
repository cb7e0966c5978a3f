"""The gateway: an OpenAI-compatible HTTP API in front of the prefill and decode services.

``POST /v1/completions`` (and ``/v1/chat/completions`` when the model has a chat template),
``stream: true`` as server-sent events ending ``data: [DONE]``, ``return_token_ids``, and the
pdx request field ``pdx_route``. Every response carries a ``pdx`` object (route, kv_bytes,
transfer_ms, retries, degraded and why). Errors map to HTTP once, in
:func:`pdx.serving.gateway.protocol.http_error`.

Modules: :mod:`.app` (HTTP routes, lifecycle, health polling), :mod:`.protocol` (OpenAI
request parsing and errors), :mod:`.flow` (one request through prefill and decode),
:mod:`.responses` (bodies and server-sent events), :mod:`.metrics` (Prometheus series).
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
