"""Each ``kv.*`` deploy key reaches the transfer contract's configs, or is declared deploy-only."""

from __future__ import annotations

from pathlib import Path

from pdx.serving.deploy_config import KVConfig, NodeOptions, load_deploy_config
from pdx.serving.kv_settings import (
    CLIENT_FIELDS,
    DEPLOY_ONLY,
    STORE_FIELDS,
    kv_client_config,
    kv_store_config,
    prefill_kv,
)
from pdx.transfer.contract import KVClientConfig, KVStoreConfig


def test_every_kv_key_maps_to_a_contract_field_or_is_deploy_only() -> None:
    keys = set(KVConfig.model_fields)
    mapped = set(STORE_FIELDS) | set(CLIENT_FIELDS)
    assert keys == mapped | DEPLOY_ONLY, sorted(keys ^ (mapped | DEPLOY_ONLY))
    assert not mapped & DEPLOY_ONLY
    assert set(STORE_FIELDS.values()) <= set(KVStoreConfig.model_fields)
    assert set(CLIENT_FIELDS.values()) <= set(KVClientConfig.model_fields)
    for key in DEPLOY_ONLY:
        assert key not in KVStoreConfig.model_fields and key not in KVClientConfig.model_fields


def test_shared_keys_take_the_contract_defaults() -> None:
    kv = KVConfig.model_validate({})
    for fields, model in ((STORE_FIELDS, KVStoreConfig), (CLIENT_FIELDS, KVClientConfig)):
        for key, name in fields.items():
            if key == "store_budget_bytes":  # a prefill's store shares its host with the model
                assert getattr(kv, key) == model.model_fields[name].default // 2
                continue
            assert getattr(kv, key) == model.model_fields[name].default, key


def test_every_mapped_value_arrives(tmp_path: Path) -> None:
    cfg = load_deploy_config(
        dotted=[
            "kv.store_budget_bytes=12345678",
            "kv.kv_ttl_seconds=200",
            "kv.max_inflight_kv=7",
            "kv.congestion_control=cubic",
            "kv.kv_transfer_timeout_ms=1500.7",
            "kv.kv_retry_budget=3",
            "kv.chunk_size_kb=256",
            "kv.streams=4",
            "kv.connections=2",
            "kv.link_gbps=25",
            "kv.transport=grpc",
            f"kv.audit_dir={tmp_path}",
        ]
    )
    store = kv_store_config(cfg, NodeOptions(index=1))
    assert (store.budget_bytes, store.kv_ttl_seconds, store.max_inflight_kv) == (12345678, 200, 7)
    assert store.congestion_control == "cubic"
    assert store.audit_path == tmp_path / "kv-store-prefill-1.jsonl"
    client = kv_client_config(cfg, "decode")
    assert client.kv_transfer_timeout_ms == 1500 and client.kv_retry_budget == 3
    assert (client.chunk_size_kb, client.streams, client.connections) == (256, 4, 2)
    assert (client.congestion_control, client.link_gbps, client.transport) == ("cubic", 25, "grpc")
    assert client.client_id == "decode"
    kv = prefill_kv(cfg, NodeOptions())
    assert kv.ttl_s == 200 and kv.client.client_id == "prefill" and kv.codec == "raw"


def test_via_proxy_sends_every_byte_over_grpc() -> None:
    cfg = load_deploy_config(dotted=["kv.via_proxy=true"])
    assert kv_client_config(cfg, "decode").transport == "grpc"


def test_the_link_cap_reaches_each_prefill_store_as_its_share() -> None:
    cfg = load_deploy_config(dotted=["kv.max_link_gbps=3", "prefill.count=2"])
    assert kv_store_config(cfg, NodeOptions(index=1)).max_get_gbps == 1.5
    both = load_deploy_config(dotted=["kv.link_gbps=10", "kv.max_link_share=0.2",
                                      "kv.max_link_gbps=5"])  # fmt: skip
    assert kv_store_config(both, NodeOptions()).max_get_gbps == 2.0  # the smaller cap wins
    assert kv_store_config(load_deploy_config(), NodeOptions()).max_get_gbps is None


def test_a_share_of_an_unknown_link_and_a_cap_on_grpc_are_refused() -> None:
    import pytest

    from pdx.errors import PdxError

    with pytest.raises(PdxError, match=r"kv.max_link_share: 0.5 is a share of kv.link_gbps"):
        load_deploy_config(dotted=["kv.max_link_share=0.5"])
    with pytest.raises(PdxError, match=r"kv.transport: grpc moves KV inside gRPC"):
        load_deploy_config(dotted=["kv.max_link_gbps=1", "kv.transport=grpc"])
