"""The limit of one parameter: the bracket [last GO, first NO-GO] found by judged probes.

A search walks one axis (``rate``, ``concurrency``, ``rtt_ms``, ``loss``, ``bandwidth_mbps``)
from its good end (the lowest load, the best link) towards its bad end. Its first probe, at the
good end, calibrates the simulator, whose predicted limit is the second probe; from there the
bracket is widened (×1.25, ×1.5625, … towards the bad end) until a probe is not GO, then bisected
until it is as narrow as the resolution asks. The method assumes what a capacity search always
assumes (RFC 2544, MLRsearch): a value worse than a NO-GO is no better. A probe that disagrees
(GO beyond a NO-GO) is kept and listed as ``non_monotone``; it never moves the bracket.

An INCONCLUSIVE probe (the sample could not decide a criterion) is run again, twice as long
or as long as its undecided criteria's sample needs, up to ``search.max_extensions`` times;
one still undecided counts as not GO for the bracket (the limit stays a value proven GO) and
is listed under ``undecided``.

On a shared, noisy machine one GO can be luck: a probe that met every criterion at a value the
system carries only most of the time. So the bracket's GO end is probed again once the bracket
is narrow (``search.confirm`` times, MLRsearch's answer to noise: a load is accepted on repeated
trials); a confirmation that is not GO makes that value *disputed* (listed, never the limit),
the next GO below it becomes the limit, and the search goes on between the two. A limit the
budget left unconfirmed is not ``found``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from pdx.accept.playbook import Search
from pdx.units import human_bytes

Verdict = Literal["GO", "NO-GO", "INCONCLUSIVE"]
THRESHOLD = "router.offload.threshold_tokens"  # searched for goodput, not for a limit

DEFAULT_RANGES: dict[str, tuple[float, float]] = {
    "rate": (0.5, 64.0),
    "concurrency": (1.0, 64.0),
    "rtt_ms": (1.0, 200.0),
    "loss": (0.0001, 0.05),
    "bandwidth_mbps": (10.0, 10_000.0),
    THRESHOLD: (8.0, 8192.0),
}
UNITS = {"rate": "req/s", "concurrency": "users", "rtt_ms": "ms", "loss": "fraction",
         "bandwidth_mbps": "Mbit/s", THRESHOLD: "tokens"}  # fmt: skip
RELATIVE_RESOLUTION = 0.1
MAX_PROBES = 24  # a search never runs more probes than this, whatever its budget
GROWTH = 1.25  # the first widening step past the last GO; squared at each further one


@dataclass(frozen=True)
class Axis:
    """One searched parameter: its range, its direction and when a bracket is narrow enough."""

    param: str
    lo: float
    hi: float
    resolution: float | None = None

    @property
    def worse_up(self) -> bool:
        """Whether a larger value is the harder one (every parameter but bandwidth)."""
        return self.param != "bandwidth_mbps"

    @property
    def integer(self) -> bool:
        return self.param == "concurrency"

    @property
    def best(self) -> float:
        return self.lo if self.worse_up else self.hi

    @property
    def worst(self) -> float:
        return self.hi if self.worse_up else self.lo

    def worse(self, a: float, b: float) -> bool:
        """Whether ``a`` is strictly harder than ``b``."""
        return a > b if self.worse_up else a < b

    def snap(self, value: float) -> float:
        """Inside the range, whole for concurrency, four significant digits otherwise."""
        value = min(self.hi, max(self.lo, value))
        if self.integer:
            return float(round(value))
        return float(f"{value:.4g}")

    def narrow(self, good: float, bad: float) -> bool:
        """Whether the bracket [good, bad] is as narrow as asked."""
        width = abs(bad - good)
        if self.integer:
            return width <= max(1.0, self.resolution or 1.0)
        if self.resolution is not None:
            return width <= self.resolution
        return width <= RELATIVE_RESOLUTION * abs(good)

    def between(self, good: float, bad: float) -> float | None:
        """A value strictly inside (good, bad): geometric midpoint when they are a factor of 4
        or more apart (losses span decades), arithmetic otherwise; None when none is left."""
        lo, hi = sorted((good, bad))
        mid = math.sqrt(lo * hi) if lo > 0 and hi / lo >= 4 else (lo + hi) / 2
        value = self.snap(mid)
        return value if lo < value < hi else None

    def widen(self, good: float, k: int) -> float:
        """The k-th widening step past ``good`` towards the bad end (×1.25, ×1.5625, …)."""
        factor = GROWTH ** (2**k)
        value = self.snap(good * factor if self.worse_up else good / factor)
        if self.integer and value == good:
            value = self.snap(good + (1 if self.worse_up else -1))
        return value


def axis_for(spec: Search) -> Axis:
    """The axis a playbook's ``search:`` section describes (its range or the default)."""
    assert spec.param is not None
    lo, hi = spec.range or DEFAULT_RANGES[spec.param]
    return Axis(spec.param, float(lo), float(hi), spec.resolution)


@dataclass
class Probe:
    """One judged step of a search."""

    value: float
    verdict: Verdict
    step: str
    duration_s: float
    requests: int
    valid: bool
    failed: list[str] = field(default_factory=list)
    undecided: list[str] = field(default_factory=list)
    worst_ratio: float | None = None
    binding: str | None = None
    attempt: int = 1
    superseded: bool = False
    wall_s: float = 0.0
    confirmation: bool = False  # a value already GO, probed again (``search.confirm``)


@dataclass
class Bracket:
    """The search's state: the worst value proven GO, the best value not GO, what disagreed."""

    axis: Axis
    good: float | None = None
    bad: float | None = None
    bad_undecided: bool = False
    undecided: list[float] = field(default_factory=list)
    non_monotone: list[float] = field(default_factory=list)
    widenings: int = 0
    used_prediction: bool = False
    probed: list[float] = field(default_factory=list)
    confirm: int = 0  # how many more GOs the limit needs after its first
    go_counts: dict[float, int] = field(default_factory=dict)
    disputed: list[float] = field(default_factory=list)

    @property
    def confirmed(self) -> bool:
        """Whether the GO end has been GO as many times as ``confirm`` asks (1 + confirm)."""
        return self.good is not None and self.go_counts.get(self.good, 0) > self.confirm

    def record(self, value: float, verdict: Verdict) -> None:
        """Fold one probe's final verdict in (INCONCLUSIVE = undecided after its extensions)."""
        ax = self.axis
        self.probed.append(value)
        if verdict == "GO":
            if value in self.disputed:
                return
            self.go_counts[value] = self.go_counts.get(value, 0) + 1
            if self.bad is not None and not ax.worse(self.bad, value):
                self.non_monotone.append(value)
            elif self.good is None or ax.worse(value, self.good):
                self.good = value
            return
        if value in self.go_counts and value not in self.disputed:  # GO once, not now
            self.disputed.append(value)
            del self.go_counts[value]
            if self.good == value:
                below = [v for v in self.go_counts if ax.worse(value, v)]
                self.good = max(below, key=lambda v: v if ax.worse_up else -v, default=None)
        if verdict == "INCONCLUSIVE":
            self.undecided.append(value)
        if self.bad is None or ax.worse(self.bad, value):
            self.bad, self.bad_undecided = value, verdict == "INCONCLUSIVE"

    def next_value(self, predicted: float | None) -> float | None:
        """The next value to probe, or None when the search is over."""
        ax = self.axis
        if self.good is None and self.bad is None:
            return ax.best
        if self.good is None:  # the good end itself is not GO
            return None
        if self.bad is None:
            if self.good == ax.worst:
                return self._confirmation()
            if (
                predicted is not None
                and not self.widenings
                and ax.worse(ax.snap(predicted), self.good)
                and ax.snap(predicted) not in self.probed
            ):
                self.widenings, self.used_prediction = 1, True
                return ax.snap(predicted)
            value = ax.widen(self.good, self.widenings - int(self.used_prediction))
            self.widenings += 1
            return value if value not in self.probed and value != self.good else None
        if ax.narrow(self.good, self.bad):
            return self._confirmation()
        return ax.between(self.good, self.bad) or self._confirmation()

    def _confirmation(self) -> float | None:
        """The GO end again while it lacks its confirmations; None: the search is over."""
        return None if self.confirmed else self.good

    def outcome(self, budget_left: bool) -> str:
        """found | above_range | below_range | undecided | budget_exhausted."""
        ax = self.axis
        if self.good is None:
            return "below_range" if self.bad == ax.best and not self.bad_undecided else (
                "undecided" if budget_left else "budget_exhausted")  # fmt: skip
        if not self.confirmed:
            return "budget_exhausted" if not budget_left else "undecided"
        if self.bad is None:
            return "above_range" if self.good == ax.worst else (
                "budget_exhausted" if not budget_left else "undecided")  # fmt: skip
        if ax.narrow(self.good, self.bad) or ax.between(self.good, self.bad) is None:
            return "found"
        return "budget_exhausted" if not budget_left else "undecided"


EXIT_BY_OUTCOME = {"found": 0, "above_range": 0, "below_range": 1, "undecided": 3,
                   "budget_exhausted": 3}  # fmt: skip


def probe_verdict(
    valid: bool, load_short: bool, criteria: list[Any]
) -> tuple[Verdict, list[str], list[str]]:
    """A probe's verdict from its step's criteria: a step invalid only for want of requests or
    time is INCONCLUSIVE (it is extended), one that could not carry its load is NO-GO."""
    deciding = [c for c in criteria if not c.advisory]
    failed = sorted({c.name for c in deciding if c.result == "fail"})
    open_ = sorted({c.name for c in deciding if c.result in ("indeterminate", "not_measured")})
    if load_short:
        return "NO-GO", [*failed, "validity.min_load_fraction"], open_
    if failed:
        return "NO-GO", failed, open_
    if not valid or open_ or not deciding:
        return "INCONCLUSIVE", failed, open_ or (["validity"] if not valid else ["no criterion"])
    return "GO", failed, open_


LATENCY_CRITERIA = ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms",
                    "transfer_p50_ms", "transfer_p99_ms")  # fmt: skip


def worst_ratio(criteria: list[Any]) -> tuple[float | None, str | None]:
    """The latency criterion closest to (or furthest past) its threshold: measured / threshold."""
    best: tuple[float | None, str | None] = (None, None)
    for c in criteria:
        if c.name in LATENCY_CRITERIA and c.measured is not None and c.threshold:
            r = float(c.measured) / float(c.threshold)
            if best[0] is None or r > best[0]:
                best = (round(r, 4), c.name)
    return best


def result(
    bracket: Bracket,
    probes: list[Probe],
    condition: str,
    budget_left: bool,
    prediction: dict[str, Any] | None,
) -> dict[str, Any]:
    """One search's answer, as the report stores it."""
    ax = bracket.axis
    outcome = bracket.outcome(budget_left)
    pred = prediction or {}
    extrapolation = None
    if outcome == "above_range" and pred.get("extrapolated_limit") is not None:
        extrapolation = {
            "limit": pred["extrapolated_limit"],
            "label": "prediction: the simulator's, beyond the range probed",
        }
    return {
        "param": ax.param,
        "unit": UNITS[ax.param],
        "condition": condition,
        "range": [ax.lo, ax.hi],
        "resolution": ax.resolution,
        "limit": bracket.good,
        "bracket": [bracket.good, bracket.bad],
        "bad_end_undecided": bracket.bad_undecided,
        "outcome": outcome,
        "exit_code": EXIT_BY_OUTCOME[outcome],
        "undecided": bracket.undecided,
        "non_monotone": bracket.non_monotone,
        "confirm": bracket.confirm,
        "confirmed": bracket.confirmed,
        "disputed": bracket.disputed,
        "predicted_limit": pred.get("predicted_limit"),
        "prediction": prediction,
        "extrapolation": extrapolation,
        "probes": [asdict(p) for p in probes],
        "steps_run": len(probes),
        "wall_s": round(sum(p.wall_s for p in probes), 1),
    }


def search_exit_code(results: list[dict[str, Any]]) -> int:
    """1 when some condition has no GO in range, else 3 when some has no limit, else 0."""
    codes = [int(r["exit_code"]) for r in results]
    if not codes:
        return 3
    return 1 if 1 in codes else (3 if 3 in codes else 0)


def limit_text(r: dict[str, Any]) -> str:
    """``capacity 23.4 req/s, bracket [23.4, 25] (found, 7 probes)`` for one search."""
    if r["param"] == THRESHOLD:
        return threshold_text(r)
    unit = "" if r["unit"] == "fraction" else f" {r['unit']}"
    good, bad = r["bracket"]

    def fmt(v: float | None) -> str:
        return "–" if v is None else f"{v:g}"

    text = {
        "found": f"limit {fmt(good)}{unit}, bracket [{fmt(good)}, {fmt(bad)}]",
        "above_range": f"GO over the whole range: limit ≥ {fmt(good)}{unit}",
        "below_range": f"NO-GO at the range's good end {fmt(bad)}{unit}: no limit in range",
        "undecided": f"undecided: bracket [{fmt(good)}, {fmt(bad)}]{unit}",
        "budget_exhausted": f"budget spent: bracket [{fmt(good)}, {fmt(bad)}]{unit}",
    }[r["outcome"]]
    if r.get("predicted_limit") is not None:
        text += f"; predicted {r['predicted_limit']:g}{unit}"
    if r.get("extrapolation"):
        text += f" (extrapolated {r['extrapolation']['limit']:g}{unit}, a prediction)"
    return f"{r['param']} under {r['condition']}: {text} ({r['steps_run']} probes)"


def threshold_text(r: dict[str, Any]) -> str:
    """A threshold search's answer (pdx.accept.search.threshold), then each setting to paste,
    a line each."""
    by_value = {p["value"]: p for p in r.get("points", [])}
    head = f"{r['param']} under {r['condition']}"
    if r["policy"]:
        head += f" (policy {r['policy']})"
    pick = r["limit"]
    if pick is None or pick not in by_value:
        why = {"no_go": "no threshold the sample cannot tell from the best goodput was GO",
               "disputed": "the pick was not GO again on confirmation",
               "no_data": "no probe finished"}.get(r["outcome"], r["outcome"])  # fmt: skip
        return f"{head}: none found: {why} ({r['steps_run']} probes)"
    p, best = by_value[pick], by_value.get(r["best"], by_value[pick])
    lo, hi = r["bracket"]
    how = f"{r['steps_run']} probes" + ("" if r["outcome"] == "found" else f", {r['outcome']}")
    text = (f"{head}: {pick} tokens, bracket [{lo}, {hi}]: goodput {_rps(p)} req/s, KV "
            f"{human_bytes(p['kv_bytes'])}, offloaded {100 * (p['offloaded_share'] or 0):.0f} %; "
            f"best goodput {_rps(best)} at {best['value']}; the bracket's thresholds are "
            f"the best's within the sample, this one ships the least ({how})")  # fmt: skip
    for name, line in (r.get("settings") or {}).items():
        text += f"\n  {name}: {line}"
    return text


def _rps(p: dict[str, Any]) -> str:
    g = p["goodput_rps"]
    iv = g.get("interval") or [None, None]
    if None in iv:
        return f"{g['value']:g}"
    return f"{g['value']:g} [{iv[0]:g}, {iv[1]:g}]"
