"""Judging: first whether each step's run is valid, then whether each criterion is met.

Every criterion has one of four results: ``pass`` (the whole interval clears the threshold),
``fail`` (it lies wholly beyond), ``indeterminate`` (it straddles the threshold: the sample is
too small to say) and ``not_measured`` (there is no sample at all: no transfer, no KV object,
no replay, gate data missing). Neither of the last two ever passes a run.

Margins are signed so that positive always means "room to spare": for a maximum,
``margin = threshold − measured``; for a minimum, ``margin = measured − threshold``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from pdx.accept.judge import confidence as ci
from pdx.accept.playbook import Criteria, Playbook, Validity
from pdx.accept.steps import Step

Result = Literal["pass", "fail", "indeterminate", "not_measured"]


@dataclass(frozen=True)
class _Spec:
    """How one criterion is read from a step summary and which bounds judge it."""

    path: str  # the measured value in the summary
    kind: ci.Kind
    unit: str
    method: Literal["quantile", "proportion", "poisson", "observed", "ratio"]
    q: float = 0.0  # quantile criteria
    values: str = ""  # quantile criteria: the per-request values in ``samples``
    k: str = ""  # rate criteria: the count ...
    n: str = ""  # ... out of this many
    unit_of_sample: str = "requests"
    unknown: str = ""  # rate criteria: outcomes that could not be read (counted either way)


def _quantile(path: str, q: float, values: str, of: str = "requests") -> _Spec:
    return _Spec(path, "max", "ms", "quantile", q=q, values=values, unit_of_sample=of)


def _rate(path: str, kind: ci.Kind, k: str, n: str, of: str = "requests") -> _Spec:
    return _Spec(path, kind, "fraction", "proportion", k=k, n=n, unit_of_sample=of)


_CRITERIA: dict[str, _Spec] = {
    "ttft_p50_ms": _quantile("ttft_ms.p50", 0.50, "ttft_ms"),
    "ttft_p99_ms": _quantile("ttft_ms.p99", 0.99, "ttft_ms"),
    "tpot_p50_ms": _quantile("tpot_ms.p50", 0.50, "tpot_ms"),
    "tpot_p99_ms": _quantile("tpot_ms.p99", 0.99, "tpot_ms"),
    "transfer_p50_ms": _quantile("transfer_ms.p50", 0.50, "transfer_ms", "transfers"),
    "transfer_p99_ms": _quantile("transfer_ms.p99", 0.99, "transfer_ms", "transfers"),
    "transfer_success_min": _rate(
        "transfer_success", "min", "transfers_succeeded", "transfers_attempted", "transfers"
    ),
    # Retries per transfer can exceed one: a count per exposure, judged with Poisson bounds.
    "retry_rate_max": _Spec(
        "retry_rate",
        "max",
        "fraction",
        "poisson",
        k="retries",
        n="transfers_attempted",
        unit_of_sample="transfers",
    ),
    "degrade_rate_max": _rate("degrade_rate", "max", "degraded", "requests"),
    "error_rate_max": _rate("error_rate", "max", "failed", "requests"),
    "eviction_rate_max": _rate("eviction_rate", "max", "kv_evicted", "kv_created", "KV objects"),
    "silent_fallback_max": _rate(
        "silent_fallback_rate",
        "max",
        "silent_fallback",
        "labelled_disaggregated",
        "disaggregated requests",
    ),
    # A replay that errored shows neither a match nor a mismatch: it stays in the denominator
    # and counts as a mismatch for the upper bound, as a match for the lower one.
    "output_mismatch_max": _Spec(
        "output_mismatch_rate",
        "max",
        "fraction",
        "proportion",
        k="replay_mismatches",
        n="replayed",
        unit_of_sample="replayed requests",
        unknown="replay_errors",
    ),
    "overdue_requests_max": _rate("overdue_rate", "max", "overdue", "overdue_judged"),
    "plaintext_on_link_max": _rate(
        "plaintext_rate", "max", "plaintext_captures", "wire_captures", "captured packets"
    ),
    "kv_stranded_max_s": _Spec(
        "kv_stranded_max_s", "max", "s", "observed", n="kv_objects", unit_of_sample="KV objects"
    ),
    "idle_ttft_ratio_max": _Spec(
        "idle_ttft_ratio",
        "max",
        "x",
        "ratio",
        q=0.99,
        values="steady_ttft_ms",
        n="steady_requests",
        unit_of_sample="steady requests",
    ),
}

# Read from the servers' own records; where those are missing the gate is not_measured.
GATES = frozenset(
    {"silent_fallback_max", "output_mismatch_max", "kv_stranded_max_s", "overdue_requests_max",
     "idle_ttft_ratio_max", "plaintext_on_link_max"}
)  # fmt: skip
# Judged once every step has run (the link probe is judged against the load the run reached).
LINK_VERDICT = "link_verdict"

METHODS = {
    "quantile": "order statistics (distribution-free)",
    "proportion": "Clopper-Pearson (exact binomial)",
    "poisson": "Garwood (exact Poisson)",
    "observed": "observed maximum",
    "ratio": "burst p99 / steady p99, each bounded by its own order statistics",
    "zero": "count (threshold 0), the rate bounded by Clopper-Pearson",
    "link": "pdx probe-link rules (loss: Clopper-Pearson)",
}


def criterion_spec(name: str) -> tuple[ci.Kind, str, str]:
    """``(kind, method, per-request sample key)`` of a criterion (``link_verdict``: a count)."""
    if name == LINK_VERDICT:
        return "max", "observed", ""
    spec = _CRITERIA[name]
    return spec.kind, spec.method, spec.values


class CriterionResult(BaseModel):
    """One criterion judged on one step.

    ``interval`` is ``[low, high]``: the one-sided bounds at ``confidence`` (null = unbounded
    on that side); ``result`` is pass only when the whole interval clears the threshold.
    """

    name: str
    step: str
    measured: float | None
    threshold: float
    margin: float | None
    passed: bool
    unit: str
    note: str = ""
    result: Result = "pass"
    confidence: float = Field(default=0.0, description="0 = a point estimate, no interval")
    interval: tuple[float | None, float | None] | None = None
    requests_needed: int | None = Field(
        default=None, description="sample size that would decide an indeterminate criterion"
    )
    method: str = ""
    sample: int | None = Field(default=None, description="how many requests/transfers/objects")
    sample_unit: str = "requests"
    rate_bound: float | None = Field(
        default=None,
        description="threshold 0: the upper bound the sample puts on the rate (none observed "
        "in n bounds it to 1 - (1 - c)^(1/n)); passes only at or below judgement.zero_rate_bound",
    )
    advisory: bool = Field(
        default=False, description="reported but not part of the verdict (preflight.advisory)"
    )

    @model_validator(mode="before")
    @classmethod
    def _result_from_passed(cls, data: Any) -> Any:
        # Reports written before results had three values carry only ``passed``.
        if isinstance(data, dict) and "result" not in data and "passed" in data:
            data = {**data, "result": "pass" if data["passed"] else "fail"}
        return data


class ValidityResult(BaseModel):
    """Whether one step ran long enough, with enough requests, at the load asked for."""

    step: str
    valid: bool
    requests: int
    duration_s: float
    load_fraction: float | None
    problems: list[str]


def read_path(summary: dict[str, Any], path: str) -> float | None:
    """``"ttft_ms.p99"`` → ``summary["ttft_ms"]["p99"]`` (None when absent)."""
    node: Any = summary
    for part in path.split("."):
        if not isinstance(node, dict) or node.get(part) is None:
            return None
        node = node[part]
    return float(node)


def judge_step(
    step: Step,
    summary: dict[str, Any],
    criteria: Criteria,
    samples: dict[str, list[float]] | None = None,
    confidence: float = 0.0,
    zero_rate_bound: float = 0.01,
) -> list[CriterionResult]:
    """Every configured criterion for one step, judged at ``confidence`` (0 = point estimates).

    ``samples`` holds the per-request values behind the quantile criteria (``ttft_ms``, ...);
    ``zero_rate_bound`` is the rate a threshold of 0 must be shown to be under. The link
    verdict is judged apart (:func:`judge_link`), once the run's load is known.
    """
    out: list[CriterionResult] = []
    for name, threshold in criteria.model_dump().items():
        if threshold is None or name == LINK_VERDICT:
            continue
        if name == "idle_ttft_ratio_max" and not summary.get("idle_s"):
            continue  # applies to idle-gap steps only
        spec = _CRITERIA[name]
        if threshold == "auto":
            threshold = summary.get("kv_stranded_bound_s")
            if threshold is None:
                out.append(_not_measured(name, step.id, None, spec, summary))
                continue
        measured = read_path(summary, spec.path)
        if measured is None or (spec.method == "observed" and not _count(summary, spec.n)):
            out.append(_not_measured(name, step.id, float(threshold), spec, summary))
            continue
        values = samples or {}
        out.append(
            _judge(
                name, step.id, measured, float(threshold), spec, summary, values, confidence,
                zero_rate_bound,
            )
        )  # fmt: skip
    return out


def _not_measured(
    name: str, step_id: str, threshold: float | None, spec: _Spec, summary: dict[str, Any]
) -> CriterionResult:
    return CriterionResult(
        name=name, step=step_id, measured=None, threshold=threshold or 0.0, margin=None,
        passed=False, unit=spec.unit, note=not_measured_note(name, summary),
        result="not_measured", method="no data", sample=0, sample_unit=spec.unit_of_sample,
    )  # fmt: skip


def _judge(
    name: str,
    step_id: str,
    measured: float,
    threshold: float,
    spec: _Spec,
    summary: dict[str, Any],
    samples: dict[str, list[float]],
    confidence: float,
    zero_rate_bound: float = 0.01,
) -> CriterionResult:
    margin = threshold - measured if spec.kind == "max" else measured - threshold
    n = _sample_size(spec, summary, samples)
    base: dict[str, Any] = {
        "name": name,
        "step": step_id,
        "measured": measured,
        "threshold": threshold,
        "margin": margin,
        "unit": spec.unit,
        "sample": n,
        "sample_unit": spec.unit_of_sample,
    }
    if spec.method in ("proportion", "poisson") and threshold == 0 and spec.kind == "max":
        return _none_observed(base, spec, summary, confidence, zero_rate_bound)
    if confidence <= 0 or spec.method == "observed":
        result: Result = "pass" if margin >= 0 else "fail"
        how = "point estimate (judgement.confidence 0)" if confidence <= 0 else METHODS["observed"]
        return CriterionResult(
            **base,
            passed=result == "pass",
            result=result,
            confidence=0.0,
            interval=(measured, measured),
            method=how,
            note=_observed_note(spec, summary, threshold),
        )
    bounds = _bounds(spec, measured, summary, samples, confidence)
    result = ci.decide(bounds, threshold, spec.kind)
    needed = None
    if result == "indeterminate":
        needed = _needed(spec, threshold, summary, samples, confidence)
    return CriterionResult(
        **base, passed=result == "pass", result=result, confidence=confidence,
        interval=bounds.as_pair(), requests_needed=needed, method=METHODS[spec.method],
        note=_indeterminate_note(spec, bounds, needed) if result == "indeterminate" else "",
    )  # fmt: skip


def _count(summary: dict[str, Any], path: str) -> int:
    value = read_path(summary, path)
    return int(value) if value is not None else 0


def _sample_size(spec: _Spec, summary: dict[str, Any], samples: dict[str, list[float]]) -> int:
    if spec.method == "quantile":
        return len(samples.get(spec.values) or []) or _count(summary, spec.values + ".count")
    return _count(summary, spec.n)


def _bounds(
    spec: _Spec,
    measured: float,
    summary: dict[str, Any],
    samples: dict[str, list[float]],
    confidence: float,
) -> ci.Bounds:
    if spec.method == "quantile":
        return ci.quantile_bounds(samples.get(spec.values) or [], spec.q, confidence)
    if spec.method == "ratio":
        # burst p99 / steady p99: low = burst's lower bound / steady's upper bound, high = the
        # other way round; a side either sample cannot bound stays unbounded (never a pass).
        steady = ci.quantile_bounds(samples.get(spec.values) or [], spec.q, confidence)
        burst = ci.quantile_bounds(samples.get("burst_ttft_ms") or [], spec.q, confidence)
        return ci.Bounds(
            burst.low / steady.high if burst.low is not None and steady.high else None,
            burst.high / steady.low if burst.high is not None and steady.low else None,
        )
    k, n = _count(summary, spec.k), _count(summary, spec.n)
    if spec.method == "poisson":
        return ci.poisson_rate_bounds(k, n, confidence)
    unknown = _count(summary, spec.unknown) if spec.unknown else 0
    if unknown:
        return ci.Bounds(
            ci.proportion_bounds(k, n, confidence).low,
            ci.proportion_bounds(k + unknown, n, confidence).high,
        )
    return ci.proportion_bounds(k, n, confidence)


def _needed(
    spec: _Spec,
    threshold: float,
    summary: dict[str, Any],
    samples: dict[str, list[float]],
    confidence: float,
) -> int | None:
    values = samples.get(spec.values) or []
    if spec.method == "quantile":
        return ci.quantile_needed(values, spec.q, threshold, confidence)
    if spec.method == "ratio":
        # Each side bounds its p99 from above only from this many requests (299 at 95 %).
        first = _first_bounding_n(spec.q, confidence)
        burst = len(samples.get("burst_ttft_ms") or [])
        return first if min(burst, len(values)) < first else None
    k, n = _count(summary, spec.k), _count(summary, spec.n)
    if spec.method == "poisson":
        return ci.poisson_needed(k, n, threshold, spec.kind, confidence)
    return ci.proportion_needed(k, n, threshold, spec.kind, confidence)


def _none_observed(
    base: dict[str, Any],
    spec: _Spec,
    summary: dict[str, Any],
    confidence: float,
    zero_rate_bound: float,
) -> CriterionResult:
    """Threshold 0 ("none allowed"): any observed fails; none observed passes only when the
    sample bounds the rate at or below ``zero_rate_bound``, else it is indeterminate."""
    k, n = _count(summary, spec.k), _count(summary, spec.n)
    unknown = _count(summary, spec.unknown) if spec.unknown else 0
    what = spec.unit_of_sample
    if confidence <= 0:
        return CriterionResult(
            **base, passed=k == 0 and not unknown, result="pass" if k == 0 and not unknown
            else "fail", confidence=0.0, interval=(base["measured"], base["measured"]),
            method="count (threshold 0), point estimate",
            note=f"{k} observed in {n} {what} (point estimate: no bound on the rate)",
        )  # fmt: skip
    bounds = (
        ci.poisson_rate_bounds(k + unknown, n, confidence)
        if spec.method == "poisson"
        else ci.proportion_bounds(k + unknown, n, confidence)
    )
    high = bounds.high if bounds.high is not None else math.inf
    at = f"{confidence:.0%}"
    needed: int | None = None
    if k > 0:
        result: Result = "fail"
        note = f"{k} observed in {n} {what} (threshold 0: none allowed)"
    elif unknown:
        result = "indeterminate"
        note = (
            f"none observed, but {unknown} of {n} {what} could not be compared (they errored): "
            f"rate <= {high:.3%} at {at}"
        )
    elif high <= zero_rate_bound:
        result = "pass"
        note = f"none observed in {n} {what}: rate <= {high:.3%} at {at}"
    else:
        result = "indeterminate"
        needed = ci.none_seen_needed(zero_rate_bound, confidence)
        note = (
            f"none observed in {n} {what}, which bounds the rate only to <= {high:.3%} at {at} "
            f"(judgement.zero_rate_bound {zero_rate_bound:.3%} needs {needed:,} with none seen)"
        )
    return CriterionResult(
        **base, passed=result == "pass", result=result, confidence=confidence,
        interval=(0.0 if k == 0 else bounds.low, bounds.high), method=METHODS["zero"],
        note=note, rate_bound=bounds.high, requests_needed=needed,
    )  # fmt: skip


def _first_bounding_n(q: float, confidence: float) -> int:
    """The smallest sample whose order statistics bound the q-quantile from above."""
    n = 1
    while ci.quantile_order_indices(n, q, confidence)[1] is None:
        n = n * 2
    lo, hi = n // 2, n
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ci.quantile_order_indices(mid, q, confidence)[1] else (mid, hi)
    return hi


def _observed_note(spec: _Spec, summary: dict[str, Any], threshold: float | None = None) -> str:
    if spec.method != "observed":
        return ""
    if summary.get("kv_stranded_source") == "prefill_kv_usage":
        held = summary.get("kv_stranded_max_s")
        if summary.get("kv_stranded_still_held"):
            return f"prefill's KV usage still above 0 {held:g} s after the step's last request"
        return f"prefill's KV usage back to 0 within {held:g} s of the step's last request"
    holds = summary.get("_kv_stranded_holds_s")
    over = (
        sum(1 for h in holds if h > threshold)
        if holds is not None and threshold is not None
        else int(summary.get("kv_stranded_over_bound") or 0)
    )
    held = int(summary.get("kv_stranded_still_held") or 0)
    parts = [f"{over} of {int(summary.get('kv_objects') or 0)} KV objects over the bound"]
    if held:
        parts.append(f"{held} still held when the step ended")
    return "; ".join(parts)


def _indeterminate_note(spec: _Spec, bounds: ci.Bounds, needed: int | None) -> str:
    if needed is None:
        return "the interval straddles the threshold; no sample size at this rate decides it"
    return f"needs about {needed:,} {spec.unit_of_sample} at the observed value to decide"


_NOT_MEASURED = {
    "transfer_": "no KV transfer in this step: nothing shows the link carried KV (every prompt "
    "prefilled locally, or the target reports no transfer counters); send prompts longer than "
    "router.local_prefill_max_tokens, or set the criterion to null to leave it unjudged",
    "retry_": "no KV transfer in this step, so no retry rate (see transfer_success_min)",
    "eviction_": "no KV object created in this step (or the target exposes no store counters)",
    "ttft_": "no successful request to measure",
    "tpot_": "no successful request with more than one token",
    "degrade_": "no request in this step",
    "error_": "no request in this step",
    "kv_stranded": "no KV object entered the store in this step (no store audit, or nothing "
    "was shipped): nothing shows KV is released",
    "silent_fallback": "no request labelled disaggregated in this step",
    "output_mismatch": "no replayed request in this step (judgement.replay_requests)",
    "overdue": "no request in this step",
    "plaintext_on_link": "no capture of the link between the sites (needs target.netns)",
    "idle_ttft": "no idle burst in this step",
}


def not_measured_note(name: str, summary: dict[str, Any]) -> str:
    """Why a criterion has no sample on this step, and what would measure it."""
    for why in summary.get("gates_not_measured") or []:
        if str(why).startswith(name + ":"):
            return str(why).split(":", 1)[1].strip()
    return next((v for k, v in _NOT_MEASURED.items() if name.startswith(k)), "no data")


def judge_link(
    step_id: str, verdict: dict[str, Any] | None, why_missing: str, advisory: bool
) -> CriterionResult:
    """The link verdict (probe-link's rules against this run's KV demand) as a criterion.

    ``verdict`` is probe-link's ``verdict`` object for the link under this step's condition
    (None: not probed, ``why_missing`` says why); GO passes, NO-GO fails, INCONCLUSIVE is
    indeterminate. With ``advisory`` it is reported but left out of the run's verdict.
    """
    base: dict[str, Any] = {
        "name": LINK_VERDICT, "step": step_id, "threshold": 0.0, "unit": "rules failed",
        "method": METHODS["link"], "sample_unit": "rules", "advisory": advisory,
    }  # fmt: skip
    if verdict is None:
        return CriterionResult(
            **base, measured=None, margin=None, passed=False, result="not_measured",
            note=why_missing, sample=0,
        )  # fmt: skip
    rules = verdict.get("rules") or []
    judged = [r for r in rules if r.get("status") in ("pass", "fail", "indeterminate")]
    failed = [r for r in judged if r["status"] == "fail"]
    word = verdict.get("result") or ("GO" if verdict.get("go") else "NO-GO")
    result: Result = {"GO": "pass", "NO-GO": "fail"}.get(word, "indeterminate")  # type: ignore[assignment]
    parts = [f"{r['name']} {r['status']}" for r in rules]
    return CriterionResult(
        **base, measured=float(len(failed)), margin=float(-len(failed)), passed=result == "pass",
        result=result, sample=len(judged), note=f"link {word}: " + ", ".join(parts),
    )  # fmt: skip


def not_judged(pb: Playbook, steps: list[Step]) -> list[dict[str, str]]:
    """Criteria the playbook set to null (globally, or under a condition), with their steps."""
    out = []
    explicit = sorted(n for n in pb.criteria.model_fields_set if getattr(pb.criteria, n) is None)
    for name in explicit:
        out.append({"name": name, "steps": "every step", "why": f"criteria.{name}: null"})
    for cond_name, cond in pb.conditions.items():
        ids = [s.id for s in steps if s.network == cond_name]
        for name, value in cond.criteria.items():
            if ids and value is None and name not in explicit:
                why = f"conditions.{cond_name}.criteria.{name}: null"
                out.append({"name": name, "steps": ", ".join(ids), "why": why})
    if pb.criteria.link_verdict == "auto" and not pb.preflight.probe_link:
        why = "link_verdict auto without preflight.probe_link: nothing measured the KV link"
        out.append({"name": LINK_VERDICT, "steps": "every step", "why": why})
    return out


def check_validity(
    step: Step, summary: dict[str, Any], elapsed_s: float, rules: Validity
) -> ValidityResult:
    """The MLPerf-style first question: may these numbers be judged at all?"""
    problems: list[str] = []
    n = int(summary.get("requests", 0))
    if n < rules.min_requests:
        problems.append(f"{n} requests < validity.min_requests {rules.min_requests}")
    if elapsed_s < rules.min_duration_s:
        problems.append(f"ran {elapsed_s:.1f} s < validity.min_duration_s {rules.min_duration_s:g}")
    achieved = summary.get(
        "achieved_concurrency" if step.concurrency is not None else "achieved_rps"
    )
    fraction = (achieved / step.target_load) if achieved is not None and step.target_load else None
    if fraction is not None and fraction < rules.min_load_fraction:
        what = "mean in-flight requests" if step.concurrency is not None else "achieved req/s"
        problems.append(
            f"{what} {achieved:.2f} is {fraction:.0%} of target {step.target_load:g} "
            f"< validity.min_load_fraction {rules.min_load_fraction:.0%}"
        )
    return ValidityResult(
        step=step.id,
        valid=not problems,
        requests=n,
        duration_s=elapsed_s,
        load_fraction=fraction,
        problems=problems,
    )


LOOSE_FACTOR = 10.0


def loose_criteria(results: list[CriterionResult]) -> list[dict[str, Any]]:
    """Criteria whose threshold is more than ``LOOSE_FACTOR`` × what was measured on every step
    that measured them: not a constraint here, so a GO says nothing about them.

    A bound is compared when the criterion has one (its interval's far side), else the value;
    for a ``*_min`` criterion the shortfalls ``1 - x`` are compared. A threshold of 0 is never
    loose, and neither is the link verdict (not a number).
    """
    by_name: dict[str, list[CriterionResult]] = {}
    for r in results:
        if r.name != "link_verdict" and r.result in ("pass", "fail"):
            by_name.setdefault(r.name, []).append(r)
    out = []
    for name, rows in by_name.items():
        ratios = [_looseness(name, r) for r in rows]
        if ratios and all(x is not None and x > LOOSE_FACTOR for x in ratios):
            worst = min(x for x in ratios if x is not None)
            out.append({
                "name": name,
                "threshold": rows[0].threshold,
                "steps": len(rows),
                "headroom": round(worst, 1) if worst != float("inf") else None,
                "note": f"not a constraint here: the threshold is more than {LOOSE_FACTOR:g}× "
                "the measured value on every step",
            })  # fmt: skip
    return out


def _looseness(name: str, r: CriterionResult) -> float | None:
    """threshold / measured (its bound when it has one); inf when nothing was measured above 0."""
    far = r.interval[1] if r.interval and not name.endswith("_min") else (
        r.interval[0] if r.interval else None)  # fmt: skip
    value = far if far is not None else r.measured
    if value is None or r.threshold is None:
        return None
    if name.endswith("_min"):
        value, threshold = 1.0 - float(value), 1.0 - float(r.threshold)
    else:
        value, threshold = float(value), float(r.threshold)
    if threshold <= 0:
        return None
    return float("inf") if value <= 0 else threshold / value


EXIT_CODES = {"GO": 0, "NO-GO": 1, "INCONCLUSIVE": 3}


def run_verdict(
    valid: bool, criteria: list[CriterionResult]
) -> Literal["GO", "NO-GO", "INCONCLUSIVE"]:
    """Any failed criterion or an invalid run → NO-GO; else any undecided or unmeasured one →
    INCONCLUSIVE; GO needs at least one judged criterion. Advisory criteria never decide."""
    deciding = [c for c in criteria if not c.advisory]
    if not valid or any(c.result == "fail" for c in deciding):
        return "NO-GO"
    if not deciding or any(c.result in ("indeterminate", "not_measured") for c in deciding):
        return "INCONCLUSIVE"
    return "GO"
