"""``pdx deploy --render k8s``: two sites of manifests that load, wire up and round-trip."""

from __future__ import annotations

import base64
from typing import Any

import pytest
import yaml
from cryptography import x509
from k8s_helpers import Docs, by_kind, container, render, validate_strict

from pdx.serving.deploy_config import load_deploy_config

SETS = ["prefill.count=2", "decode.count=2", "k8s.image=registry.local/pdx:1"]


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Docs]:
    return render(tmp_path_factory.mktemp("k8s"), SETS)


def test_every_manifest_passes_strict_schema_validation(rendered: dict[str, Docs]) -> None:
    validate_strict(rendered)


def test_site_a_holds_prefill_site_b_decode_and_gateway(rendered: dict[str, Any]) -> None:
    a, b = rendered["site-a.yaml"], rendered["site-b.yaml"]
    assert set(by_kind(a, "Deployment")) == {"pdx-prefill-0", "pdx-prefill-1"}
    assert set(by_kind(b, "Deployment")) == {"pdx-decode-0", "pdx-decode-1", "pdx-gateway"}
    assert {d["metadata"]["namespace"] for d in a if d["kind"] != "Namespace"} == {"pdx-site-a"}
    assert {d["metadata"]["namespace"] for d in b if d["kind"] != "Namespace"} == {"pdx-site-b"}
    for docs in (a, b):
        assert {"Namespace", "ConfigMap", "Secret", "Deployment", "Service"} == {
            d["kind"] for d in docs
        }


def test_ports_services_and_probes(rendered: dict[str, Any]) -> None:
    a, b = rendered["site-a.yaml"], rendered["site-b.yaml"]
    svc = by_kind(a, "Service")["pdx-prefill-0"]["spec"]
    assert {p["name"]: p["port"] for p in svc["ports"]} == {"grpc": 50051, "kv": 50052}
    pre = container(by_kind(a, "Deployment")["pdx-prefill-0"])
    assert {p["name"]: p["containerPort"] for p in pre["ports"]} == {
        "grpc": 50051, "kv": 50052, "health": 8081,
    }  # fmt: skip
    assert pre["readinessProbe"]["grpc"] == {"port": 8081, "service": "pdx.serving.v1.Prefill"}
    assert pre["resources"]["requests"] == {"cpu": "2", "memory": "8Gi"}
    assert pre["image"] == "registry.local/pdx:1"
    dec = container(by_kind(b, "Deployment")["pdx-decode-1"])
    assert dec["readinessProbe"]["grpc"]["service"] == "pdx.serving.v1.Decode"
    assert dec["args"][:5] == ["-m", "pdx.serving.decode", "/etc/pdx/config/deploy.yaml", "1",
                               "--cert-dir"]  # fmt: skip
    gw = container(by_kind(b, "Deployment")["pdx-gateway"])
    assert gw["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": 8000}
    args = gw["args"]
    prefills = [args[i + 1] for i, v in enumerate(args) if v == "--prefill"]
    decodes = [args[i + 1] for i, v in enumerate(args) if v == "--decode"]
    assert prefills == [f"pdx-prefill-{i}.pdx-site-a.svc.cluster.local:50051" for i in (0, 1)]
    assert decodes == [f"pdx-decode-{i}.pdx-site-b.svc.cluster.local:50051" for i in (0, 1)]
    assert by_kind(b, "Service")["pdx-gateway"]["spec"]["ports"][0]["port"] == 8000


def test_config_map_round_trips(rendered: dict[str, Any]) -> None:
    for docs in rendered.values():
        text = by_kind(docs, "ConfigMap")["pdx-deploy"]["data"]["deploy.yaml"]
        cfg = load_deploy_config(base=yaml.safe_load(text))
        assert cfg == load_deploy_config(dotted=SETS)


def test_secrets_hold_mtls_material_named_for_each_service(rendered: dict[str, Any]) -> None:
    secrets = by_kind(rendered["site-a.yaml"], "Secret")
    data = secrets["pdx-prefill-1-tls"]["data"]
    assert set(data) == {"ca.pem", "prefill.pem", "prefill.key", "kv-store.pem", "kv-store.key"}
    cert = x509.load_pem_x509_certificate(base64.b64decode(data["kv-store.pem"]))
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "pdx-prefill-1.pdx-site-a.svc.cluster.local" in names.get_values_for_type(x509.DNSName)
    gw = by_kind(rendered["site-b.yaml"], "Secret")["pdx-gateway-tls"]["data"]
    assert gw["ca.pem"] == data["ca.pem"]  # one CA across both sites
    every_key = [k for docs in rendered.values() for s in by_kind(docs, "Secret").values()
                 for k in s["data"]]  # fmt: skip
    assert "ca.key" not in every_key  # the CA's private key never leaves the render
