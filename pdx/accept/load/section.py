"""The playbook's ``load`` section: how Locust generates the load of each step, drawn prompts
or a replayed trace (:class:`TraceLoad`)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

_Strict = ConfigDict(extra="forbid")
PositiveInt = Annotated[int, Field(gt=0)]
PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]


class TraceLoad(BaseModel):
    """A trace a step replays (``load.workload``, or one of ``load.workloads``): the window of
    it, how its lengths and times are scaled, and the salt of its prompts' tokens."""

    model_config = _Strict
    trace: str = Field(description="Mooncake JSONL, BurstGPT CSV or pdx JSONL (relative to "
                       "the playbook)")  # fmt: skip
    format: Literal["auto", "mooncake", "burstgpt", "pdx"] = "auto"
    block_size: PositiveInt | None = Field(
        default=None, description="tokens per hash id (default 512, Mooncake's)"
    )
    length_scale: PositiveFloat = Field(
        default=1.0, description="multiplies every length and the block size (1/32: Mooncake's "
        "512-token blocks onto vLLM's 16)",
    )  # fmt: skip
    time_scale: PositiveFloat = Field(
        default=1.0, description="multiplies every time (0.05 replays 20x faster); a step's "
        "matrix.rate_rps, where given, sets it instead (the window at that mean rate)",
    )  # fmt: skip
    start_s: Annotated[float, Field(ge=0)] = Field(
        default=0.0, description="the window starts this long after the trace's first request"
    )
    duration_s: PositiveFloat | None = Field(
        default=None, description="the window's length, on the trace's clock"
    )
    max_requests: PositiveInt | None = None
    salt: int = Field(default=0, description="another salt: other tokens, the same reuse")


class Load(BaseModel):
    """How Locust generates the load (it always runs as a separate process)."""

    model_config = _Strict
    locustfile: str | None = Field(
        default=None,
        description="default: the one pdx ships (pdx/accept/load/traffic/locustfile.py)",
    )
    workers: Annotated[int, Field(ge=0, le=32)] = Field(
        default=0, description="Locust worker processes (0 = one local process)"
    )
    open_loop_users: PositiveInt = Field(default=4, description="open loop: users sharing the rate")
    max_inflight: PositiveInt = Field(default=64, description="open loop: in-flight cap per user")
    prompt_kind: Literal["ids", "text"] = "ids"
    token_id_max: PositiveInt = Field(
        default=250, description="prompt token ids drawn from 1..this"
    )
    timeout_s: PositiveFloat = 120.0
    warmup_requests: Annotated[int, Field(ge=0, le=100)] = Field(
        default=3, description="unmeasured requests sent before the first step"
    )
    abort_fraction: Annotated[float, Field(ge=0, lt=1)] = Field(
        default=0.0, description="share of requests the client cancels after the first token"
    )
    workload: TraceLoad | None = Field(
        default=None,
        description="every step replays this trace's window (open loop at its own times) "
        "instead of drawing prompts; matrix.input_tokens/output_tokens/concurrency then unused",
    )
    workloads: dict[str, TraceLoad] = Field(
        default_factory=dict, description="named traces for the matrix's workload axis"
    )
