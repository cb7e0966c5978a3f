"""contracts/kv_contract.yaml is the rule book: the code must do what it says."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import yaml

from pdx._proto import kv_transfer_pb2 as pb
from pdx.config import build_config
from pdx.errors import ConfigError
from pdx.transfer import contract as c
from pdx.transfer.rpc import _FROM_STATUS, SERVICE_NAME

ROOT = Path(__file__).resolve().parents[2]
CONTRACT = yaml.safe_load((ROOT / "contracts" / "kv_contract.yaml").read_text())


def test_version_and_service_name() -> None:
    assert CONTRACT["version"] == c.CONTRACT_VERSION == pb.DESCRIPTOR.package
    assert CONTRACT["service"] == SERVICE_NAME


def test_error_codes_equal_enum_and_proto() -> None:
    names = set(CONTRACT["errors"])
    assert names == {e.value for e in c.KVErrorCode}
    proto = {v.name for v in pb.KVErrorCode.DESCRIPTOR.values} - {"KV_ERROR_UNSPECIFIED"}
    assert names == proto


def test_error_statuses_and_retryability() -> None:
    for name, rule in CONTRACT["errors"].items():
        code = c.KVErrorCode(name)
        assert c.GRPC_STATUS[code] == rule["grpc_status"], name
        assert hasattr(grpc.StatusCode, rule["grpc_status"])
        assert (code in c.RETRYABLE) is rule["retryable"], name


def test_client_maps_every_status_back_to_a_contract_code() -> None:
    for code, status in c.GRPC_STATUS.items():
        back = _FROM_STATUS[getattr(grpc.StatusCode, status)]
        assert c.GRPC_STATUS[back] == status, code


def test_ttl_bounds_are_what_config_validation_enforces() -> None:
    ttl = CONTRACT["lifetime"]["ttl_s"]
    assert (ttl["min"], ttl["max"], ttl["default"]) == (c.TTL_MIN_S, c.TTL_MAX_S, c.DEFAULT_TTL_S)
    for ok in (ttl["min"], ttl["default"], ttl["max"]):
        build_config(c.KVStoreConfig, source="t", base={"kv_ttl_seconds": ok})
    for bad in (ttl["min"] - 1, ttl["max"] + 1):
        with pytest.raises(ConfigError) as err:
            build_config(c.KVStoreConfig, source="kv.yaml", base={"kv_ttl_seconds": bad})
        assert "kv_ttl_seconds" in str(err.value) and str(bad) in str(err.value)
    assert CONTRACT["lifetime"]["lease"]["hard_max_lifetime_s"] == c.TTL_MAX_S


def test_chunk_bounds_are_enforced() -> None:
    chunk = CONTRACT["transfer"]["chunk_size_kb"]
    assert (
        chunk["min"],
        chunk["max"],
        chunk["default"],
    ) == (c.CHUNK_MIN_KB, c.CHUNK_MAX_KB, c.DEFAULT_CHUNK_KB)
    for bad in (chunk["min"] - 1, chunk["max"] + 1):
        with pytest.raises(ConfigError):
            build_config(c.KVClientConfig, source="t", base={"chunk_size_kb": bad})


def test_defaults_match_config_defaults() -> None:
    actual = c.config_defaults()
    for side in ("store", "client"):
        for key, value in CONTRACT["defaults"][side].items():
            assert actual[side][key] == value, f"{side}.{key}"
    t = CONTRACT["transfer"]
    client = actual["client"]
    assert client["kv_transfer_timeout_ms"] == t["kv_transfer_timeout_ms"]["default"]
    assert client["kv_retry_budget"] == t["kv_retry_budget"]["default"]
    assert actual["store"]["max_inflight_kv"] == t["max_inflight_kv"]["default"]
    for key in ("retry_ratio", "retry_min_per_s", "retry_window_s"):
        assert client[key] == t["global_retry_budget"][key]
    lease = CONTRACT["lifetime"]["lease"]["lease_s"]
    assert (actual["store"]["lease_s"], c.MAX_LEASE_S) == (lease["default"], lease["max"])


def test_kv_id_rules() -> None:
    rule = CONTRACT["kv_id"]
    kv_id = c.new_kv_id("qwen3-32b:r2", 1_700_000_000_123)
    parsed = c.parse_kv_id(kv_id)
    assert len(parsed.random_hex) * 4 == rule["random_bits"]
    assert (parsed.model_version, parsed.created_at_ms) == ("qwen3-32b:r2", 1_700_000_000_123)
    assert rule["model_version_pattern"] == c._MODEL_VERSION.pattern
    assert re.fullmatch(r"kv1\.[0-9a-f]{32}\.\d+\..+", kv_id)


def test_metadata_keys_named_in_contract() -> None:
    text = (ROOT / "contracts" / "kv_contract.yaml").read_text()
    assert c.ERROR_METADATA_KEY in text and c.RESUME_METADATA_KEY in text


def test_generated_code_is_up_to_date(tmp_path: Path) -> None:
    out = tmp_path / "_proto"
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--out", str(out)],
        check=True,
        capture_output=True,
    )
    for path in sorted(out.iterdir()):
        assert path.read_text() == (ROOT / "pdx" / "_proto" / path.name).read_text(), path.name


def test_data_plane_rules_are_what_the_code_does() -> None:
    from pdx.transfer.dataplane import framing as kv_data

    dp = CONTRACT["data_plane"]
    assert dp["frame_header"]["bytes"] == kv_data.FRAME.size
    assert kv_data.FRAME.format.startswith("<")  # little-endian
    assert dp["kinds"] == {k.name: k.value for k in kv_data.Kind}
    assert dp["version"] == kv_data.VERSION == c.CONTRACT_VERSION
    assert "60 s" in dp["connections"] and kv_data.IDLE_TIMEOUT_S == 60
    defaults = c.config_defaults()
    assert defaults["store"]["data_plane"] is True and defaults["client"]["transport"] == "auto"
    proto = (ROOT / "contracts" / "kv_transfer.proto").read_text()
    for kind in kv_data.Kind:  # the proto's framing comment lists the same kinds
        assert re.search(rf"^//\s+{kind.value} {kind.name}\b", proto, re.M), kind.name
    assert "DataPlane" in {m.name for m in pb.DESCRIPTOR.services_by_name["KVStore"].methods}


def test_data_plane_tls_is_13_only_with_client_certificates(tmp_path: Path) -> None:
    import ssl

    from pdx.tls import init_certs, server_ssl_context

    init_certs(tmp_path)
    ctx = server_ssl_context(c.TLSConfig(cert_dir=tmp_path, name="kv-store"))
    assert ctx.minimum_version is ssl.TLSVersion.TLSv1_3
    assert ctx.verify_mode is ssl.CERT_REQUIRED


def test_streaming_rules_are_what_the_code_does() -> None:
    rules = CONTRACT["streaming"]
    assert rules["tail_max_bytes"] == c.TAIL_MAX_BYTES
    assert (
        "KV_INCOMPLETE" in rules["writer_ends"] and c.KVErrorCode.KV_INCOMPLETE not in c.RETRYABLE
    )
    methods = {m.name for m in pb.DESCRIPTOR.services_by_name["KVStore"].methods}
    assert "Open" in methods
    fields = pb.ObjectInfo.DESCRIPTOR.fields_by_name
    assert {"writing", "chunks_stored", "tail"} <= set(fields)
