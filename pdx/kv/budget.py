"""Bandwidth budget: link demand per codec, the 70 % rule, transfer vs recompute break-even.

transfer_s = fixed overhead + KV bytes / link bandwidth; recompute_s = 2 × seq × active
params / FLOP/s (the attention term is ignored, which favours recompute at long lengths).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pdx.errors import InputError
from pdx.kv.spec import KVSpec
from pdx.units import bytes_per_s_to_gbps, gbps_to_bytes_per_s, ms_to_s

UTILISATION_LIMIT = 0.70
MAX_BREAK_EVEN_SEQ = 1 << 24


@dataclass(frozen=True)
class LinkParams:
    """What the budget is computed against."""

    qps: float
    link_gbps: float
    prefill_tflops: float
    transfer_overhead_ms: float = 0.0

    def __post_init__(self) -> None:
        for name in ("qps", "link_gbps", "prefill_tflops"):
            value = getattr(self, name)
            if not value > 0:
                raise InputError(f"--{name.replace('_', '-')}", value, "a positive number")
        if not self.transfer_overhead_ms >= 0:
            raise InputError("--transfer-overhead-ms", self.transfer_overhead_ms, "a number >= 0")


@dataclass(frozen=True)
class CodecBudget:
    """One sequence length through one codec."""

    codec: str
    ratio: float
    kv_bytes: int
    demand_gbps: float
    utilisation: float
    within_70pct: bool
    transfer_s: float


@dataclass(frozen=True)
class SeqBudget:
    """One ``--seq`` value: every codec's transfer next to recomputing the prefill."""

    seq: int
    raw_kv_bytes: int
    recompute_s: float | None
    per_codec: list[CodecBudget]


@dataclass(frozen=True)
class BreakEven:
    """Shortest sequence for which shipping KV beats recomputing it (None: never, up to 16M)."""

    codec: str
    seq: int | None


@dataclass(frozen=True)
class Budget:
    """The whole budget section of a ``measure-kv`` run."""

    qps: float
    link_gbps: float
    prefill_tflops: float
    transfer_overhead_ms: float
    params_active: int | None
    utilisation_limit: float
    sequences: list[SeqBudget]
    break_even: list[BreakEven]


def transfer_s(kv_bytes: float, link: LinkParams) -> float:
    """Seconds to move ``kv_bytes`` over the link, plus the fixed per-transfer overhead."""
    return ms_to_s(link.transfer_overhead_ms) + kv_bytes / gbps_to_bytes_per_s(link.link_gbps)


def recompute_s(seq: int, params_active: int, link: LinkParams) -> float | None:
    """Seconds to prefill ``seq`` tokens again: 2 × seq × params / FLOP/s (None: params unknown)."""
    if params_active <= 0:
        return None
    return 2.0 * seq * params_active / (link.prefill_tflops * 1e12)


def codec_budget(codec: str, ratio: float, raw_bytes: int, link: LinkParams) -> CodecBudget:
    """Demand and transfer time of one request of ``raw_bytes`` KV through a codec."""
    sent = round(raw_bytes / ratio)
    demand = bytes_per_s_to_gbps(sent * link.qps)
    util = demand / link.link_gbps
    return CodecBudget(
        codec, ratio, sent, demand, util, util <= UTILISATION_LIMIT, transfer_s(sent, link)
    )


def break_even_seq(
    spec: KVSpec, ratio: float, link: LinkParams, kv_bytes: Callable[[int], int] | None = None
) -> int | None:
    """Smallest seq where transfer_s < recompute_s (transfer grows no faster than recompute
    beyond the first crossing for these cache shapes, so a doubling search then bisection).
    None when transfer never wins up to 16 M tokens, or the parameter count is unknown.
    ``kv_bytes`` (default ``spec.kv_bytes``) gives the bytes an engine holds for a length."""
    params = spec.params_active
    size = kv_bytes or spec.kv_bytes
    if params <= 0:
        return None

    def ships(seq: int) -> bool:
        return transfer_s(size(seq) / ratio, link) < 2.0 * seq * params / (
            link.prefill_tflops * 1e12
        )

    if ships(1):
        return 1
    high = 2
    while not ships(high):
        if high >= MAX_BREAK_EVEN_SEQ:
            return None
        high *= 2
    low = high // 2
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if ships(mid) else (mid, high)
    return high


def compute_budget(
    spec: KVSpec,
    seqs: list[int],
    ratios: dict[str, float],
    link: LinkParams,
    kv_bytes: Callable[[int], int] | None = None,
) -> Budget:
    """The budget for each sequence length and codec (``ratios``: codec name → size ratio).

    ``kv_bytes`` (default ``spec.kv_bytes``) gives the bytes an engine holds for a length.
    """
    ratios = {"raw": 1.0, **ratios}
    size = kv_bytes or spec.kv_bytes
    sequences = []
    for seq in seqs:
        raw = size(seq)
        per_codec = [codec_budget(name, r, raw, link) for name, r in ratios.items()]
        sequences.append(SeqBudget(seq, raw, recompute_s(seq, spec.params_active, link), per_codec))
    breaks = [BreakEven(name, break_even_seq(spec, r, link, size)) for name, r in ratios.items()]
    return Budget(
        qps=link.qps,
        link_gbps=link.link_gbps,
        prefill_tflops=link.prefill_tflops,
        transfer_overhead_ms=link.transfer_overhead_ms,
        params_active=spec.params_active or None,
        utilisation_limit=UTILISATION_LIMIT,
        sequences=sequences,
        break_even=breaks,
    )
