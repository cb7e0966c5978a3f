"""Comparing two reports for ``pdx report diff``: per criterion, per predicted metric and per
recommended setting, A's and B's figures and what changed, and each report's smallest margin.
"""

from __future__ import annotations

import math
from typing import Any

from pdx.accept.report.schema import RECOMMENDATION_NAMES, Report

SIGNIFICANT_DIGITS = 12  # a difference is exact to this many digits of its operands


def difference(a: float, b: float) -> float:
    """``b - a`` without the float residue of the subtraction (0.996 - 0.995 is 0.001, not
    0.000999...): rounded to :data:`SIGNIFICANT_DIGITS` digits of the larger operand."""
    scale = max(abs(a), abs(b))
    if scale == 0 or not math.isfinite(scale):
        return b - a
    return round(b - a, SIGNIFICANT_DIGITS - 1 - math.floor(math.log10(scale)))


def diff_reports(a: Report, b: Report) -> list[dict[str, Any]]:
    """Per (criterion, step): measured and pass/fail in A and in B, and the change."""
    key = lambda c: (c.name, c.step)  # noqa: E731
    left = {key(c): c for c in a.criteria}
    right = {key(c): c for c in b.criteria}
    rows = []
    for k in sorted(set(left) | set(right)):
        ca, cb = left.get(k), right.get(k)
        change = None
        if ca and cb and ca.measured is not None and cb.measured is not None:
            change = difference(ca.measured, cb.measured)
        status = (
            "only in A"
            if cb is None
            else "only in B"
            if ca is None
            else "same"
            if ca.result == cb.result
            else {
                "fail": "now fails",
                "pass": "now passes",
                "indeterminate": "now undecided",
                "not_measured": "now not measured",
            }[cb.result]
        )
        rows.append(
            {
                "criterion": k[0],
                "step": k[1],
                "a_measured": ca.measured if ca else None,
                "b_measured": cb.measured if cb else None,
                "a_threshold": ca.threshold if ca else None,
                "b_threshold": cb.threshold if cb else None,
                "change": change,
                "a_passed": ca.passed if ca else None,
                "b_passed": cb.passed if cb else None,
                "a_result": ca.result if ca else None,
                "b_result": cb.result if cb else None,
                "status": status,
                "unit": ca.unit if ca else cb.unit if cb else "",
                "a_margin": ca.margin if ca else None,
                "b_margin": cb.margin if cb else None,
                "margin_change": difference(ca.margin, cb.margin)
                if ca and cb and ca.margin is not None and cb.margin is not None
                else None,
            }
        )
    return rows


def smallest_margin(report: Report) -> dict[str, Any] | None:
    """The criterion with the least room to spare, as a share of its threshold (criteria with a
    nonzero threshold and a measured margin): the SLO margin a change of settings should grow."""
    rows = [(c.margin / c.threshold, c) for c in report.criteria
            if c.margin is not None and c.threshold]  # fmt: skip
    if not rows:
        return None
    share, c = min(rows, key=lambda r: r[0])
    return {"criterion": c.name, "step": c.step, "margin": c.margin, "threshold": c.threshold,
            "margin_pct": share * 100}  # fmt: skip


def diff_predictions(a: Report, b: Report) -> list[dict[str, Any]]:
    """Per (step, metric) predicted in either run: both errors and results."""
    left = {s.id: s for s in a.steps}
    right = {s.id: s for s in b.steps}
    rows = []
    for sid in sorted(set(left) | set(right)):
        pa = (left[sid].prediction or {}) if sid in left else {}
        pb = (right[sid].prediction or {}) if sid in right else {}
        for metric in sorted(set(pa) | set(pb)):
            ea, eb = pa.get(metric) or {}, pb.get(metric) or {}
            rows.append(
                {
                    "step": sid,
                    "metric": metric,
                    "a_predicted": ea.get("predicted"),
                    "b_predicted": eb.get("predicted"),
                    "a_measured": ea.get("measured"),
                    "b_measured": eb.get("measured"),
                    "a_error_pct": ea.get("error_pct"),
                    "b_error_pct": eb.get("error_pct"),
                    "a_result": ea.get("result"),
                    "b_result": eb.get("result"),
                }
            )
        ua = left[sid].unexplained if sid in left else None
        ub = right[sid].unexplained if sid in right else None
        if ua or ub:
            rows.append({"step": sid, "metric": "unexplained", "a_result": ua, "b_result": ub})
    return rows


def diff_recommendations(a: Report, b: Report) -> list[dict[str, Any]]:
    """Per recommendation: the value in A and in B, whether it changed, B's reason."""
    rows = []
    for name in RECOMMENDATION_NAMES:
        ra, rb = a.recommendations.get(name), b.recommendations.get(name)
        va = ra.value if ra else None
        vb = rb.value if rb else None
        rows.append({"name": name, "a_value": va, "b_value": vb, "changed": va != vb,
                     "b_why": rb.why if rb else None})  # fmt: skip
    return rows


def diff_searches(a: Report, b: Report) -> list[dict[str, Any]]:
    """Per (param, condition, route) searched in either: A's and B's limit and bracket."""

    def key(s: dict[str, Any]) -> tuple[str, str, str]:
        return (s["param"], s["condition"], s.get("route") or "")

    left = {key(s): s for s in a.search or []}
    right = {key(s): s for s in b.search or []}
    rows = []
    for k in sorted(set(left) | set(right)):
        sa, sb = left.get(k), right.get(k)
        la, lb = (sa or {}).get("limit"), (sb or {}).get("limit")
        change_pct = (lb - la) / la * 100 if la and lb is not None else None
        rows.append({
            "param": k[0], "condition": k[1], "route": k[2] or None,
            "a_limit": la, "b_limit": lb,
            "a_bracket": (sa or {}).get("bracket"), "b_bracket": (sb or {}).get("bracket"),
            "a_outcome": (sa or {}).get("outcome"), "b_outcome": (sb or {}).get("outcome"),
            "change_pct": None if change_pct is None else round(change_pct, 1),
            "status": "only in A" if sb is None else "only in B" if sa is None else (
                _limit_status(sa, sb)),
        })  # fmt: skip
    return rows


def _limit_status(sa: dict[str, Any], sb: dict[str, Any]) -> str:
    """Whether B's bracket lies wholly past A's (lower or higher limit), or they overlap."""
    (ga, ba), (gb, bb) = sa["bracket"], sb["bracket"]
    up = sa["param"] != "bandwidth_mbps"  # a higher limit is better for every other param
    if None in (ga, gb):
        return "no limit to compare"
    if ba is not None and (gb >= ba if up else gb <= ba):
        return "higher limit" if up else "lower limit (better)"
    if bb is not None and (ga >= bb if up else ga <= bb):
        return "lower limit" if up else "higher limit (worse)"
    return "brackets overlap"
