"""The deploy config's ``k8s.*``: what ``pdx deploy --render k8s`` writes into its manifests."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

_Strict = ConfigDict(extra="forbid")


class Resources(BaseModel):
    """Kubernetes resource requests for one container."""

    model_config = _Strict
    cpu: str = "2"
    memory: str = "8Gi"


class K8sConfig(BaseModel):
    """Only used by ``pdx deploy --render k8s``: images, namespaces (one per site), ports."""

    model_config = _Strict
    image: str = "pdx:0.1.0"
    site_a_namespace: str = "pdx-site-a"
    site_b_namespace: str = "pdx-site-b"
    cluster_domain: str = "svc.cluster.local"
    grpc_port: int = Field(50051, gt=0, le=65535)
    kv_port: int = Field(50052, gt=0, le=65535)
    health_port: int = Field(8081, gt=0, le=65535)
    gateway_port: int = Field(8000, gt=0, le=65535)
    prefill_resources: Resources = Field(default_factory=lambda: Resources.model_validate({}))
    decode_resources: Resources = Field(default_factory=lambda: Resources.model_validate({}))
    gateway_resources: Resources = Field(
        default_factory=lambda: Resources.model_validate({"cpu": "500m", "memory": "512Mi"})
    )
    vllm_image: str = Field(
        "pdx:0.1.0-vllm", description="engine: vllm: the image of the vLLM containers"
    )
    vllm_python: str = Field(
        "/opt/pdx-vllm/bin/python",
        min_length=1,
        description="the interpreter with vLLM inside vllm_image (the Containerfile's vllm "
        "target puts it there, PDX_VLLM_PYTHON)",
    )
    vllm_port: int = Field(8000, gt=0, le=65535, description="each vLLM instance's HTTP port")
    nixl_side_channel_port: int = Field(
        5600, gt=0, le=65535, description="each vLLM instance's NIXL side channel (vLLM's 5600)"
    )
    ucx_first_port: int = Field(
        20000, gt=0, le=65535, description="UCX over TCP listens in ucx_first_port + 0..ucx_ports-1"
    )
    ucx_ports: int = Field(
        16,
        ge=5,
        le=256,
        description="size of the UCX port range (UCX_TCP_PORT_RANGE): one port per NIXL worker "
        "and network interface, vLLM's NixlConnector runs 5 workers",
    )
    vllm_model_claim: str | None = Field(
        None,
        min_length=1,
        description="a PersistentVolumeClaim (one of that name in each site's namespace) "
        "holding the checkpoint vllm.model names, mounted read-only at that path in the vLLM "
        "pods and the gateway; null: a tiny preset (exported at pod start) or the images hold it",
    )

    @model_validator(mode="after")
    def _vllm_ports_apart(self) -> K8sConfig:
        last = self.ucx_first_port + self.ucx_ports - 1
        if last > 65535:
            raise ValueError(f"k8s.ucx_first_port: the UCX range would end at {last} (> 65535)")
        if self.vllm_port == self.nixl_side_channel_port:
            raise ValueError(f"k8s.nixl_side_channel_port: {self.vllm_port} is k8s.vllm_port too")
        for name in ("vllm_port", "nixl_side_channel_port"):
            port = getattr(self, name)
            if self.ucx_first_port <= port <= last:
                raise ValueError(
                    f"k8s.{name}: {port} lies in the UCX range {self.ucx_first_port}-{last}"
                )
        return self
