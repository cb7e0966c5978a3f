"""The transfer layer's configs for a deployed pair, from the deploy config.

The KV store a prefill instance holds and the KV client each instance uses are configured
by :mod:`pdx.transfer.contract`'s own models; these functions fill them from a
:class:`DeployConfig` and a node's options.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel

from pdx.serving.deploy_config import DeployConfig, NodeOptions
from pdx.tls import tls_for
from pdx.transfer.contract import KVClientConfig, KVStoreConfig


def kv_store_config(cfg: DeployConfig, opts: NodeOptions) -> KVStoreConfig:
    """The store a prefill instance holds, from the deploy config."""
    kv, pc = cfg.kv, cfg.prefill
    return _known(
        KVStoreConfig,
        host=opts.host or pc.host,
        port=opts.pick_port(pc.kv_port, opts.kv_port),
        budget_bytes=kv.store_budget_bytes,
        kv_ttl_seconds=kv.kv_ttl_seconds,
        max_inflight_kv=kv.max_inflight_kv,
        congestion_control=kv.congestion_control,
        tls=tls_for(opts.cert_dir, "kv-store"),
        audit_path=kv.audit_dir / f"kv-store-prefill-{opts.index}.jsonl" if kv.audit_dir else None,
    )


def dialable(host: str) -> str:
    """An address a peer can dial for ``host`` (a wildcard bind address is not one)."""
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def kv_client_config(cfg: DeployConfig, client_id: str) -> KVClientConfig:
    """Transfer parameters (deadline, retry budget, chunk size) from the deploy config."""
    kv = cfg.kv
    return _known(
        KVClientConfig,
        kv_transfer_timeout_ms=(
            int(kv.kv_transfer_timeout_ms) if kv.kv_transfer_timeout_ms is not None else None
        ),
        streams=kv.streams,
        connections=kv.connections,
        congestion_control=kv.congestion_control,
        link_gbps=kv.link_gbps,
        kv_retry_budget=kv.kv_retry_budget,
        chunk_size_kb=kv.chunk_size_kb,
        kv_ttl_seconds=kv.kv_ttl_seconds,
        client_id=client_id,
        # The fault proxy sits on the store's gRPC port: every KV byte must cross it.
        transport="grpc" if kv.via_proxy else kv.transport,
    )


M = TypeVar("M", bound=BaseModel)


def _known(model: type[M], **values: Any) -> M:
    # Pass only the fields the transfer layer's config defines (it owns that schema).
    return model.model_validate({k: v for k, v in values.items() if k in model.model_fields})
