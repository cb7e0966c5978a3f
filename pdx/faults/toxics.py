"""Toxic specifications: what a fault is, validated once at the edge.

A toxic is a pydantic model with a ``type`` discriminator, a ``name`` (unique per proxy), a
``direction`` (``upstream`` = client → upstream server, ``downstream`` = server → client,
``both``) and a ``toxicity`` (probability that a given TCP connection is affected). Specs are
plain data; the proxy turns them into per-connection state.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

from pdx.config import validation_problems
from pdx.errors import ConfigError, InputError

Direction = Literal["both", "upstream", "downstream"]
JitterDist = Literal["uniform", "normal"]

# Sane ranges (a latency of 1e12 ms is a typo, not a fault to inject): times up to an hour,
# rates up to 1 Tbit/s, sizes up to 1 GiB.
NonNeg = Annotated[float, Field(ge=0, le=3_600_000, allow_inf_nan=False)]  # ms
Prob = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]
Size = Annotated[int, Field(ge=1, le=1 << 30)]


class _ToxicBase(BaseModel):
    """Fields every toxic has."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    name: str = Field(default="", max_length=64, pattern=r"^[A-Za-z0-9_.\-]*$")
    direction: Direction = "both"
    toxicity: Prob = 1.0

    def applies_to(self, direction: str) -> bool:
        """Whether this toxic acts on the ``upstream`` or ``downstream`` flow."""
        return self.direction in ("both", direction)


class Latency(_ToxicBase):
    """Delay every chunk (TCP) or datagram (UDP) by ``latency_ms`` ± jitter; TCP keeps order."""

    type: Literal["latency"] = "latency"
    latency_ms: NonNeg = 0.0
    jitter_ms: NonNeg = 0.0
    jitter_dist: JitterDist = "uniform"


class Bandwidth(_ToxicBase):
    """Token-bucket rate limit in megabits per second (decimal) per direction."""

    type: Literal["bandwidth"] = "bandwidth"
    rate_mbps: Annotated[float, Field(gt=0, le=1_000_000, allow_inf_nan=False)]
    burst_bytes: Size = 65536


class Stall(_ToxicBase):
    """With ``probability`` per chunk, hold the stream ``duration_ms`` (loss, as TCP sees it)."""

    type: Literal["stall"] = "stall"
    probability: Prob = 0.01
    duration_ms: NonNeg = 200.0


class ResetPeer(_ToxicBase):
    """Reset the connection (RST) ``timeout_ms`` after it opens (or after the toxic is added)."""

    type: Literal["reset_peer"] = "reset_peer"
    timeout_ms: NonNeg = 0.0


class Timeout(_ToxicBase):
    """Blackhole: forward nothing; close after ``timeout_ms`` (0 = never, until removed)."""

    type: Literal["timeout"] = "timeout"
    timeout_ms: NonNeg = 0.0


class Slicer(_ToxicBase):
    """Cut chunks into slices of about ``average_size`` bytes, ``delay_us`` apart."""

    type: Literal["slicer"] = "slicer"
    average_size: Size = 64
    size_variation: Annotated[int, Field(ge=0, le=1 << 30)] = 0
    delay_us: Annotated[float, Field(ge=0, le=60_000_000, allow_inf_nan=False)] = 0.0

    @model_validator(mode="after")
    def _variation_below_size(self) -> Slicer:
        if self.size_variation >= self.average_size:
            raise ValueError("size_variation must be smaller than average_size")
        return self


class LimitData(_ToxicBase):
    """Close the connection once ``bytes`` bytes have been forwarded in the direction."""

    type: Literal["limit_data"] = "limit_data"
    bytes: Annotated[int, Field(ge=0, le=1 << 50)]


class SlowClose(_ToxicBase):
    """Delay passing on a close (EOF) by ``delay_ms``."""

    type: Literal["slow_close"] = "slow_close"
    delay_ms: NonNeg = 0.0


class Corrupt(_ToxicBase):
    """Flip ``nbytes`` bytes: in chunks chosen with ``probability``, or at stream ``offset``."""

    type: Literal["corrupt"] = "corrupt"
    probability: Prob = 0.0
    offset: Annotated[int, Field(ge=0, le=1 << 50)] | None = None
    nbytes: Annotated[int, Field(ge=1, le=4096)] = 1
    seed: int | None = None

    @model_validator(mode="after")
    def _one_trigger(self) -> Corrupt:
        if self.offset is None and self.probability == 0:
            raise ValueError("set probability > 0 or an offset")
        return self


class Loss(_ToxicBase):
    """UDP: drop datagrams; random with ``probability`` or Gilbert-Elliott bursts when ``model``."""

    type: Literal["loss"] = "loss"
    model: Literal["random", "gilbert_elliott"] = "random"
    probability: Prob = 0.0
    p_good_to_bad: Prob = 0.0
    p_bad_to_good: Prob = 1.0
    loss_good: Prob = 0.0
    loss_bad: Prob = 1.0
    seed: int | None = None


class Duplicate(_ToxicBase):
    """UDP: send a datagram twice with ``probability``."""

    type: Literal["duplicate"] = "duplicate"
    probability: Prob


class Reorder(_ToxicBase):
    """UDP: hold a datagram back by ``delay_ms`` with ``probability`` so later ones overtake it."""

    type: Literal["reorder"] = "reorder"
    probability: Prob
    delay_ms: NonNeg = 10.0


ToxicSpec = Annotated[
    Latency
    | Bandwidth
    | Stall
    | ResetPeer
    | Timeout
    | Slicer
    | LimitData
    | SlowClose
    | Corrupt
    | Loss
    | Duplicate
    | Reorder,
    Field(discriminator="type"),
]
"""Any toxic; pydantic picks the class from ``type``."""

Toxic = (
    Latency
    | Bandwidth
    | Stall
    | ResetPeer
    | Timeout
    | Slicer
    | LimitData
    | SlowClose
    | Corrupt
    | Loss
    | Duplicate
    | Reorder
)

TCP_TYPES = frozenset(
    {
        "latency",
        "bandwidth",
        "stall",
        "reset_peer",
        "timeout",
        "slicer",
        "limit_data",
        "slow_close",
        "corrupt",
    }
)
UDP_TYPES = frozenset({"latency", "bandwidth", "loss", "duplicate", "reorder", "corrupt"})
ALL_TYPES = TCP_TYPES | UDP_TYPES

_ADAPTER: TypeAdapter[Any] = TypeAdapter(ToxicSpec)


def parse_toxic(data: Any, *, source: str = "toxic") -> Toxic:
    """Validate a mapping into a toxic; bad ``type`` or values raise one line per problem."""
    if isinstance(data, _ToxicBase):
        return data  # type: ignore[return-value]
    if not isinstance(data, dict):
        raise InputError(source, data, "a mapping with a 'type' key")
    kind = data.get("type")
    if kind not in ALL_TYPES:
        raise InputError(f"{source}.type", kind, f"one of {', '.join(sorted(ALL_TYPES))}")
    try:
        toxic: Toxic = _ADAPTER.validate_python(data)
    except ValidationError as exc:
        raise ConfigError(source, _strip_tag(validation_problems(exc), str(kind))) from None
    return toxic


def _strip_tag(problems: list[str], tag: str) -> list[str]:
    """Pydantic prefixes union errors with the tag (``latency.latency_ms``); drop it."""
    return [p[len(tag) + 1 :] if p.startswith(tag + ".") else p for p in problems]


def updated_toxic(toxic: Toxic, changes: dict[str, Any], *, source: str = "toxic") -> Toxic:
    """A validated copy of ``toxic`` with ``changes``; ``type`` and ``name`` cannot change."""
    for fixed in ("type", "name"):
        if fixed in changes and changes[fixed] != getattr(toxic, fixed):
            raise InputError(
                f"{source}.{fixed}", changes[fixed], f"unchanged {getattr(toxic, fixed)!r}"
            )
    merged = toxic.model_dump() | changes
    return parse_toxic(merged, source=source)
