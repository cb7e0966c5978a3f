"""The simulator's validated configuration: hardware, model, link, pools and workload."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pdx.config import build_config, env_overrides, read_yaml
from pdx.errors import InputError

Compat = Literal["none", "published"]
Mode = Literal["colocated", "disaggregated"]
_ALL_MODES: tuple[Mode, ...] = ("colocated", "disaggregated")


class WorkloadConfig(BaseModel):
    """Poisson arrivals with a prompt-length mix, or a JSONL trace to replay."""

    model_config = ConfigDict(extra="forbid")

    requests: int = Field(150, gt=0, description="number of requests to generate")
    rate_per_s: float = Field(0.5, gt=0, description="mean arrival rate (Poisson)")
    seed: int = Field(7, description="seed of Python's random.Random for arrivals and prompts")
    prompt_tokens: list[int] = Field(default_factory=lambda: [4000, 16000, 32000, 64000])
    prompt_weights: list[float] = Field(default_factory=lambda: [3.0, 4.0, 2.0, 1.0])
    output_tokens: int = Field(512, gt=0, description="output tokens per request")
    trace: str | None = Field(
        None, description="a trace to replay: Mooncake JSONL, BurstGPT CSV or pdx JSONL"
    )
    format: Literal["auto", "mooncake", "burstgpt", "pdx"] = Field(
        default="auto", description="the trace's format (auto: from its extension and first line)"
    )
    block_size: int | None = Field(
        default=None, gt=0, description="tokens per hash id of the trace (default 512, Mooncake's)"
    )
    length_scale: float = Field(
        default=1.0, gt=0, description="multiplies every length of the trace and its block size"
    )
    time_scale: float = Field(default=1.0, gt=0, description="multiplies every time of the trace")
    start_s: float = Field(
        default=0.0, ge=0, description="the window starts this long into the trace"
    )
    duration_s: float | None = Field(
        default=None, gt=0, description="the window's length (trace time)"
    )
    max_requests: int | None = Field(
        default=None, gt=0, description="at most this many of the window"
    )

    @model_validator(mode="after")
    def _mix_matches(self) -> WorkloadConfig:
        if not self.prompt_tokens:
            raise ValueError("prompt_tokens must list at least one prompt length")
        if len(self.prompt_tokens) != len(self.prompt_weights):
            raise ValueError(
                f"prompt_weights has {len(self.prompt_weights)} entries, "
                f"prompt_tokens has {len(self.prompt_tokens)}; they must match"
            )
        if any(p <= 0 for p in self.prompt_tokens):
            raise ValueError(f"prompt_tokens must all be positive (got {self.prompt_tokens})")
        if any(w < 0 for w in self.prompt_weights) or sum(self.prompt_weights) <= 0:
            raise ValueError("prompt_weights must be >= 0 with a positive sum")
        return self


class SimConfig(BaseModel):
    """Everything one simulation needs. Model and hardware fields have no defaults."""

    model_config = ConfigDict(extra="forbid")

    # model and hardware (per instance)
    prefill_flops: float = Field(gt=0, description="FLOP/s of one prefill instance")
    decode_hbm_bytes_per_s: float = Field(gt=0, description="HBM bandwidth of one decode instance")
    weight_bytes: float = Field(gt=0, description="model weight bytes")
    model_params: float = Field(gt=0, description="parameter count")
    kv_bytes_per_token: float = Field(gt=0, description="KV cache bytes per token (all layers)")
    decode_weight_reads: Literal["per_request", "per_step"] = Field(
        "per_request",
        description="per_request: the published step cost (batch x weight_bytes); "
        "per_step: weights are read once per step, shared by the batch",
    )
    # link between the prefill and decode pools
    link_bytes_per_s: float = Field(gt=0, description="link bandwidth, bytes/s")
    link_rtt_s: float = Field(0.0, ge=0, description="round trip added to every transfer")
    link_loss: float = Field(0.0, ge=0, lt=1, description="packet loss probability")
    link_jitter_s: float = Field(0.0, ge=0, description="mean of exponential extra delay")
    link_mss_bytes: int = Field(1448, gt=0, description="segment size used by the loss model")
    link_sharing: Literal["fifo", "fair", "none"] = Field(
        "fifo",
        description="fifo: transfers queue on one link; fair: the transfers in flight share "
        "its rate equally (concurrent TCP flows); none: each gets full bandwidth",
    )
    link_round_trips: float = Field(
        1.0, ge=0, description="round trips of link_rtt_s each transfer waits (request, lookups)"
    )
    link_fixed_s: float = Field(
        0.0,
        ge=0,
        description="fixed time every transfer takes on top of its round trips and bytes "
        "(posting it, the receiver noticing it is done on its next poll)",
    )
    link_loss_recovery: Literal["stall", "pipelined"] = Field(
        "stall",
        description="stall: every round trip's worth of data that saw a loss costs one more "
        "round trip; pipelined: link_bytes_per_s is a goodput measured on the lossy path "
        "(losses are repaired while data flows), only a loss in the last round trip costs one",
    )
    prefix_cache_blocks: int | None = Field(
        None,
        gt=0,
        description="with a trace that has hash ids: each prefill and decode instance keeps a "
        "prefix cache of this many blocks (LRU); a prefill computes only what its instance "
        "lacks, and only what the decode instance lacks crosses the link",
    )
    kv_overlap: Literal["off", "layerwise"] = Field(
        "off",
        description="off: the KV leaves once prefill has finished (and been encoded); "
        "layerwise: each of model_layers layers leaves once prefill has computed (and "
        "encoded) it, so the transfer starts after the first layer and overlaps the rest",
    )
    model_layers: int = Field(32, gt=0, description="layers of the model (kv_overlap layerwise)")
    # compression of the shipped KV
    codec_ratio: float = Field(1.0, gt=0, description="compressed bytes / raw bytes")
    codec_encode_bytes_per_s: float | None = Field(None, gt=0)
    codec_decode_bytes_per_s: float | None = Field(None, gt=0)
    # pools
    prefill_instances: int = Field(1, gt=0)
    decode_instances: int = Field(1, gt=0)
    colocated_instances: int = Field(1, gt=0)
    local_prefill_max_tokens: int = Field(
        0, ge=0, description="disaggregated: prompts up to this many tokens prefill on decode"
    )
    offload_policy: Literal["length", "uncached", "break_even"] | None = Field(
        None,
        description="disaggregated, with prefix caches: length = local when the prompt has at "
        "most local_prefill_max_tokens, its whole KV shipped (pdx's length policy); uncached = "
        "the same rule on the part the least-loaded decode's cache lacks, only that shipped "
        "(pdx's uncached policy); break_even = local when decode would have that part's KV "
        "sooner than the remote path (prefill queue, prefill, round trip, transfer at the "
        "modelled rates); unset: the prompt's length decides and only what decode lacks "
        "crosses (a length router before vLLM's NIXL pull)",
    )
    max_decode_batch: int | None = Field(None, gt=0, description="requests per decode batch")
    decode_kv_budget_bytes: float | None = Field(
        None, gt=0, description="KV bytes a decode instance may hold (prompt+output reserved)"
    )
    chunked_prefill_tokens: int | None = Field(
        None, gt=0, description="colocated: prefill in chunks piggybacked on decode steps"
    )
    prefill_fixed_s: float = Field(
        0.0,
        ge=0,
        description="fixed cost of every prefill on top of its FLOPs (scheduling, "
        "building the KV tensors' headers)",
    )
    prefill_time_sigma: float = Field(
        0.0,
        ge=0,
        le=3,
        description="spread of prefill times: each prefill takes its FLOP time x e^(sigma Z), "
        "Z standard normal (a lognormal factor with median 1), seeded by workload.seed + 2",
    )
    first_token_from: Literal["decode", "prefill"] = Field(
        "decode",
        description="decode: the first token comes with the first decode step once the KV is "
        "ready; prefill: prefill streams it at once (pdx's flow: the request and the token "
        "cross the link, half a round trip each way, decode makes the other tokens)",
    )
    prefill_over_link: bool = Field(
        False,
        description="with the first token from decode: the request still reaches prefill "
        "across the link and prefill's answer (the KV handle) comes back before decode asks "
        "for the KV — half a round trip each way (vLLM behind a router in the decode site)",
    )
    # service-level objectives used for goodput
    slo_ttft_s: float = Field(10.0, gt=0)
    slo_tpot_s: float = Field(0.2, gt=0)
    # where the model fields came from (filled by load_sim_config)
    model_preset: str | None = Field(None, description="a measure-kv preset name")
    model_dtype: Literal["bf16", "fp16", "fp8", "fp32"] = Field("bf16")
    # what to run
    modes: list[Mode] = Field(default_factory=lambda: list(_ALL_MODES))
    compat: Compat = Field("none", description="published: admit requests on arrival")
    workload: WorkloadConfig = Field(default_factory=lambda: WorkloadConfig.model_validate({}))

    @model_validator(mode="after")
    def _compat_scope(self) -> SimConfig:
        if self.compat == "published":
            extra = {
                k: getattr(self, k)
                for k in ("prefill_instances", "decode_instances", "colocated_instances")
                if getattr(self, k) != 1
            }
            if self.first_token_from != "decode":
                raise ValueError("compat 'published' takes the first token from decode")
            if self.kv_overlap != "off":
                raise ValueError("compat 'published' ships the KV after prefill (kv_overlap off)")
            if extra or self.local_prefill_max_tokens or self.chunked_prefill_tokens:
                raise ValueError(
                    "compat 'published' models one prefill and one decode instance with no "
                    "local prefill or chunking; remove the pool options"
                )
        if self.kv_overlap != "off" and self.link_sharing == "fair":
            raise ValueError("kv_overlap layerwise models a fifo or unshared link, not fair")
        if not self.modes:
            raise ValueError("modes must name at least one of colocated, disaggregated")
        return self


#: Parameters of the published illustration (70B fp16 model, 20 GB/s link).
PUBLISHED_ILLUSTRATION: dict[str, Any] = {
    "prefill_flops": 2.0e15,
    "decode_hbm_bytes_per_s": 26.8e12,
    "weight_bytes": 140e9,
    "model_params": 70e9,
    "kv_bytes_per_token": 65536,
    "link_bytes_per_s": 20e9,
    "workload": {
        "requests": 150,
        "rate_per_s": 0.5,
        "seed": 7,
        "prompt_tokens": [4000, 16000, 32000, 64000],
        "prompt_weights": [3, 4, 2, 1],
        "output_tokens": 512,
    },
}

PRESETS: dict[str, dict[str, Any]] = {"published-illustration": PUBLISHED_ILLUSTRATION}

#: Top-level numeric fields a sweep or find-min may vary.
NUMERIC_FIELDS: tuple[str, ...] = tuple(
    name
    for name, f in SimConfig.model_fields.items()
    if f.annotation in (float, int, float | None, int | None)
)


def is_integer_field(name: str) -> bool:
    """True for fields holding counts (instances, tokens, batch)."""
    return SimConfig.model_fields[name].annotation in (int, int | None)


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """``top`` over ``base``; the ``workload`` mapping is merged key by key."""
    out = copy.deepcopy(base)
    for key, value in top.items():
        if key == "workload" and isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out


def load_sim_config(
    config_path: str | None = None,
    preset: str | None = None,
    overrides: dict[str, Any] | None = None,
    dotted: list[str] | None = None,
    calibration: dict[str, Any] | None = None,
) -> SimConfig:
    """Preset < model preset < calibration < YAML < ``PDX_SIM_*`` environment < flags <
    ``--set``.

    With neither preset nor file the base is the illustration; ``calibration`` is the
    fields :func:`pdx.sim.calibrate.calibrate` fitted to a measured run.

    A YAML file given alone must be complete (model and hardware keys have no defaults).
    """
    if preset is not None and preset not in PRESETS:
        raise InputError("--preset", preset, f"one of {', '.join(sorted(PRESETS))}")
    base: dict[str, Any] = {}
    if preset is not None or config_path is None:
        base = copy.deepcopy(PRESETS[preset or "published-illustration"])
    flags = {k: v for k, v in (overrides or {}).items() if v is not None}
    workload_flags = flags.pop("workload", None) or {}
    flags["workload"] = {k: v for k, v in workload_flags.items() if v is not None}
    file_data = _read_config_file(config_path) if config_path is not None else {}
    model_name = flags.get("model_preset", file_data.get("model_preset"))
    if model_name:  # preset < model preset < file < flags
        dtype = str(flags.get("model_dtype", file_data.get("model_dtype", "bf16")))
        base = _merge(base, model_fields(str(model_name), dtype))
    if calibration:
        base = _merge(base, calibration)
    env = env_overrides("PDX_SIM_")
    data = _merge(_merge(_merge(base, file_data), env), flags)
    given_flags = len(flags) > 1 or bool(flags["workload"]) or bool(dotted)
    source = _source_label(preset, config_path, bool(env), given_flags)
    if calibration:
        source += " + calibration"
    return build_config(SimConfig, source=source, base=data, dotted=dotted)


def _source_label(preset: str | None, config_path: str | None, env: bool, flags: bool) -> str:
    """What an error message names as the configuration's origin."""
    parts = [f"preset {preset or 'published-illustration'}"] if preset or not config_path else []
    parts += [config_path] if config_path else []
    parts += ["environment"] if env else []
    parts += ["options"] if flags else []
    return " + ".join(parts)


def _read_config_file(path: str) -> dict[str, Any]:
    """The YAML file; a relative ``workload.trace`` is taken relative to the file."""
    data = read_yaml(path)
    workload = data.get("workload")
    trace = workload.get("trace") if isinstance(workload, dict) else None
    if isinstance(workload, dict) and isinstance(trace, str) and not Path(trace).is_absolute():
        workload["trace"] = str(Path(path).parent / trace)
    return data


def model_fields(name: str, dtype: str = "bf16") -> dict[str, Any]:
    """Model fields from a measure-kv preset: active parameters, weight bytes, KV bytes/token.

    Sliding-window layers count as if they kept every token (exact up to the window, an upper
    bound beyond it); weight bytes count every parameter (all experts of a MoE model).
    """
    from pdx.kv.source import load_preset
    from pdx.kv.spec import DTYPE_BYTES, build_spec

    try:
        src = load_preset(name)
    except InputError as exc:
        raise InputError("--model-preset", name, exc.expected) from None
    if dtype not in DTYPE_BYTES:
        raise InputError("--model-dtype", dtype, f"one of {', '.join(DTYPE_BYTES)}")
    spec = build_spec(src.config, name=src.name, dtype=dtype)
    return {
        "model_params": spec.params_active,
        "weight_bytes": spec.params_total * DTYPE_BYTES[dtype],
        "kv_bytes_per_token": spec.kv_bytes_per_token + spec.sliding_bytes_per_token,
        "model_preset": src.name,
        "model_dtype": dtype,
    }
