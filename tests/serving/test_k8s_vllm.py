"""``pdx deploy --render k8s`` with ``engine: vllm``: vLLM instances in two sites, the gateway
fronting them by their Service names, every port that crosses the sites declared."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from k8s_helpers import Docs, by_kind, container, render, validate_strict
from typer.testing import CliRunner

from pdx.cli.main import app
from pdx.serving.deploy_config import DeployConfig, load_deploy_config
from pdx.serving.k8s import EXPORT_TINY

A, B = "pdx-site-a", "pdx-site-b"
# vLLM's traffic between the site namespaces is not encrypted: every render says it is meant
VLLM = ["engine=vllm", "security.allow_plaintext=true"]
UCX = list(range(20000, 20016))


def sites_for(tmp_path_factory: pytest.TempPathFactory, *sets: str) -> dict[str, Docs]:
    return render(tmp_path_factory.mktemp("k8s-vllm"), [*VLLM, *sets])


@pytest.fixture(scope="module")
def default(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Docs]:
    return sites_for(tmp_path_factory)


@pytest.fixture(scope="module")
def two_by_two(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Docs]:
    return sites_for(tmp_path_factory, "prefill.count=2", "decode.count=2")


@pytest.fixture(scope="module")
def cuda(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Docs]:
    return sites_for(tmp_path_factory, "vllm.device=cuda", "decode.count=2")


def instances(sites: dict[str, Docs]) -> list[dict[str, Any]]:
    """Every vLLM Deployment of both sites."""
    docs = [*sites["site-a.yaml"], *sites["site-b.yaml"]]
    return [d for name, d in by_kind(docs, "Deployment").items() if name != "pdx-gateway"]


def pod_containers(deployment: dict[str, Any]) -> list[dict[str, Any]]:
    spec = deployment["spec"]["template"]["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


def env_of(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def gateway_config(sites: dict[str, Docs]) -> DeployConfig:
    text = by_kind(sites["site-b.yaml"], "ConfigMap")["pdx-deploy"]["data"]["deploy.yaml"]
    return load_deploy_config(base=yaml.safe_load(text))


@pytest.mark.parametrize("case", ["default", "two_by_two", "cuda"])
def test_every_manifest_passes_strict_schema_validation(
    case: str, request: pytest.FixtureRequest
) -> None:
    validate_strict(request.getfixturevalue(case))


def test_site_a_holds_prefill_site_b_decode_and_gateway(two_by_two: dict[str, Docs]) -> None:
    a, b = two_by_two["site-a.yaml"], two_by_two["site-b.yaml"]
    assert set(by_kind(a, "Deployment")) == {"pdx-vllm-prefill-0", "pdx-vllm-prefill-1"}
    assert set(by_kind(b, "Deployment")) == {"pdx-vllm-decode-0", "pdx-vllm-decode-1",
                                             "pdx-gateway"}  # fmt: skip
    assert {d["metadata"]["namespace"] for d in a if d["kind"] != "Namespace"} == {A}
    assert {d["metadata"]["namespace"] for d in b if d["kind"] != "Namespace"} == {B}
    assert {d["kind"] for d in a} == {"Namespace", "Deployment", "Service"}
    assert {d["kind"] for d in b} == {"Namespace", "ConfigMap", "Deployment", "Service"}
    # one Service per Deployment, selecting exactly its pod
    for docs in (a, b):
        services = by_kind(docs, "Service")
        assert set(services) == set(by_kind(docs, "Deployment"))
        for name, svc in services.items():
            assert svc["spec"]["selector"] == {"app": name}
    roles = {d["metadata"]["name"]: json.loads(flag(container(d)["args"], "--kv-transfer-config"))
             for d in instances(two_by_two)}  # fmt: skip
    assert {n: r["kv_role"] for n, r in roles.items()} == {
        "pdx-vllm-prefill-0": "kv_producer", "pdx-vllm-prefill-1": "kv_producer",
        "pdx-vllm-decode-0": "kv_consumer", "pdx-vllm-decode-1": "kv_consumer",
    }  # fmt: skip
    assert {r["kv_connector"] for r in roles.values()} == {"NixlConnector"}


def test_services_declare_http_side_channel_and_the_ucx_range(default: dict[str, Docs]) -> None:
    for deployment in instances(default):
        name, ns = deployment["metadata"]["name"], deployment["metadata"]["namespace"]
        site = default["site-a.yaml" if ns == A else "site-b.yaml"]
        svc = by_kind(site, "Service")[name]["spec"]
        ports = {p["name"]: p["port"] for p in svc["ports"]}
        assert svc["clusterIP"] == "None"  # the name resolves to the pod IP NIXL advertises
        assert ports["http"] == 8000 and ports["nixl-side"] == 5600
        assert sorted(p for n, p in ports.items() if n.startswith("ucx-")) == UCX
        vllm = container(deployment)
        env = env_of(vllm)
        # the ports vLLM and UCX really use are the declared ones
        assert flag(vllm["args"], "--port") == "8000" and flag(vllm["args"], "--host") == "0.0.0.0"
        assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5600"
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert env["UCX_TCP_PORT_RANGE"] == f"{UCX[0]}-{UCX[-1]}"
        assert env["UCX_TLS"] == "tcp,self"  # CPU, as pdx deploy sets it
        assert {p["containerPort"] for p in vllm["ports"]} == set(ports.values())


def test_vllm_starts_as_pdx_deploy_starts_it(default: dict[str, Docs]) -> None:
    for deployment in instances(default):
        vllm = container(deployment)
        assert vllm["image"] == "pdx:0.1.0-vllm"
        assert vllm["command"] == ["/opt/pdx-vllm/bin/python"]  # the vllm image's PDX_VLLM_PYTHON
        assert vllm["args"][:2] == ["-m", "vllm.entrypoints.openai.api_server"]
        assert flag(vllm["args"], "--model") == "/models/tiny-llama-mha-seed0"
        assert flag(vllm["args"], "--served-model-name") == "tiny-llama-mha"
        assert flag(vllm["args"], "--kv-cache-memory-bytes") == str(128 * 1024**2)
        kv = json.loads(flag(vllm["args"], "--kv-transfer-config"))
        assert kv["kv_buffer_device"] == "cpu" and kv["kv_load_failure_policy"] == "fail"
        env = env_of(vllm)
        assert env["HF_HUB_OFFLINE"] == "1" and env["VLLM_NO_USAGE_STATS"] == "1"
        assert "CUDA_VISIBLE_DEVICES" not in env  # the device plugin picks the GPU
        (export,) = deployment["spec"]["template"]["spec"]["initContainers"]
        assert export["image"] == "pdx:0.1.0" and export["args"] == ["/models", "tiny-llama-mha"]


def test_readiness_probes_and_requests_on_every_container(default: dict[str, Docs]) -> None:
    docs = [*default["site-a.yaml"], *default["site-b.yaml"]]
    for name, deployment in by_kind(docs, "Deployment").items():
        for c in pod_containers(deployment):
            assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
            assert "nvidia.com/gpu" not in c["resources"].get("limits", {})
        for c in deployment["spec"]["template"]["spec"]["containers"]:
            probe = c["readinessProbe"]["httpGet"]
            if name == "pdx-gateway":
                assert probe == {"path": "/readyz", "port": 8000}
            else:
                assert probe == {"path": "/health", "port": 8000}
                assert c["startupProbe"]["failureThreshold"] * 10 >= 600  # vllm.ready_timeout_s


def test_gpu_requested_per_vllm_container_only_with_cuda(cuda: dict[str, Docs]) -> None:
    for deployment in instances(cuda):
        vllm, (export,) = container(deployment), deployment["spec"]["template"]["spec"][
            "initContainers"]  # fmt: skip
        assert vllm["resources"]["requests"]["nvidia.com/gpu"] == "1"
        assert vllm["resources"]["limits"] == {"nvidia.com/gpu": "1"}
        assert "nvidia.com/gpu" not in export["resources"]["requests"]
        assert "UCX_TLS" not in env_of(vllm)  # on a GPU UCX picks its transports
        kv = json.loads(flag(vllm["args"], "--kv-transfer-config"))
        assert kv["kv_buffer_device"] == "cuda"
        assert deployment["spec"]["strategy"] == {"type": "Recreate"}  # a GPU never held twice
    gateway = container(by_kind(cuda["site-b.yaml"], "Deployment")["pdx-gateway"])
    assert "nvidia.com/gpu" not in gateway["resources"]["requests"]
    assert gateway_config(cuda).vllm.device == "cuda"


def test_gateway_fronts_the_vllm_services_by_dns_name(two_by_two: dict[str, Docs]) -> None:
    b = two_by_two["site-b.yaml"]
    gw = container(by_kind(b, "Deployment")["pdx-gateway"])
    assert gw["command"] == ["pdx"]
    assert gw["args"] == ["deploy", "--config", "/etc/pdx/config/deploy.yaml", "--json"]
    assert gw["image"] == "pdx:0.1.0"
    cfg = gateway_config(two_by_two)
    assert cfg.engine == "vllm" and cfg.vllm.external
    assert (cfg.gateway.host, cfg.gateway.port) == ("0.0.0.0", 8000)
    assert cfg.vllm.served_model_name == "tiny-llama-mha"  # the name vLLM serves under

    def urls(site: str, ns: str) -> list[str]:
        services = by_kind(two_by_two[site], "Service")
        return [f"http://{name}.{ns}.svc.cluster.local:{ports['http']}" for name, ports in (
            (n, {p["name"]: p["port"] for p in s["spec"]["ports"]}) for n, s in services.items()
        ) if name != "pdx-gateway"]  # fmt: skip

    assert cfg.vllm.prefill_urls == urls("site-a.yaml", A)
    assert cfg.vllm.decode_urls == urls("site-b.yaml", B)
    assert cfg.vllm.prefill_urls[1] == "http://pdx-vllm-prefill-1.pdx-site-a.svc.cluster.local:8000"
    assert by_kind(b, "Service")["pdx-gateway"]["spec"]["ports"][0]["port"] == 8000


def test_files_name_the_ports_and_embed_the_gateway_config(tmp_path: Path) -> None:
    render(tmp_path, [*VLLM, "k8s.ucx_first_port=30000", "k8s.ucx_ports=8"])
    for name in ("site-a.yaml", "site-b.yaml"):
        head = (tmp_path / name).read_text().split("apiVersion", 1)[0]
        assert "5600/tcp" in head and "30000-30007/tcp" in head and "8000/tcp" in head
    written = load_deploy_config(tmp_path / "deploy.yaml")
    sites = {p.name: list(yaml.safe_load_all(p.read_text())) for p in tmp_path.glob("site-*")}
    assert written == gateway_config(sites)
    svc = by_kind(sites["site-a.yaml"], "Service")["pdx-vllm-prefill-0"]["spec"]["ports"]
    assert [p["port"] for p in svc if p["name"].startswith("ucx-")] == list(range(30000, 30008))


def test_checkpoint_on_a_claim_is_mounted_where_vllm_model_names_it(tmp_path: Path) -> None:
    sites = render(tmp_path / "out", [*VLLM, "vllm.model=/ckpt/llama-8b",
                                      "k8s.vllm_model_claim=llama-weights"])  # fmt: skip
    validate_strict(sites)
    docs = [*sites["site-a.yaml"], *sites["site-b.yaml"]]
    for deployment in by_kind(docs, "Deployment").values():
        pod = deployment["spec"]["template"]["spec"]
        assert "initContainers" not in pod
        claims = [v for v in pod["volumes"] if "persistentVolumeClaim" in v]
        assert claims == [{"name": "model", "persistentVolumeClaim": {
            "claimName": "llama-weights", "readOnly": True}}]  # fmt: skip
        mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
        assert mounts["model"] == "/ckpt/llama-8b"
    for deployment in instances(sites):
        args = container(deployment)["args"]
        assert flag(args, "--model") == "/ckpt/llama-8b"
        assert flag(args, "--served-model-name") == "llama-8b"
        assert "--max-model-len" not in args  # not readable here: vLLM takes the model's own


def test_a_local_checkpoint_sets_the_context_length_pdx_would(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 256, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 2, "max_position_embeddings": 4096,
        "vocab_size": 1000}))  # fmt: skip
    sites = render(tmp_path / "out", [*VLLM, f"vllm.model={ckpt}"])
    for deployment in instances(sites):
        assert flag(container(deployment)["args"], "--max-model-len") == "4096"


@pytest.mark.parametrize(
    ("sets", "needle"),
    [
        (["vllm.model=models/llama"], "vllm.model"),  # a pod cannot see a relative path
        (["vllm.decode_urls=[http://127.0.0.1:8200]"], "the manifests start the instances"),
        (["k8s.vllm_port=20003"], "lies in the UCX range 20000-20015"),
        (["k8s.ucx_ports=4"], "k8s.ucx_ports"),
        # vLLM's traffic between the site namespaces is not encrypted: said, not implied
        (["security.allow_plaintext=false"], "security.allow_plaintext: got False, expected true"),
    ],
)
def test_unrenderable_configs_are_refused(sets: list[str], needle: str, tmp_path: Path) -> None:
    args = ["deploy", "--render", "k8s", str(tmp_path), "--set", "engine=vllm",
            "--set", "security.allow_plaintext=true"]  # fmt: skip
    for item in sets:
        args += ["--set", item]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert needle in result.output and "Traceback" not in result.output


@pytest.mark.slow
def test_the_export_step_writes_the_checkpoint_vllm_is_given(
    default: dict[str, Docs], tmp_path: Path
) -> None:
    deployment = by_kind(default["site-a.yaml"], "Deployment")["pdx-vllm-prefill-0"]
    (export,) = deployment["spec"]["template"]["spec"]["initContainers"]
    assert export["command"] == ["python", "-c", EXPORT_TINY]
    mount, preset = export["args"]
    subprocess.run([sys.executable, "-c", EXPORT_TINY, str(tmp_path), preset], check=True,
                   timeout=240)  # fmt: skip
    model = flag(container(deployment)["args"], "--model")
    local = tmp_path / Path(model).relative_to(mount)
    assert (local / "config.json").is_file() and (local / "pdx-checkpoint.json").is_file()
    assert (local / "tokenizer.json").is_file()
