"""Judging: first whether each step's run is valid, then whether each criterion is met.

Margins are signed so that positive always means "room to spare": for a maximum,
``margin = threshold − measured``; for a minimum, ``margin = measured − threshold``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from pdx.accept.playbook import Criteria, Step, Validity

# criterion name → (how to read it from a step summary, "max" or "min", unit)
_CRITERIA: dict[str, tuple[str, str, str]] = {
    "ttft_p50_ms": ("ttft_ms.p50", "max", "ms"),
    "ttft_p99_ms": ("ttft_ms.p99", "max", "ms"),
    "tpot_p99_ms": ("tpot_ms.p99", "max", "ms"),
    "transfer_p50_ms": ("transfer_ms.p50", "max", "ms"),
    "transfer_p99_ms": ("transfer_ms.p99", "max", "ms"),
    "transfer_success_min": ("transfer_success", "min", "fraction"),
    "retry_rate_max": ("retry_rate", "max", "fraction"),
    "degrade_rate_max": ("degrade_rate", "max", "fraction"),
    "error_rate_max": ("error_rate", "max", "fraction"),
    "eviction_rate_max": ("eviction_rate", "max", "fraction"),
}


class CriterionResult(BaseModel):
    """One criterion judged on one step."""

    name: str
    step: str
    measured: float | None
    threshold: float
    margin: float | None
    passed: bool
    unit: str
    note: str = ""


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


def judge_step(step: Step, summary: dict[str, Any], criteria: Criteria) -> list[CriterionResult]:
    """Every configured criterion for one step."""
    out: list[CriterionResult] = []
    for name, threshold in criteria.model_dump().items():
        if threshold is None:
            continue
        path, kind, unit = _CRITERIA[name]
        measured = read_path(summary, path)
        if measured is None:
            out.append(
                CriterionResult(
                    name=name,
                    step=step.id,
                    measured=None,
                    threshold=threshold,
                    margin=None,
                    passed=_absent_passes(name, summary),
                    unit=unit,
                    note=_absent_note(name),
                )
            )
            continue
        margin = threshold - measured if kind == "max" else measured - threshold
        out.append(
            CriterionResult(
                name=name,
                step=step.id,
                measured=measured,
                threshold=threshold,
                margin=margin,
                passed=margin >= 0,
                unit=unit,
            )
        )
    return out


def _absent_passes(name: str, summary: dict[str, Any]) -> bool:
    # No KV transfer happened (e.g. every prompt prefilled locally): nothing to fail on transfer
    # criteria, and that is said in the note. Latency criteria with no data fail: no evidence.
    return name.startswith(("transfer_", "retry_", "eviction_")) and summary.get("ok", 0) > 0


def _absent_note(name: str) -> str:
    if name.startswith(("transfer_", "retry_", "eviction_")):
        return "no KV transfers or counters observed in this step"
    return "no successful request to measure"


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


_LATENCY = {"ttft_p50_ms", "ttft_p99_ms", "tpot_p99_ms"}


def load_caps(failed: list[CriterionResult], steps: list[tuple[Step, dict[str, Any]]]) -> list[str]:
    """Per (network, input, output): the largest load whose step met every latency criterion."""
    bad = {c.step for c in failed if c.name in _LATENCY}
    groups: dict[tuple[str, int, int], list[Step]] = {}
    for step, _ in steps:
        groups.setdefault((step.network, step.input_tokens, step.output_tokens), []).append(step)
    out = []
    for (net, inp, outp), members in groups.items():
        failing = [s.target_load for s in members if s.id in bad]
        if not failing:
            continue
        unit = "users" if members[0].concurrency is not None else "req/s"
        ok = [s.target_load for s in members if s.id not in bad and s.target_load < min(failing)]
        where = f"in={inp}/out={outp} tokens on {net}"
        out.append(
            f"cap load at {max(ok):g} {unit} for {where} (first failing: {min(failing):g})"
            if ok
            else f"no tested load meets the latency SLA for {where} (even {min(failing):g} {unit})"
        )
    return out


def kv_demand(steps: list[tuple[Step, dict[str, Any]]], link_gbps: float) -> list[str]:
    """Measured KV link demand per step, as a share of the link and the codec ratio for 70 %."""
    out = []
    for step, summary in steps:
        kv_bytes, elapsed = summary.get("kv_bytes") or 0, summary.get("elapsed_s") or 0.0
        if not kv_bytes or not elapsed:
            continue
        gbps = kv_bytes * 8 / elapsed / 1e9
        share = gbps / link_gbps
        need = (
            f"; a codec of ratio >= {share / 0.7:.2g}x keeps it under 70 %" if share > 0.7 else ""
        )
        out.append(
            f"{step.id}: KV demand {gbps:.3g} Gbit/s = {share:.1%} of {link_gbps:g} Gbit/s{need}"
        )
    return out


def recommendations(
    failed: list[CriterionResult],
    invalid: list[ValidityResult],
    steps: list[tuple[Step, dict[str, Any]]],
    link_gbps: float = 100.0,
) -> list[str]:
    """What would change each failure, in the reviewer's terms (with measured figures)."""
    recs: list[str] = []
    for v in invalid:
        recs.append(
            f"{v.step}: run is not valid ({'; '.join(v.problems)}); lengthen matrix.duration_s, "
            "lower the load to what the client can sustain, or add Locust workers"
        )
    names = {c.name for c in failed}
    if names & {"ttft_p50_ms", "ttft_p99_ms"}:
        recs.append(
            "TTFT over SLA: cap concurrency at the highest step that passed, raise "
            "router.local_prefill_max_tokens so short prompts skip the transfer, or use a KV "
            "codec (fp8/int8) so transfer demand stays under 70 % of the measured link"
        )
    if names & _LATENCY:
        recs += load_caps(failed, steps)
    if "tpot_p99_ms" in names:
        recs.append("TPOT over SLA: lower decode.max_batch or add decode instances")
    if names & {"transfer_p50_ms", "transfer_p99_ms", "transfer_success_min"}:
        recs.append(
            "KV transfer too slow or failing: choose a codec that brings link demand under 70 % "
            "of available bandwidth (pdx measure-kv --link-gbps), check the link with "
            "pdx probe-link, or raise kv_transfer_timeout_ms if transfers finish just late"
        )
        recs += kv_demand(steps, link_gbps)
    if "retry_rate_max" in names:
        recs.append("retries above budget: the link drops or stalls; probe it for loss bursts")
    if "degrade_rate_max" in names:
        recs.append(
            "degradations above limit: transfers fail past their retry budget or the breaker "
            "opens (router.degrade_p99_ms); fix the link or raise the breaker thresholds"
        )
    if "error_rate_max" in names:
        recs.append("failed requests: see each step's error causes; 429s mean add decode capacity")
    if "eviction_rate_max" in names:
        recs.append("KV evicted before use: raise kv.store_budget_bytes or kv_ttl_seconds")
    return recs
