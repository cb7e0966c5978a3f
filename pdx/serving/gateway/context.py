"""What a choice's flow may use of its gateway: config, router, tokenizer, metrics, KV routes.

Both gateways (pdx's own pair and vLLM engines) build one :class:`FlowContext` and hand it
to every flow, so a flow never holds the gateway itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdx.serving.backends.tokenizer import Tokenizer
from pdx.serving.deploy_config import GatewayConfig
from pdx.serving.gateway.metrics import GatewayMetrics
from pdx.serving.router import Router

__all__ = ["FlowContext"]


@dataclass(kw_only=True)
class FlowContext:
    """The gateway's shared state a flow reads and feeds."""

    cfg: GatewayConfig
    router: Router
    tokenizer: Tokenizer
    metrics: GatewayMetrics
    synthetic: bool = False  # labelled in every response
    # kv endpoint → address to use (e.g. a fault proxy); the gateway's own dict, shared
    kv_route: dict[str, str] = field(default_factory=dict)
