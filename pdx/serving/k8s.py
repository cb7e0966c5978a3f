"""``pdx deploy --render k8s OUTDIR``: manifests for two sites from the same deploy config.

Site A holds the prefill instances (each a Deployment + Service, since a kv_id lives in one
instance's store and decode must reach that very instance), site B the decode instances and
the gateway. Mutual-TLS material goes into Secrets (certificates name each Service's DNS
name), the deploy YAML into a ConfigMap, readiness uses native gRPC probes on a plaintext
health-only port (Kubernetes gRPC probes cannot speak TLS).
"""

from __future__ import annotations

import base64
import tempfile
from pathlib import Path
from typing import Any

import yaml

from pdx.serving.deploy_config import DeployConfig, Resources, to_yaml

CONFIG_MOUNT = "/etc/pdx/config"
TLS_MOUNT = "/etc/pdx/tls"


def _fqdn(cfg: DeployConfig, name: str, namespace: str) -> str:
    return f"{name}.{namespace}.{cfg.k8s.cluster_domain}"


def _secret(name: str, namespace: str, files: dict[str, bytes]) -> dict[str, Any]:
    data = {k: base64.b64encode(v).decode() for k, v in sorted(files.items())}
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": name, "namespace": namespace}, "data": data}  # fmt: skip


def _config_map(cfg: DeployConfig, namespace: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "pdx-deploy", "namespace": namespace},
            "data": {"deploy.yaml": to_yaml(cfg)}}  # fmt: skip


def _namespace(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}


def _service(name: str, namespace: str, ports: dict[str, int]) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": namespace, "labels": {"app": name}},
        "spec": {"selector": {"app": name},
                 "ports": [{"name": n, "port": p, "targetPort": p} for n, p in ports.items()]},
    }  # fmt: skip


def _resources(r: Resources) -> dict[str, Any]:
    return {"requests": {"cpu": r.cpu, "memory": r.memory}}


def _deployment(
    name: str, namespace: str, container: dict[str, Any], tls_secret: str
) -> dict[str, Any]:
    volumes = [
        {"name": "config", "configMap": {"name": "pdx-deploy"}},
        {"name": "tls", "secret": {"secretName": tls_secret, "defaultMode": 0o400}},
    ]
    container["volumeMounts"] = [
        {"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True},
        {"name": "tls", "mountPath": TLS_MOUNT, "readOnly": True},
    ]
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace, "labels": {"app": name}},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": name}},
            "template": {"metadata": {"labels": {"app": name}},
                         "spec": {"containers": [container], "volumes": volumes,
                                  "terminationGracePeriodSeconds": 30}},
        },
    }  # fmt: skip


def _node_container(
    cfg: DeployConfig, role: str, index: int, advertise: str, resources: Resources
) -> dict[str, Any]:
    k = cfg.k8s
    args = ["-m", f"pdx.serving.{role}", f"{CONFIG_MOUNT}/deploy.yaml", str(index),
            "--cert-dir", TLS_MOUNT, "--host", "0.0.0.0", "--port", str(k.grpc_port),
            "--advertise-host", advertise, "--health-port", str(k.health_port)]  # fmt: skip
    ports = [{"name": "grpc", "containerPort": k.grpc_port},
             {"name": "health", "containerPort": k.health_port}]  # fmt: skip
    if role == "prefill":
        args += ["--kv-port", str(k.kv_port)]
        ports.insert(1, {"name": "kv", "containerPort": k.kv_port})
    service = f"pdx.serving.v1.{role.capitalize()}"
    return {
        "name": role, "image": k.image, "command": ["python"], "args": args, "ports": ports,
        "readinessProbe": {"grpc": {"port": k.health_port, "service": service},
                           "periodSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {"grpc": {"port": k.health_port},
                          "initialDelaySeconds": 60, "periodSeconds": 10},
        "resources": _resources(resources),
    }  # fmt: skip


def _gateway_container(
    cfg: DeployConfig, prefills: list[str], decodes: list[str]
) -> dict[str, Any]:
    k = cfg.k8s
    args = ["-m", "pdx.serving.gateway", f"{CONFIG_MOUNT}/deploy.yaml", "--cert-dir", TLS_MOUNT,
            "--host", "0.0.0.0", "--port", str(k.gateway_port)]  # fmt: skip
    for addr in prefills:
        args += ["--prefill", f"{addr}:{k.grpc_port}"]
    for addr in decodes:
        args += ["--decode", f"{addr}:{k.grpc_port}"]
    http = {"port": k.gateway_port}
    return {
        "name": "gateway", "image": k.image, "command": ["python"], "args": args,
        "ports": [{"name": "http", "containerPort": k.gateway_port}],
        "readinessProbe": {"httpGet": {"path": "/readyz", **http}, "periodSeconds": 5},
        "livenessProbe": {"httpGet": {"path": "/healthz", **http}, "initialDelaySeconds": 10},
        "resources": _resources(k.gateway_resources),
    }  # fmt: skip


def _certificates(cfg: DeployConfig, identities: dict[str, str]) -> dict[str, dict[str, bytes]]:
    """Per identity name: {"cert", "key"}; plus "ca". ``identities`` maps name → role.

    With ``tls.dir`` the user's files are used by role (``prefill``, ``decode``, ``gateway``);
    otherwise a fresh CA signs one certificate per identity, named (and valid) for it.
    """
    if cfg.tls.dir is not None:
        d = cfg.tls.dir
        out = {"ca": {"cert": (d / "ca.pem").read_bytes()}}
        for name, role in identities.items():
            out[name] = {"cert": (d / f"{role}.pem").read_bytes(),
                         "key": (d / f"{role}.key").read_bytes()}  # fmt: skip
        return out
    from pdx.tls import init_certs

    with tempfile.TemporaryDirectory(prefix="pdx-k8s-certs-") as tmp:
        init_certs(tmp, list(identities), days=365)
        d = Path(tmp)
        out = {"ca": {"cert": (d / "ca.pem").read_bytes()}}
        for n in identities:
            out[n] = {"cert": (d / f"{n}.pem").read_bytes(), "key": (d / f"{n}.key").read_bytes()}
        return out


def _identity(certs: dict[str, dict[str, bytes]], name: str, *as_names: str) -> dict[str, bytes]:
    files = {"ca.pem": certs["ca"]["cert"]}
    for alias in as_names:
        files[f"{alias}.pem"] = certs[name]["cert"]
        files[f"{alias}.key"] = certs[name]["key"]
    return files


def build_manifests(cfg: DeployConfig) -> dict[str, list[dict[str, Any]]]:
    """Documents per file: ``site-a.yaml`` (prefill) and ``site-b.yaml`` (decode + gateway)."""
    k = cfg.k8s
    a_ns, b_ns = k.site_a_namespace, k.site_b_namespace
    prefills = [_fqdn(cfg, f"pdx-prefill-{i}", a_ns) for i in range(cfg.prefill.count)]
    decodes = [_fqdn(cfg, f"pdx-decode-{j}", b_ns) for j in range(cfg.decode.count)]
    roles = {**dict.fromkeys(prefills, "prefill"), **dict.fromkeys(decodes, "decode")}
    certs = _certificates(cfg, {**roles, "gateway": "gateway"})
    site_a = [_namespace(a_ns), _config_map(cfg, a_ns)]
    for i, host in enumerate(prefills):
        name = f"pdx-prefill-{i}"
        site_a.append(_secret(f"{name}-tls", a_ns, _identity(certs, host, "prefill", "kv-store")))
        container = _node_container(cfg, "prefill", i, host, k.prefill_resources)
        site_a.append(_deployment(name, a_ns, container, f"{name}-tls"))
        site_a.append(_service(name, a_ns, {"grpc": k.grpc_port, "kv": k.kv_port}))
    site_b = [_namespace(b_ns), _config_map(cfg, b_ns)]
    for j, host in enumerate(decodes):
        name = f"pdx-decode-{j}"
        site_b.append(_secret(f"{name}-tls", b_ns, _identity(certs, host, "decode")))
        container = _node_container(cfg, "decode", j, host, k.decode_resources)
        site_b.append(_deployment(name, b_ns, container, f"{name}-tls"))
        site_b.append(_service(name, b_ns, {"grpc": k.grpc_port}))
    site_b.append(_secret("pdx-gateway-tls", b_ns, _identity(certs, "gateway", "gateway")))
    gateway = _gateway_container(cfg, prefills, decodes)
    site_b.append(_deployment("pdx-gateway", b_ns, gateway, "pdx-gateway-tls"))
    site_b.append(_service("pdx-gateway", b_ns, {"http": k.gateway_port}))
    return {"site-a.yaml": site_a, "site-b.yaml": site_b}


def render_k8s(cfg: DeployConfig, out_dir: Path) -> list[Path]:
    """Write the manifests (and the deploy YAML they embed) into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, docs in build_manifests(cfg).items():
        path = out_dir / name
        path.write_text(yaml.safe_dump_all(docs, sort_keys=False))
        written.append(path)
    cfg_path = out_dir / "deploy.yaml"
    cfg_path.write_text(to_yaml(cfg))
    return [*written, cfg_path]
