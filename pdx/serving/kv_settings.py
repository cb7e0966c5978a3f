"""The transfer layer's configs for a deployed pair, from the deploy config.

The KV store a prefill instance holds and the KV client each instance uses are configured
by :mod:`pdx.transfer.contract`'s own models. Every ``kv.*`` key of the deploy config is
either named below as the source of one contract field, or declared deploy-only; nothing is
dropped on the way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdx.serving.deploy_config import DeployConfig, KVConfig, NodeOptions
from pdx.tls import tls_for
from pdx.transfer.contract import KVClientConfig, KVStoreConfig

#: ``kv.<key>`` → the :class:`KVStoreConfig` field it sets.
STORE_FIELDS: dict[str, str] = {
    "store_budget_bytes": "budget_bytes",
    "kv_ttl_seconds": "kv_ttl_seconds",
    "max_inflight_kv": "max_inflight_kv",
    "congestion_control": "congestion_control",
}
#: ``kv.<key>`` → the :class:`KVClientConfig` field it sets.
CLIENT_FIELDS: dict[str, str] = {
    "kv_transfer_timeout_ms": "kv_transfer_timeout_ms",
    "kv_retry_budget": "kv_retry_budget",
    "chunk_size_kb": "chunk_size_kb",
    "streams": "streams",
    "connections": "connections",
    "congestion_control": "congestion_control",
    "link_gbps": "link_gbps",
    "transport": "transport",
}
#: ``kv.<key>``s no contract config has: how prefill encodes and stores, and the deployment's
#: fault proxy and audit files (``audit_dir`` names each store's ``audit_path``).
#: ``max_link_gbps``/``max_link_share`` set the stores' ``max_get_gbps`` (each prefill's share).
DEPLOY_ONLY: frozenset[str] = frozenset(
    {
        "codec",
        "streaming",
        "via_proxy",
        "proxy_host",
        "proxy_control_host",
        "audit_dir",
        "max_link_gbps",
        "max_link_share",
    }
)


def _mapped(kv: KVConfig, fields: dict[str, str]) -> dict[str, Any]:
    return {name: getattr(kv, key) for key, name in fields.items()}


def kv_store_config(cfg: DeployConfig, opts: NodeOptions) -> KVStoreConfig:
    """The store a prefill instance holds, from the deploy config."""
    kv, pc = cfg.kv, cfg.prefill
    cap = kv.link_cap_gbps
    return KVStoreConfig.model_validate(
        {
            **_mapped(kv, STORE_FIELDS),
            "max_get_gbps": None if cap is None else cap / max(pc.count, 1),
            "host": opts.host or pc.host,
            "port": opts.pick_port(pc.kv_port, opts.kv_port),
            "tls": tls_for(opts.cert_dir, "kv-store"),
            "audit_path": (
                kv.audit_dir / f"kv-store-prefill-{opts.index}.jsonl" if kv.audit_dir else None
            ),
        }
    )


def dialable(host: str) -> str:
    """An address a peer can dial for ``host`` (a wildcard bind address is not one)."""
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def kv_client_config(cfg: DeployConfig, client_id: str) -> KVClientConfig:
    """Transfer parameters (deadline, retry budget, chunk size) from the deploy config."""
    kv = cfg.kv
    values = _mapped(kv, CLIENT_FIELDS)
    if kv.kv_transfer_timeout_ms is not None:
        values["kv_transfer_timeout_ms"] = int(kv.kv_transfer_timeout_ms)
    if kv.via_proxy:  # the fault proxy sits on the store's gRPC port: every KV byte must cross it
        values["transport"] = "grpc"
    return KVClientConfig.model_validate({**values, "client_id": client_id})


@dataclass(frozen=True)
class PrefillKV:
    """Everything a prefill process takes from ``kv.*``: the store it holds, the client that
    writes into it, and how it encodes and stores each prompt's KV."""

    store: KVStoreConfig
    client: KVClientConfig
    codec: str
    streaming: bool

    @property
    def ttl_s(self) -> int:
        """The TTL each stored object gets (the store's default)."""
        return self.store.kv_ttl_seconds


def prefill_kv(cfg: DeployConfig, opts: NodeOptions) -> PrefillKV:
    """A prefill instance's KV settings, from the deploy config and its node options."""
    return PrefillKV(
        store=kv_store_config(cfg, opts),
        client=kv_client_config(cfg, "prefill"),
        codec=cfg.kv.codec,
        streaming=cfg.kv.streaming,
    )
