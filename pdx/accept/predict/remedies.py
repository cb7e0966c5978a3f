"""What would change the run's outcome, as the report's ``what_to_change`` lines: per failed
criterion and invalid step, the setting or fix that would change it, with the measured figures
behind it (load caps, KV link demand); per undecided step, the sample each criterion needs and
how long the step would have to run to produce it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from pdx.accept.steps import Step

if TYPE_CHECKING:
    from pdx.accept.judge.criteria import CriterionResult, ValidityResult

_LATENCY = {"ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms"}


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
    if names & {"tpot_p50_ms", "tpot_p99_ms"}:
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
            "opens (router.degrade_p99_ms, else router.degrade_share_of_ttft x the TTFT budget); "
            "fix the link or raise the breaker thresholds"
        )
    if "error_rate_max" in names:
        recs.append("failed requests: see each step's error causes; 429s mean add decode capacity")
    if "eviction_rate_max" in names:
        recs.append("KV evicted before use: raise kv.store_budget_bytes or kv_ttl_seconds")
    recs += _gate_recommendations(names)
    return recs


def _gate_recommendations(names: set[str]) -> list[str]:
    recs = []
    if "silent_fallback_max" in names:
        recs.append(
            "requests labelled disaggregated were prefilled on decode (no KV read, or a local "
            "prefill): the KV did not arrive or could not be loaded; fix that, and have decode "
            "report it as degraded (decode.kv_load_failure_policy: degrade) instead of hiding it"
        )
    if "output_mismatch_max" in names:
        recs.append(
            "greedy tokens from shipped KV differ from a local prefill: the KV codec or its "
            "transfer changes the model's output; use a lossless codec (raw, zstd) or measure "
            "the codec's token agreement with pdx measure-kv before choosing it"
        )
    if "kv_stranded_max_s" in names:
        recs.append(
            "KV objects stayed held after their request ended: decode must release KV it will "
            "not use (aborted, failed or degraded requests) and the store must expire it; "
            "lower kv.kv_ttl_seconds to bound what a crash can strand"
        )
    if "overdue_requests_max" in names:
        recs.append(
            "requests waited past their deadline: every wait needs a deadline shorter than the "
            "request's own (kv.kv_transfer_timeout_ms, gateway.request_timeout_s) so a failure "
            "ends in an error or a degraded answer, not in a hang"
        )
    if "idle_ttft_ratio_max" in names:
        recs.append(
            "the first burst after idle is much slower than steady load: keep KV connections "
            "warm (keepalive) or re-establish them before use"
        )
    return recs


_RATE_KEYS = {
    "requests": "requests",
    "transfers": "transfers_attempted",
    "disaggregated requests": "labelled_disaggregated",
    "KV objects": "kv_objects",
}


def undecided_steps(
    results: list[CriterionResult], steps: list[tuple[Step, dict[str, Any]]]
) -> list[str]:
    """For each step with an indeterminate criterion: how long it would have to run to decide.

    The sample each criterion needs is turned into time at the rate this step produced it.
    """
    lines = []
    summaries = {step.id: (step, summary) for step, summary in steps}
    results = [c for c in results if not c.advisory]  # what does not decide needs no sample
    for step_id in dict.fromkeys(c.step for c in results if c.result == "indeterminate"):
        step, summary = summaries.get(step_id, (None, {}))
        elapsed = float(summary.get("elapsed_s") or 0.0)
        needs, durations = [], []
        for c in results:
            if c.step != step_id or c.result != "indeterminate":
                continue
            if c.requests_needed is None:
                needs.append(f"{c.name}: no sample size decides it at the observed value")
                continue
            needs.append(f"{c.name}: {c.requests_needed:,} {c.sample_unit}")
            if c.sample_unit == "replayed requests":
                needs[-1] += f" (set judgement.replay_requests={c.requests_needed})"
                continue
            produced = float(summary.get(_RATE_KEYS.get(c.sample_unit, "requests")) or 0)
            if produced > 0 and elapsed > 0:
                durations.append(c.requests_needed / (produced / elapsed))
        how_long = ""
        if durations and step is not None:
            need_s = math.ceil(max(durations))
            how_long = (
                f"run it for at least {need_s} s (matrix.duration_s={need_s}; "
                f"it ran {elapsed:.0f} s) at the rate it reached"
            )
        lines.append(f"{step_id} undecided: {how_long + '; ' if how_long else ''}"
                     + "; ".join(needs))  # fmt: skip
    return lines
