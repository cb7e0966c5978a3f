"""The deploy config's prefix cache (``prefix_cache.*``) and offload policy (``router.offload``)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Policy = Literal["length", "uncached", "break_even"]
POLICIES: tuple[str, ...] = ("length", "uncached", "break_even")


class PrefixCacheConfig(BaseModel):
    """Prefix caches in pdx's own prefill and decode (``engine: pdx``)."""

    model_config = ConfigDict(extra="forbid")
    enabled: bool = Field(
        True,
        description="keep finished prompts' KV as hashed blocks: a prompt's cached prefix is "
        "not recomputed, and decode is sent only the KV it lacks",
    )
    block_tokens: int = Field(
        16, ge=1, le=4096, description="tokens per cached block (the unit of reuse)"
    )
    prefill_budget_bytes: int = Field(
        256 * 1024**2,
        ge=0,
        description="what each prefill's cache may hold (decode's lives in "
        "decode.kv_budget_bytes, beside the requests' reservations)",
    )


class OffloadConfig(BaseModel):
    """When a request's prefill is sent to the prefill site (``router.offload``)."""

    model_config = ConfigDict(extra="forbid")
    policy: Policy = Field(
        "length",
        description="length: remote when the prompt has >= threshold_tokens tokens, its whole KV "
        "shipped; uncached: remote when the part the chosen decode's prefix cache does not hold "
        "has >= threshold_tokens, only that part shipped (llm-d's nonCachedTokens, Dynamo's "
        "eff_isl_threshold); break_even: remote when its predicted time (prefill queue + "
        "prefill of that part + its KV / the live goodput + 2 RTT) beats decode prefilling it, "
        "every figure measured live (docs/deploy.md)",
    )
    threshold_tokens: int | None = Field(
        None,
        ge=0,
        description="the policy's threshold; null: router.local_prefill_max_tokens, else the "
        "transfer-vs-recompute break-even",
    )
    cache_weight: float = Field(
        1.0,
        ge=0,
        description="decode choice under a cache-aware policy: the share of the prompt an "
        "instance holds, times this, is added to its load score",
    )


class OffloadChoice(BaseModel):
    """A request's own offload policy (``pdx_offload``): what ``router.offload`` says, for this
    one request (playbooks compare policies on one deployment with it)."""

    model_config = ConfigDict(extra="forbid")
    policy: Policy | None = Field(None, description="length, uncached or break_even")
    threshold_tokens: int | None = Field(None, ge=0, le=2**31 - 1, description="the threshold")
