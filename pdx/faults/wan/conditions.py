"""Packet-level WAN conditions of the router hop, per direction, as validated models.

``down`` is the way KV travels in a split deployment, prefill site → decode site; ``up`` is
decode site → prefill site. Every probability acts on each wire packet (an MTU-sized frame),
not on the 64 KB aggregates the kernel passes between veths.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pdx.config import build_config

Probability = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]
Millis = Annotated[float, Field(ge=0, le=60_000, allow_inf_nan=False)]
DIRECTIONS = ("down", "up")
# Fields that need the delay line (netem or the userspace emulator); rate and queue alone
# are a tbf on the router's egress, which the kernel has everywhere.
PACKET_FIELDS = ("delay_ms", "jitter_ms", "loss", "reorder", "duplicate")


class LinkConditions(BaseModel):
    """What one direction of the router hop does to each packet."""

    model_config = ConfigDict(extra="forbid")
    delay_ms: Millis = 0.0
    jitter_ms: Millis = 0.0
    loss: Probability = 0.0
    loss_model: Literal["random", "gilbert"] = "random"
    loss_burst: Annotated[float, Field(ge=1, le=10_000, allow_inf_nan=False)] = 1.0
    reorder: Probability = 0.0
    duplicate: Probability = 0.0
    rate_mbit: Annotated[float, Field(gt=0, le=100_000, allow_inf_nan=False)] = 1000.0
    queue_ms: Annotated[float, Field(gt=0, le=10_000, allow_inf_nan=False)] = 50.0

    @model_validator(mode="after")
    def _consistent(self) -> LinkConditions:
        if self.loss >= 1 and self.loss_model == "gilbert":
            raise ValueError("loss 1 with loss_model gilbert: use a cut for a dead link")
        if self.loss_model == "gilbert" and self.loss > 0 and self.loss_burst <= 1:
            raise ValueError("loss_model gilbert needs loss_burst > 1 (mean burst, packets)")
        if self.reorder > 0 and self.delay_ms <= 0:
            raise ValueError(
                "reorder needs delay_ms > 0 (a reordered packet skips the delay the others get)"
            )
        return self

    @property
    def needs_delay_line(self) -> bool:
        """Whether this direction needs more than a rate cap."""
        return any(getattr(self, f) for f in PACKET_FIELDS)

    def gilbert_p_r(self) -> tuple[float, float]:
        """Transition probabilities (good→bad ``p``, bad→good ``r``) per packet.

        The bad state loses every packet and the good state none, so the mean burst is
        ``1/r`` packets and the long-run loss ``p / (p + r)`` (netem's ``gemodel p r``).
        """
        r = 1.0 / self.loss_burst
        p = self.loss * r / (1.0 - self.loss)
        return p, r

    def rtt_share_ms(self) -> float:
        """This direction's added one-way delay (for RTT arithmetic)."""
        return self.delay_ms


class WanConditions(BaseModel):
    """Both directions of the router hop, plus a packet-level cut of the whole link."""

    model_config = ConfigDict(extra="forbid")
    down: LinkConditions = Field(default_factory=LinkConditions)
    up: LinkConditions = Field(default_factory=LinkConditions)
    cut: bool = False
    seed: int | None = None

    @property
    def needs_delay_line(self) -> bool:
        """Whether any packet-level condition is set (the emulator must run)."""
        return self.cut or self.down.needs_delay_line or self.up.needs_delay_line

    def added_rtt_ms(self) -> float:
        """RTT the emulation adds to the path's own: the two one-way delays."""
        return self.down.delay_ms + self.up.delay_ms

    def summary(self) -> str:
        """One line for humans, e.g. ``down delay 25 ms loss 0.1 % · up delay 25 ms``."""
        parts = [f"{d} {_describe(getattr(self, d))}" for d in DIRECTIONS]
        return (" · ".join(parts)) + (" · CUT" if self.cut else "")


def _describe(c: LinkConditions) -> str:
    bits = [f"rate {c.rate_mbit:g} Mbit/s", f"queue {c.queue_ms:g} ms"]
    if c.delay_ms:
        bits.append(f"delay {c.delay_ms:g} ms")
    if c.jitter_ms:
        bits.append(f"jitter {c.jitter_ms:g} ms")
    if c.loss:
        burst = f" bursts of {c.loss_burst:g}" if c.loss_model == "gilbert" else ""
        bits.append(f"loss {c.loss * 100:g} %{burst}")
    if c.reorder:
        bits.append(f"reorder {c.reorder * 100:g} %")
    if c.duplicate:
        bits.append(f"duplicate {c.duplicate * 100:g} %")
    return " ".join(bits)


def make_conditions(
    both: dict[str, Any], down: dict[str, Any] | None = None, up: dict[str, Any] | None = None,
    *, cut: bool = False, seed: int | None = None, source: str = "netns",
) -> WanConditions:  # fmt: skip
    """Validate symmetric options plus per-direction overrides (one line per bad field)."""
    given = {k: v for k, v in both.items() if v is not None}
    data = {
        "down": {**given, **(down or {})},
        "up": {**given, **(up or {})},
        "cut": cut,
        "seed": seed,
    }
    return build_config(WanConditions, source=source, base=data)


def parse_direction(text: str, option: str) -> dict[str, Any]:
    """``delay_ms=30,loss=0.001`` → a dict of one direction's overrides (values as YAML)."""
    from pdx.config import yaml_value
    from pdx.errors import InputError

    out: dict[str, Any] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise InputError(option, item, "KEY=VALUE items separated by commas")
        key = key.strip().replace("-", "_")
        if key not in LinkConditions.model_fields:
            known = ", ".join(LinkConditions.model_fields)
            raise InputError(option, key, f"one of {known}")
        out[key] = yaml_value(f"{option} {key}", value.strip())
    return out
