"""GO / NO-GO / INCONCLUSIVE: can this link carry the KV load within the TTFT budget?

Rules (thresholds configurable): KV demand <= 70 % of measured available bandwidth;
RTT p99 <= 20 % of the TTFT budget; loss <= 0.1 %; chunk p99 <= 15 % of the TTFT budget;
jitter (RFC 3550, under load when measured there) <= 50 % of the RTT p50 (at least 1 ms: a
quiet path's microseconds are no risk); path MTU >= 1,280 B (below it IPv6 cannot run and every
full segment is over 4 % headers).
Each rule reports measured value, threshold, margin (threshold - measured, so positive
is headroom) and pass / fail / indeterminate / skip. Rules whose inputs were not given are
skipped, and say why. Loss is judged on its Clopper-Pearson bounds at ``confidence``: pass
only when the probes bound it at or under the threshold (0 lost of 2,995 bounds it to 0.1 %
at 95 %), fail only when they bound it above. The chunk rule judges every swept size
(``sizes``) and passes when one does: it is judged on the size to use, the recommended one
(which ``probe-link`` chooses among the passing sizes), and fails only when no size passes.

The verdict is GO only when every rule it needs (bandwidth, RTT, loss) was judged and none
failed or stayed undecided; NO-GO when any rule failed; INCONCLUSIVE otherwise.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdx.errors import InputError
from pdx.link.chunks import choose_chunk
from pdx.link.stats import clopper_pearson
from pdx.units import bytes_per_s_to_gbps, human_bytes

REQUIRED_RULES = ("kv_bandwidth", "rtt", "loss")
"""Without these judged, nothing says the link carries the KV load in time."""


@dataclass(frozen=True)
class VerdictRules:
    """Thresholds of the verdict, as shares of measured bandwidth and of the TTFT budget."""

    kv_gbps: float | None = None
    ttft_budget_ms: float | None = None
    bandwidth_share: float = 0.70
    rtt_share: float = 0.20
    max_loss_pct: float = 0.1
    chunk_share: float = 0.15
    jitter_share: float = 0.5  # of the RTT p50
    jitter_floor_ms: float = 1.0
    min_mtu: int = 1280
    kv_direction: str = "up"  # up: probe-link's host sends the KV; down: the server's; both
    confidence: float = 0.95

    @property
    def chunk_p99_limit_ms(self) -> float | None:
        """The most a chunk's p99 may take (None without a TTFT budget)."""
        return None if self.ttft_budget_ms is None else self.chunk_share * self.ttft_budget_ms


@dataclass
class Rule:
    """One judged rule."""

    name: str
    status: str  # "pass", "fail", "indeterminate" or "skip"
    measured: float | None
    threshold: float | None
    margin: float | None
    unit: str
    detail: str
    # chunk_p99 only: every swept size judged (chunk_bytes, gbps, p99_ms, status, margin,
    # recommended); None for the other rules
    sizes: list[dict[str, Any]] | None = None


@dataclass
class Verdict:
    """GO, NO-GO or INCONCLUSIVE, with every rule and which were judged."""

    go: bool
    rules: list[Rule] = field(default_factory=list)
    result: str = "INCONCLUSIVE"  # GO | NO-GO | INCONCLUSIVE
    judged: list[str] = field(default_factory=list)
    why: str = ""


def kv_demand_from_report(path: Path, qps: float, seq: int | None = None) -> tuple[float, str]:
    """KV Gbps from a ``measure-kv --json`` report: ``requests[].kv_bytes`` x ``qps``.

    Takes the request row for ``seq`` when given, else the largest ``kv_bytes`` row
    (the peak demand). Returns (Gbps, a description of the choice).
    """
    if qps <= 0:
        raise InputError("--qps", qps, "a positive request rate with --kv-report")
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise InputError("--kv-report", str(path), "an existing measure-kv --json file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError("--kv-report", str(path), f"readable JSON ({exc})") from None
    rows = _request_rows(data, path)
    if seq is not None:
        rows = [r for r in rows if r.get("seq") == seq]
        if not rows:
            raise InputError("--seq", seq, f"a seq present in {path}'s requests[]")
    row = max(rows, key=lambda r: r["kv_bytes"])
    gbps = bytes_per_s_to_gbps(float(row["kv_bytes"]) * qps)
    return gbps, f"{row['kv_bytes']} B/request (seq {row.get('seq')}) x {qps:g} req/s"


def _request_rows(data: Any, path: Path) -> list[dict[str, Any]]:
    rows = data.get("requests") if isinstance(data, dict) else None
    expected = "a measure-kv --json report with requests[].kv_bytes"
    if not isinstance(rows, list) or not rows:
        raise InputError("--kv-report", str(path), expected)
    good = [
        r
        for r in rows
        if isinstance(r, dict)
        and isinstance(r.get("kv_bytes"), int | float)
        and not isinstance(r.get("kv_bytes"), bool)
    ]
    if len(good) != len(rows):
        raise InputError("--kv-report", str(path), expected)
    return good


def _judge(
    name: str, measured: float, threshold: float, unit: str, detail: str, lower_is_better: bool
) -> Rule:
    margin = threshold - measured if lower_is_better else measured - threshold
    return Rule(name, "pass" if margin >= 0 else "fail", measured, threshold, margin, unit, detail)


def _skip(name: str, unit: str, why: str) -> Rule:
    return Rule(name, "skip", None, None, None, unit, why)


def judge(report: dict[str, Any], rules: VerdictRules) -> Verdict:
    """Apply the rules to a probe report (the ``probe-link --json`` document)."""
    all_rules = [
        _bandwidth_rule(report, rules),
        _rtt_rule(report, rules),
        _loss_rule(report, rules),
        _chunk_rule(report, rules),
        _jitter_rule(report, rules),
        _mtu_rule(report, rules),
    ]
    judged = [r.name for r in all_rules if r.status != "skip"]
    failed = [r.name for r in all_rules if r.status == "fail"]
    open_ = [r.name for r in all_rules if r.status == "indeterminate"]
    missing = [n for n in REQUIRED_RULES if n not in judged]
    if failed:
        result, why = "NO-GO", "failed: " + ", ".join(failed)
    elif open_ or missing:
        parts = [f"undecided: {', '.join(open_)}"] if open_ else []
        parts += [f"not judged: {', '.join(missing)}"] if missing else []
        result, why = "INCONCLUSIVE", "; ".join(parts)
    else:
        result, why = "GO", "judged: " + ", ".join(judged)
    return Verdict(go=result == "GO", rules=all_rules, result=result, judged=judged, why=why)


def _bandwidth_rule(report: dict[str, Any], rules: VerdictRules) -> Rule:
    name, unit = "kv_bandwidth", "Gbps"
    if rules.kv_gbps is None:
        return _skip(name, unit, "no KV demand given (--kv-gbps or --kv-report with --qps)")
    tp = report.get("throughput") or {}
    keys = {"up": ["up_gbps"], "down": ["down_gbps"]}.get(rules.kv_direction)
    values = [tp.get(k) for k in keys or ["up_gbps", "down_gbps"]]
    measured = [v for v in values if v is not None]
    avail = min(measured) if measured else None
    if avail is None:
        return _skip(name, unit, "throughput was not measured")
    threshold = rules.bandwidth_share * avail
    detail = (
        f"KV demand vs {rules.bandwidth_share:.0%} of {avail:.3f} Gbps available "
        f"({rules.kv_direction})"
    )
    if tp.get("converged") is False:
        detail += f"; goodput did not converge (95 % CI ±{tp.get('ci95_pct', math.inf):.1f} %)"
    return _judge(name, rules.kv_gbps, threshold, unit, detail, lower_is_better=True)


def _rtt_rule(report: dict[str, Any], rules: VerdictRules) -> Rule:
    name, unit = "rtt", "ms"
    if rules.ttft_budget_ms is None:
        return _skip(name, unit, "no TTFT budget given (--ttft-budget-ms)")
    rtt = (report.get("rtt_ms") or {}).get("p99")
    if rtt is None:
        return _skip(name, unit, "idle latency was not measured")
    threshold = rules.rtt_share * rules.ttft_budget_ms
    detail = f"idle RTT p99 vs {rules.rtt_share:.0%} of the {rules.ttft_budget_ms:g} ms budget"
    return _judge(name, rtt, threshold, unit, detail, lower_is_better=True)


def _jitter_rule(report: dict[str, Any], rules: VerdictRules) -> Rule:
    """Interarrival jitter against a share of the RTT: a path whose delay swings by half its
    RTT makes every transfer's tail (and its derived deadline) a coin toss."""
    name, unit = "jitter", "ms"
    jitter = report.get("jitter_ms") or {}
    loaded = jitter.get("rfc3550_under_load")
    measured = loaded if loaded is not None else jitter.get("rfc3550")
    rtt = (report.get("rtt_ms") or {}).get("p50")
    if measured is None or rtt is None:
        return _skip(name, unit, "jitter or the RTT was not measured")
    threshold = max(rules.jitter_share * rtt, rules.jitter_floor_ms)
    where = "under load" if loaded is not None else "idle"
    detail = (
        f"RFC 3550 jitter ({where}) vs {rules.jitter_share:.0%} of the RTT p50 {rtt:.3g} ms "
        f"(at least {rules.jitter_floor_ms:g} ms)"
    )
    return _judge(name, measured, threshold, unit, detail, lower_is_better=True)


def _mtu_rule(report: dict[str, Any], rules: VerdictRules) -> Rule:
    name, unit = "mtu", "B"
    mtu = report.get("mtu")
    if mtu is None:
        return _skip(name, unit, "the path MTU was not measured (--phases mtu)")
    detail = f"path MTU vs {rules.min_mtu} B (IPv6's minimum; headers 52 B per segment)"
    return _judge(name, float(mtu), float(rules.min_mtu), unit, detail, lower_is_better=False)


def _loss_rule(report: dict[str, Any], rules: VerdictRules) -> Rule:
    name, unit = "loss", "%"
    loss = report.get("loss") or {}
    if loss.get("up") is None:
        return _skip(name, unit, "loss was not measured")
    worst = max(loss["up"], loss["down"])
    sent = int(loss.get("probes") or 0)
    up_lost = int(loss.get("up_count") or 0)
    down_lost = int(loss.get("down_count") or 0)
    c = rules.confidence
    # each direction's one-sided Clopper-Pearson bounds, in percent
    bounds = [_cp_pct(up_lost, sent, c), _cp_pct(down_lost, max(sent - up_lost, 0), c)]
    low, high = max(b[0] for b in bounds), max(b[1] for b in bounds)
    threshold = rules.max_loss_pct
    detail = (
        f"worse of upstream/downstream over {sent} probes; bounds {low:.3f}-{high:.3f} % at {c:.0%}"
    )
    if high <= threshold:
        status = "pass"
    elif low > threshold:
        status = "fail"
    else:
        status = "indeterminate"
        need = _probes_needed(threshold / 100, c)
        detail += (
            f"; too few probes to show loss <= {threshold:g} % (none lost in {need:,} would)"
            if need
            else f"; no probe count shows loss <= {threshold:g} %"
        )
    return Rule(name, status, worst, threshold, threshold - worst, unit, detail)


def _cp_pct(k: int, n: int, confidence: float) -> tuple[float, float]:
    """One-sided Clopper-Pearson bounds on a loss rate, in percent (0-100 with no sample)."""
    low, high = clopper_pearson(k, n, confidence)
    return 100.0 * low, 100.0 * high


def _probes_needed(rate: float, confidence: float) -> int | None:
    """Probes with none lost that bound the loss rate to ``rate``: ⌈ln(1 − c) / ln(1 − rate)⌉."""
    if rate <= 0:
        return None
    return math.ceil(math.log(1.0 - confidence) / math.log1p(-min(rate, 0.999999)) - 1e-9)


def _chunk_rule(report: dict[str, Any], rules: VerdictRules) -> Rule:
    name, unit = "chunk_p99", "ms"
    threshold = rules.chunk_p99_limit_ms
    if threshold is None:
        return _skip(name, unit, "no TTFT budget given (--ttft-budget-ms)")
    chunks = report.get("chunks") or []
    if not chunks:
        return _skip(name, unit, "the chunk sweep was not run")
    passing = {c["chunk_bytes"] for c in chunks if c["p99_ms"] <= threshold}
    recommended = report.get("chunk_recommended_bytes")
    # a report re-judged at another budget (pdx accept) may recommend a size that now fails
    use = recommended if recommended in passing else choose_chunk(chunks, max_p99_ms=threshold)
    sizes = [_chunk_size_row(c, threshold, use) for c in chunks]
    budget = f"{rules.chunk_share:.0%} of the {rules.ttft_budget_ms:g} ms budget"
    listed = f"pass: {_sizes_text(sizes, 'pass')}; fail: {_sizes_text(sizes, 'fail')}"
    if use is None:
        nearest = min(chunks, key=lambda c: c["p99_ms"])
        detail = (f"no swept chunk size's p99 is within {budget} ({listed}); measured: the "
                  f"nearest, {human_bytes(nearest['chunk_bytes'])}")  # fmt: skip
        return Rule(name, "fail", nearest["p99_ms"], threshold,
                    threshold - nearest["p99_ms"], unit, detail, sizes)  # fmt: skip
    row = next(c for c in chunks if c["chunk_bytes"] == use)
    detail = f"p99 time of a {human_bytes(use)} chunk, the size to use, vs {budget} ({listed})"
    if recommended is not None and recommended != use:
        detail += f"; the report recommended {human_bytes(recommended)}, which fails this budget"
    return Rule(name, "pass", row["p99_ms"], threshold, threshold - row["p99_ms"], unit, detail,
                sizes)  # fmt: skip


def _chunk_size_row(chunk: dict[str, Any], threshold: float, use: int | None) -> dict[str, Any]:
    margin = threshold - chunk["p99_ms"]
    return {
        "chunk_bytes": chunk["chunk_bytes"],
        "gbps": chunk.get("gbps"),
        "p99_ms": chunk["p99_ms"],
        "status": "pass" if margin >= 0 else "fail",
        "margin": margin,
        "recommended": chunk["chunk_bytes"] == use,
    }


def _sizes_text(sizes: list[dict[str, Any]], status: str) -> str:
    """``256.0 KiB (47.8 ms), 1.0 MiB (56.8 ms)`` for the sizes with ``status``, or none."""
    mine = [f"{human_bytes(s['chunk_bytes'])} ({s['p99_ms']:.1f} ms)" for s in sizes
            if s["status"] == status]  # fmt: skip
    return ", ".join(mine) or "none"
