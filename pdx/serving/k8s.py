"""``pdx deploy --render k8s OUTDIR``: manifests for two sites from the same deploy config.

Site A holds the prefill instances (each a Deployment + Service, since a kv_id lives in one
instance's store and decode must reach that very instance), site B the decode instances and
the gateway. Mutual-TLS material goes into Secrets (certificates name each Service's DNS
name), the deploy YAML into a ConfigMap, readiness uses native gRPC probes on a plaintext
health-only port (Kubernetes gRPC probes cannot speak TLS).

With ``engine: vllm`` the sites hold vLLM instances instead, each a Deployment and a headless
Service, started exactly as ``pdx deploy`` starts them locally (the command line and
environment come from :class:`VLLMEngines`), and site B the gateway running ``pdx deploy``
fronting them by their Service DNS names (``vllm.prefill_urls`` / ``vllm.decode_urls``).
NIXL advertises the pod's own address (its side channel host is the pod IP, UCX's worker
address names the pod's interfaces), so decode dials prefill pods directly, not a virtual IP:
the Services are headless (their names resolve to the pod IPs) and declare every port that
crosses the sites. UCX over TCP would listen on ports of the kernel's choosing; the pods set
``UCX_TCP_PORT_RANGE`` so that they lie in the declared range.
"""

from __future__ import annotations

import base64
import dataclasses
import math
import tempfile
from pathlib import Path
from typing import Any

import yaml

from pdx.errors import InputError
from pdx.serving.backends.presets import TINY_PRESETS
from pdx.serving.deploy_config import DeployConfig, to_yaml
from pdx.serving.engines.checkpoint import checkpoint_dir
from pdx.serving.engines.env import VLLMEnv
from pdx.serving.engines.vllm import (
    Instance,
    ModelInfo,
    Role,
    VLLMEngines,
    check_model_for_device,
    model_info,
)
from pdx.serving.k8s_config import Resources

CONFIG_MOUNT = "/etc/pdx/config"
TLS_MOUNT = "/etc/pdx/tls"
Manifests = dict[str, list[dict[str, Any]]]  # file name -> its documents


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


def _pod_deployment(
    name: str, namespace: str, pod: dict[str, Any], *, recreate: bool = False
) -> dict[str, Any]:
    """One replica of ``pod`` (``recreate``: the old pod goes before the new one starts)."""
    spec: dict[str, Any] = {
        "replicas": 1,
        "selector": {"matchLabels": {"app": name}},
        "template": {"metadata": {"labels": {"app": name}},
                     "spec": {**pod, "terminationGracePeriodSeconds": 30}},
    }  # fmt: skip
    if recreate:
        spec["strategy"] = {"type": "Recreate"}
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": name, "namespace": namespace, "labels": {"app": name}},
            "spec": spec}  # fmt: skip


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
    return _pod_deployment(name, namespace, {"containers": [container], "volumes": volumes})


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


def build_manifests(cfg: DeployConfig) -> Manifests:
    """Documents per file: ``site-a.yaml`` (prefill) and ``site-b.yaml`` (decode + gateway)."""
    return _render(cfg)[1]


def _render(cfg: DeployConfig) -> tuple[DeployConfig, Manifests, dict[str, str]]:
    """The deploy YAML the manifests embed, the documents per file, a header comment per file."""
    if cfg.engine == "vllm":
        embedded, files = _vllm_manifests(cfg)
        return embedded, files, _vllm_site_comments(cfg)
    return cfg, _pdx_manifests(cfg), {}


def _pdx_manifests(cfg: DeployConfig) -> Manifests:
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


# --- engine: vllm ----------------------------------------------------------------------

MODEL_MOUNT = "/models"  # where a tiny preset is exported at pod start (an emptyDir)
GPU = "nvidia.com/gpu"
# The tiny preset as a checkpoint, written by pdx's own code in pdx's image before vLLM starts.
EXPORT_TINY = ("import sys; from pathlib import Path; "
               "from pdx.serving.engines.checkpoint import export_tiny_checkpoint; "
               "export_tiny_checkpoint(Path(sys.argv[1]), sys.argv[2])")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class _VLLMPlan:
    """What every manifest of one render shares."""

    cfg: DeployConfig  # the gateway's deploy YAML (fronting the instances below)
    engines: VLLMEngines  # builds each instance's command line and environment
    prefills: list[str]  # Service names, site A
    decodes: list[str]  # Service names, site B
    preset: bool  # a tiny preset, exported into each vLLM pod before vLLM starts


def _vllm_device(choice: str) -> str:
    # A manifest cannot look for a GPU: ``auto`` asks for none (vllm_image's default is CPU).
    return "cuda" if choice == "cuda" else "cpu"


def _vllm_url(cfg: DeployConfig, name: str, namespace: str) -> str:
    return f"http://{_fqdn(cfg, name, namespace)}:{cfg.k8s.vllm_port}"


def _vllm_model(cfg: DeployConfig, device: str) -> ModelInfo:
    """The served model as the pods see it (a tiny preset: exported under ``MODEL_MOUNT``)."""
    v = cfg.vllm
    if v.model in TINY_PRESETS:
        pod_path = str(checkpoint_dir(Path(MODEL_MOUNT), v.model, 0))
    elif Path(v.model).is_absolute():
        pod_path = v.model
    else:
        raise InputError(
            "vllm.model", v.model, f"one of {sorted(TINY_PRESETS)} or an absolute checkpoint "
            "path (the pods see the checkpoint there: k8s.vllm_model_claim or the images)",
        )  # fmt: skip
    info = model_info(cfg, Path(v.model))  # reads config.json when this machine has it
    check_model_for_device(info.config, device, v.model)
    # A checkpoint only the cluster holds: vLLM takes its length from the model itself.
    limit = info.max_context_tokens if info.config else (v.max_model_len or 0)
    return dataclasses.replace(info, path=pod_path, max_context_tokens=limit)


def _vllm_plan(cfg: DeployConfig) -> _VLLMPlan:
    v, k = cfg.vllm, cfg.k8s
    if v.external:
        raise InputError(
            "vllm.prefill_urls", v.prefill_urls or v.decode_urls,
            "empty with --render k8s (the manifests start the instances; the gateway fronts them)",
        )  # fmt: skip
    if not cfg.security.allow_plaintext:
        raise InputError(
            "security.allow_plaintext", False, "true to render engine: vllm: prefill and decode "
            "run in two site namespaces and pdx does not encrypt vLLM's HTTP and NIXL traffic "
            "between them (a service mesh with mutual TLS, or a tunnel, is yours to add)",
        )  # fmt: skip
    device = _vllm_device(v.device)
    model = _vllm_model(cfg, device)
    prefills = [f"pdx-vllm-prefill-{i}" for i in range(cfg.prefill.count)]
    decodes = [f"pdx-vllm-decode-{j}" for j in range(cfg.decode.count)]
    data = cfg.model_dump(mode="json")
    data["vllm"].update(
        device=device, served_model_name=model.served_name,
        prefill_urls=[_vllm_url(cfg, n, k.site_a_namespace) for n in prefills],
        decode_urls=[_vllm_url(cfg, n, k.site_b_namespace) for n in decodes],
    )  # fmt: skip
    data["gateway"].update(host="0.0.0.0", port=k.gateway_port)
    data["prefill"]["netns"] = data["decode"]["netns"] = None
    gateway_cfg = DeployConfig.model_validate(data)
    # The instances' own settings; the audit file is only read on one machine, never in a pod.
    data["kv"]["audit_dir"] = None
    data["vllm"].update(prefill_urls=[], decode_urls=[])
    engines = VLLMEngines(DeployConfig.model_validate(data), work_dir=Path(MODEL_MOUNT))
    # Only the interpreter is used (argv's first word); the versions are the image's own.
    engines.env = VLLMEnv(python=k.vllm_python, vllm_version="", nixl_version=None,
                          torch_version=None, hooks=True, gpus=int(device == "cuda"))  # fmt: skip
    engines.device = device
    engines.model = model
    return _VLLMPlan(gateway_cfg, engines, prefills, decodes, preset=v.model in TINY_PRESETS)


def _ucx_range(cfg: DeployConfig) -> range:
    k = cfg.k8s
    return range(k.ucx_first_port, k.ucx_first_port + k.ucx_ports)


def _ucx_spec(cfg: DeployConfig) -> str:
    """The range as ``UCX_TCP_PORT_RANGE`` takes it (``first-last``, both inclusive)."""
    ucx = _ucx_range(cfg)
    return f"{ucx.start}-{ucx.stop - 1}"


def _vllm_ports(cfg: DeployConfig) -> dict[str, int]:
    """Every port of a vLLM instance, by name: HTTP, the NIXL side channel, UCX's range."""
    k = cfg.k8s
    ports = {"http": k.vllm_port, "nixl-side": k.nixl_side_channel_port}
    ports.update({f"ucx-{n}": p for n, p in enumerate(_ucx_range(cfg))})
    return ports


def _headless_service(name: str, namespace: str, ports: dict[str, int]) -> dict[str, Any]:
    service = _service(name, namespace, ports)
    service["spec"]["clusterIP"] = "None"  # the name resolves to the pod IP NIXL advertises
    return service


def _vllm_env(plan: _VLLMPlan, inst: Instance) -> list[dict[str, Any]]:
    env = plan.engines.environ(inst)
    env["UCX_TCP_PORT_RANGE"] = _ucx_spec(plan.cfg)  # the Service declares these ports
    out: list[dict[str, Any]] = []
    for name, value in env.items():
        if name == "VLLM_NIXL_SIDE_CHANNEL_HOST":  # bound and advertised: the pod's own IP
            out.append({"name": name, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}})
        else:
            out.append({"name": name, "value": value})
    return out


def _vllm_resources(r: Resources, device: str) -> dict[str, Any]:
    out = _resources(r)
    if device == "cuda":
        out["requests"][GPU] = "1"
        out["limits"] = {GPU: "1"}
    return out


def _model_volumes(plan: _VLLMPlan) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Volumes and mounts that give a container the checkpoint (none: the image holds it)."""
    claim, model = plan.cfg.k8s.vllm_model_claim, plan.engines.model
    assert model is not None
    if plan.preset:
        return ([{"name": "model", "emptyDir": {}}],
                [{"name": "model", "mountPath": MODEL_MOUNT}])  # fmt: skip
    if claim is None:
        return [], []
    return ([{"name": "model", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}],
            [{"name": "model", "mountPath": model.path, "readOnly": True}])  # fmt: skip


def _without_unknown_length(argv: list[str]) -> list[str]:
    """``--max-model-len 0`` (the model's length is unknown here) left to vLLM."""
    i = argv.index("--max-model-len")
    return [*argv[:i], *argv[i + 2 :]] if argv[i + 1] == "0" else argv


def _vllm_container(
    plan: _VLLMPlan, inst: Instance, mounts: list[dict[str, Any]]
) -> dict[str, Any]:
    cfg = plan.cfg
    argv = _without_unknown_length(plan.engines.argv(inst))
    side = cfg.k8s.prefill_resources if inst.role == "prefill" else cfg.k8s.decode_resources
    health = {"httpGet": {"path": "/health", "port": cfg.k8s.vllm_port}, "periodSeconds": 10}
    return {
        "name": "vllm", "image": cfg.k8s.vllm_image, "command": argv[:1], "args": argv[1:],
        "env": _vllm_env(plan, inst),
        "ports": [{"name": n, "containerPort": p} for n, p in _vllm_ports(cfg).items()],
        "startupProbe": {**health,
                         "failureThreshold": math.ceil(cfg.vllm.ready_timeout_s / 10)},
        "readinessProbe": {**health, "periodSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {**health, "failureThreshold": 3},
        "resources": _vllm_resources(side, plan.engines.device),
        "volumeMounts": [*mounts, {"name": "dshm", "mountPath": "/dev/shm"}],
    }  # fmt: skip


def _export_container(plan: _VLLMPlan, mounts: list[dict[str, Any]]) -> dict[str, Any]:
    k = plan.cfg.k8s
    return {"name": "export-model", "image": k.image, "command": ["python", "-c", EXPORT_TINY],
            "args": [MODEL_MOUNT, plan.cfg.vllm.model], "volumeMounts": mounts,
            "resources": _resources(k.gateway_resources)}  # fmt: skip


def _vllm_instance(
    plan: _VLLMPlan, role: Role, index: int, name: str, namespace: str
) -> list[dict[str, Any]]:
    cfg = plan.cfg
    inst = Instance(role, index, "0.0.0.0", cfg.k8s.vllm_port, cfg.k8s.nixl_side_channel_port)
    volumes, mounts = _model_volumes(plan)
    pod: dict[str, Any] = {
        "containers": [_vllm_container(plan, inst, mounts)],
        "volumes": [*volumes, {"name": "dshm", "emptyDir": {"medium": "Memory",
                                                           "sizeLimit": "1Gi"}}],
    }  # fmt: skip
    if plan.preset:
        pod["initContainers"] = [_export_container(plan, mounts)]
    # Recreate: never two pods of one instance (nor its GPU held twice) during an update.
    return [_pod_deployment(name, namespace, pod, recreate=True),
            _headless_service(name, namespace, _vllm_ports(cfg))]  # fmt: skip


def _vllm_gateway(plan: _VLLMPlan, namespace: str) -> list[dict[str, Any]]:
    k = plan.cfg.k8s
    volumes, mounts = ([], []) if plan.preset else _model_volumes(plan)
    http = {"port": k.gateway_port}
    container = {
        "name": "gateway", "image": k.image, "command": ["pdx"],
        "args": ["deploy", "--config", f"{CONFIG_MOUNT}/deploy.yaml", "--json"],
        "ports": [{"name": "http", "containerPort": k.gateway_port}],
        "readinessProbe": {"httpGet": {"path": "/readyz", **http}, "periodSeconds": 5},
        "livenessProbe": {"httpGet": {"path": "/healthz", **http}, "initialDelaySeconds": 30},
        "resources": _resources(k.gateway_resources),
        "volumeMounts": [{"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True},
                         *mounts],
    }  # fmt: skip
    pod = {
        "containers": [container],
        "volumes": [{"name": "config", "configMap": {"name": "pdx-deploy"}}, *volumes],
    }
    return [_pod_deployment("pdx-gateway", namespace, pod),
            _service("pdx-gateway", namespace, {"http": k.gateway_port})]  # fmt: skip


def _vllm_manifests(cfg: DeployConfig) -> tuple[DeployConfig, Manifests]:
    """The gateway's deploy YAML, and the documents per file: ``site-a.yaml`` (prefill),
    ``site-b.yaml`` (decode + gateway)."""
    plan = _vllm_plan(cfg)
    a_ns, b_ns = cfg.k8s.site_a_namespace, cfg.k8s.site_b_namespace
    site_a = [_namespace(a_ns)]
    for i, name in enumerate(plan.prefills):
        site_a += _vllm_instance(plan, "prefill", i, name, a_ns)
    site_b = [_namespace(b_ns), _config_map(plan.cfg, b_ns)]
    for j, name in enumerate(plan.decodes):
        site_b += _vllm_instance(plan, "decode", j, name, b_ns)
    site_b += _vllm_gateway(plan, b_ns)
    return plan.cfg, {"site-a.yaml": site_a, "site-b.yaml": site_b}


def _vllm_site_comments(cfg: DeployConfig) -> dict[str, str]:
    """A header per file: what it holds and which ports cross the sites."""
    k = cfg.k8s
    ports = ("# Ports between the sites, pod to pod (the headless Services declare them):\n"
             f"#   {k.vllm_port}/tcp  vLLM HTTP: the gateway (site B) -> every instance\n"
             f"#   {k.nixl_side_channel_port}/tcp  NIXL side channel: decode -> prefill "
             "handshake (bound on the pod IP)\n"
             f"#   {_ucx_spec(cfg)}/tcp  UCX over TCP, the KV itself: UCX_TCP_PORT_RANGE,\n"
             "#     one port per NIXL worker and network interface\n")  # fmt: skip
    return {
        "site-a.yaml": f"# Site A ({k.site_a_namespace}): vLLM prefill instances (kv_producer).\n"
        + ports,
        "site-b.yaml": f"# Site B ({k.site_b_namespace}): vLLM decode instances (kv_consumer) "
        "and the pdx gateway\n# (`pdx deploy` fronting them).\n" + ports,
    }


class _PlainDumper(yaml.SafeDumper):
    """Writes a repeated object out again instead of as a YAML anchor and alias."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def render_k8s(cfg: DeployConfig, out_dir: Path) -> list[Path]:
    """Write the manifests (and the deploy YAML they embed) into ``out_dir``."""
    embedded, files, comments = _render(cfg)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, docs in files.items():
        path = out_dir / name
        text = yaml.dump_all(docs, Dumper=_PlainDumper, sort_keys=False)
        path.write_text(comments.get(name, "") + text)
        written.append(path)
    cfg_path = out_dir / "deploy.yaml"
    cfg_path.write_text(to_yaml(embedded))
    return [*written, cfg_path]
