"""Per-step statistics from the exact per-request records the load generator writes.

Locust's own CSV rounds response times and mixes failures into latency; pdx judges from the
JSONL records instead (failed requests counted separately, never in latency percentiles).
Percentiles are numpy's linear interpolation (as ``vllm bench serve``).
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from pdx.accept.load.metrics import split_key

FORMULAS: dict[str, str] = {
    "margin": "threshold − measured for a maximum, measured − threshold for a minimum "
    "(positive = room to spare)",
    "percentiles": "numpy linear interpolation over exact per-request values of ok requests",
    "ttft_ms": "time of the first SSE event carrying content − intended send time",
    "second_token_ms": "TTFT + the first gap between content-carrying SSE events (requests "
    "with at least two content events): when the second token reached the client",
    "timings_ms": "the servers' own per-request figures in `pdx.timings_ms` (prefill compute, "
    "local prefill on decode, KV store put, decode's wait for the KV, its first decode step)",
    "tpot_ms": "(E2E − TTFT) / (output tokens − 1), output tokens from the server's usage",
    "itl_ms": "gap between consecutive content-carrying SSE events (every gap of every request)",
    "e2e_ms": "time `data: [DONE]` arrived − intended send time",
    "queue_ms": "actual send time − intended send time (open loop client-side wait)",
    "transfer_ms": "KV transfer time the gateway reports per request (`pdx.transfer_ms`)",
    "error_rate": "failed requests / all requests (failures excluded from latency statistics)",
    "retry_rate": "KV transfer retries / KV transfers attempted",
    "degrade_rate": "requests degraded to local prefill or shed / all requests",
    "transfer_success": "KV transfers that succeeded / KV transfers attempted",
    "eviction_rate": "KV objects evicted before release / KV objects created",
    "achieved_rps": "requests finished (ok + failed) / measured step duration",
    "achieved_concurrency": "Σ E2E of requests / step duration (mean requests in flight)",
    "load_fraction": "achieved_concurrency / users (closed loop) or achieved_rps / target rate",
    "goodput_rps": "requests meeting every latency criterion / step duration",
    "output_tok_s": "Σ output tokens of ok requests / step duration",
    "recovery_s": "link restored → start of the first 1 s window (by intended send time) with no "
    "failed or degraded request and TTFT p50 ≤ 1.5 × the median pre-fault 1 s TTFT p50",
    "requests": "records of answered, failed and client-aborted requests (not those still "
    "waiting when the load stopped: `unfinished`)",
    "aborted": "requests the client cancelled after the first token (load.abort_fraction); "
    "neither ok nor failed",
    "interval": "[low, high] = one-sided lower and upper bounds at `confidence` (together a "
    "two-sided 2c−1 interval); pass = the whole interval clears the threshold, fail = it lies "
    "wholly beyond it, else indeterminate",
    "quantile bounds": "order statistics: the u-th smallest of n values bounds the q-quantile "
    "from above when P(Binomial(n, q) ≤ u−1) ≥ c (u smallest such); from below the l-th when "
    "P(Binomial(n, q) ≥ l) ≥ c (l largest); a p99 needs n ≥ 299 for an upper bound at c = 0.95",
    "rate bounds": "Clopper–Pearson: low = Beta⁻¹(1−c; k, n−k+1), high = Beta⁻¹(c; k+1, n−k); "
    "retries per transfer: Garwood low = χ²⁻¹(1−c; 2k)/2n, high = χ²⁻¹(c; 2k+2)/2n",
    "threshold 0": "none allowed: any observed fails; none observed bounds the rate to "
    "1 − (1−c)^(1/n) and passes only when that is ≤ judgement.zero_rate_bound (n ≥ 299 for 1 % "
    "at 95 %), else indeterminate; replays that errored count as mismatches for the bound",
    "not_measured": "no sample at all (no KV transfer, KV object, disaggregated request, replay "
    "or gate record): undecided, so the run is INCONCLUSIVE unless the criterion is set to null",
    "requests_needed": "smallest sample that decides an indeterminate criterion if the observed "
    "rate (or share of values under the threshold) stayed the same",
    "silent_fallback_rate": "ok requests labelled disaggregated (more than one token) whose "
    "decode read 0 KV bytes or prefilled the prompt itself (`pdx.kv_bytes`, "
    "`pdx.timings_ms.local_prefill`, both decode's own figures) / those requests",
    "output_mismatch_rate": "replayed greedy requests (shipped KV, prompt and tokens kept) whose "
    "token ids on `pdx_route: local` differ / requests replayed",
    "kv_stranded_max_s": "max over KV objects stored in the step of (deleted — or still held "
    "when the step was judged — minus the end of its request: decode's record of the Generate "
    "call, else the client's stream end, else the time it was stored); from the store's audit log",
    "kv_stranded_byte_s": "Σ over the step's KV objects of bytes × seconds held after request end",
    "overdue_rate": "requests whose client waited longer than judgement.request_deadline_s + "
    "2 × RTT p99 (answered late or never) / requests judged (those cut off by the end of the "
    "load before that limit are not judged)",
    "idle_ttft_ratio": "idle-gap steps: TTFT p99 of the requests sent in the first "
    "judgement.idle_burst_s after the gap (from the first request sent) / TTFT p99 of those "
    "sent from 2 × idle_burst_s on, each side bounded by its own order statistics",
}

# The same latency quantity under the names other tools give it (their names collide).
METRIC_NAMES: dict[str, dict[str, str]] = {
    "ttft_ms": {
        "vllm bench serve": "ttft",
        "AIPerf": "time_to_first_token",
        "guidellm": "time_to_first_token_ms",
        "MLPerf": "TTFT (first token latency)",
    },
    "tpot_ms": {
        "vllm bench serve": "tpot (excl. 1st token)",
        "AIPerf": "inter_token_latency (AIPerf's ITL is this TPOT)",
        "guidellm": "inter_token_latency_ms (its time_per_output_token_ms counts the first "
        "token: (last token − request start) / output tokens)",
        "MLPerf": "TPOT (time per output token)",
    },
    "itl_ms": {
        "vllm bench serve": "itl (every gap between streamed chunks)",
        "AIPerf": "inter_chunk_latency",
        "guidellm": "— (its ITL is a per-request mean, pdx's TPOT)",
        "MLPerf": "—",
    },
    "e2e_ms": {
        "vllm bench serve": "e2el",
        "AIPerf": "request_latency",
        "guidellm": "request_latency",
        "MLPerf": "latency (query latency)",
    },
    "queue_ms": {"vllm bench serve": "—", "AIPerf": "—", "guidellm": "—", "MLPerf": "—"},
    "transfer_ms": {"vllm bench serve": "—", "AIPerf": "—", "guidellm": "—", "MLPerf": "—"},
}


def read_records(directory: Path) -> list[dict[str, Any]]:
    """All JSONL request records under ``directory`` (one file per Locust process)."""
    rows: list[dict[str, Any]] = []
    for f in sorted(directory.glob("requests-*.jsonl")):
        for line in f.read_text().splitlines():
            if line.strip():
                rows.append(json.loads(line))
    rows.sort(key=lambda r: r["t_intended_s"])
    return rows


def pct(values: list[float], q: float) -> float | None:
    """The q-th percentile (0–100), or None when there are no values."""
    return float(np.percentile(np.asarray(values, dtype=float), q)) if values else None


def distribution(values: list[float]) -> dict[str, float | None]:
    """count, mean, p50, p90, p99, max."""
    return {
        "count": float(len(values)),
        "mean": float(np.mean(values)) if values else None,
        "p50": pct(values, 50),
        "p90": pct(values, 90),
        "p99": pct(values, 99),
        "max": float(max(values)) if values else None,
    }


def _transfer_counts(all_rows: list[dict[str, Any]]) -> dict[str, Any]:
    pdx_objs = [r["pdx"] for r in all_rows if isinstance(r.get("pdx"), dict)]
    routes = Counter(str(p.get("route", "unknown")) for p in pdx_objs)
    degraded = [p for p in pdx_objs if p.get("degraded")]
    reasons = Counter(
        str(p.get("degrade_reason") or p.get("reason") or "unspecified") for p in degraded
    )
    transfer_ms = [float(p["transfer_ms"]) for p in pdx_objs if p.get("transfer_ms") is not None]
    transfer_ms = [t for t in transfer_ms if t > 0]
    retries = sum(int(p.get("retries") or 0) for p in pdx_objs)
    # each transfer's own rate: its KV bytes over its transfer time (what KV got while it moved)
    rates = [
        int(p["kv_bytes"]) * 8 / float(p["transfer_ms"]) / 1e6
        for p in pdx_objs
        if p.get("kv_bytes") and p.get("transfer_ms") and float(p["transfer_ms"]) > 0
    ]
    outcomes = Counter(str(p["transfer_outcome"]) for p in pdx_objs if p.get("transfer_outcome"))
    attempted = sum(outcomes.values())
    succeeded = outcomes.get("ok", 0)
    return {
        "routes": dict(routes),
        "degraded": len(degraded),
        "degrade_reasons": dict(reasons),
        "retries": retries,
        "transfers_attempted": attempted,
        "transfers_succeeded": succeeded,
        "transfer_outcomes": dict(outcomes),
        "kv_created": sum(1 for p in pdx_objs if p.get("kv_id")),
        "transfer_ms": transfer_ms,
        "kv_bytes": sum(int(p.get("kv_bytes") or 0) for p in pdx_objs),
        "kv_transfer_gbps_p50": round(statistics.median(rates), 4) if rates else None,
        "with_pdx_object": len(pdx_objs),
    }


def samples(rows: list[dict[str, Any]]) -> dict[str, list[float]]:
    """The exact per-request values behind the quantile criteria (ok requests only)."""
    ok = [r for r in rows if r.get("ok")]
    xfer = [r["pdx"].get("transfer_ms") for r in rows if isinstance(r.get("pdx"), dict)]
    return {
        "ttft_ms": [r["ttft_ms"] for r in ok if r.get("ttft_ms") is not None],
        "tpot_ms": [r["tpot_ms"] for r in ok if r.get("tpot_ms") is not None],
        "transfer_ms": [float(t) for t in xfer if t is not None and float(t) > 0],
        "second_token_ms": second_token_ms(ok),
    }


def second_token_ms(ok: list[dict[str, Any]]) -> list[float]:
    """When each request's second token arrived: TTFT + its first inter-token gap."""
    return [
        float(r["ttft_ms"]) + float(r["itl_ms"][0])
        for r in ok
        if r.get("ttft_ms") is not None and r.get("itl_ms")
    ]


TIMING_KEYS = ("prefill", "local_prefill", "kv_store", "decode_kv_ready", "first_decode_step")


def server_timings(rows: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Distributions of the servers' per-request figures (``pdx.timings_ms``), positive only."""
    out: dict[str, dict[str, float | None]] = {}
    for key in TIMING_KEYS:
        values = [
            float(t[key])
            for r in rows
            if r.get("ok") and isinstance(t := (r.get("pdx") or {}).get("timings_ms"), dict)
            and isinstance(t.get(key), int | float) and t[key] > 0
        ]  # fmt: skip
        out[key] = distribution(values)
    return out


def summarize(rows: list[dict[str, Any]], elapsed_s: float) -> dict[str, Any]:
    """Latency distributions, counts and rates of one step's records.

    Requests still waiting when the load stopped (``unfinished``) are counted apart and are not
    requests here; client aborts are neither ok nor failed.
    """
    unfinished = [r for r in rows if r.get("unfinished")]
    rows = [r for r in rows if not r.get("unfinished")]
    aborted = [r for r in rows if r.get("aborted")]
    ok = [r for r in rows if r.get("ok")]
    failed = [r for r in rows if not r.get("ok") and not r.get("aborted")]
    elapsed_s = max(elapsed_s, 1e-9)
    xfer = _transfer_counts(rows)
    e2e_sum_s = sum((r["e2e_ms"] or 0.0) for r in ok) / 1e3
    errors = Counter(str(r.get("error"))[:120] for r in failed)
    return {
        "requests": len(rows),
        "ok": len(ok),
        "failed": len(failed),
        "aborted": len(aborted),
        "unfinished": len(unfinished),
        "errors": dict(errors.most_common(10)),
        "error_rate": len(failed) / len(rows) if rows else None,
        "ttft_ms": distribution([r["ttft_ms"] for r in ok if r.get("ttft_ms") is not None]),
        "tpot_ms": distribution([r["tpot_ms"] for r in ok if r.get("tpot_ms") is not None]),
        "second_token_ms": distribution(second_token_ms(ok)),
        "timings_ms": server_timings(rows),
        "itl_ms": distribution([g for r in ok for g in r.get("itl_ms") or []]),
        "e2e_ms": distribution([r["e2e_ms"] for r in ok if r.get("e2e_ms") is not None]),
        "queue_ms": distribution([r.get("queue_ms") or 0.0 for r in rows]),
        "transfer_ms": distribution(xfer.pop("transfer_ms")),
        "achieved_rps": len(rows) / elapsed_s,
        "achieved_concurrency": e2e_sum_s / elapsed_s,
        "output_tok_s": sum(r.get("output_tokens") or 0 for r in ok) / elapsed_s,
        "usage_from_server": sum(1 for r in ok if r.get("usage_source") == "server"),
        **xfer,
    }


NIXL_BYTES = "vllm:nixl_bytes_transferred_sum"


def trace_summary(rows: list[dict[str, Any]], mdelta: dict[str, float]) -> dict[str, Any] | None:
    """A trace step: the trace's ideal prefix hit ratio beside what the engine reported, the
    KV bytes that crossed per request, and how late each request left (arrival fidelity).

    ``engine_hit_ratio`` is vLLM's own ``prefix_cache_hits / prefix_cache_queries`` over the
    step, per instance (``pdx_instance``); ``reported_cached_ratio`` the cached prompt tokens
    the responses reported (``usage.prompt_tokens_details.cached_tokens``, else pdx's own
    ``pdx.cached_tokens``: decode's prefix-cache hit) over their prompts.
    """
    traced = [r for r in rows if r.get("trace_line") is not None and not r.get("unfinished")]
    if not traced:
        return None
    prompt = sum(int(r["input_len"]) for r in traced)
    ideal = sum(int(r.get("ideal_cached_tokens") or 0) for r in traced)
    told = [r for r in traced if r.get("cached_tokens") is not None]
    shipped = [int((r.get("pdx") or {}).get("kv_bytes") or 0) for r in traced
               if (r.get("pdx") or {}).get("route") == "disaggregated"]  # fmt: skip
    # vLLM: what decode's NIXL pulls really moved (only the blocks decode lacked), not the
    # whole prompt's KV the prefill offered (the pdx object's kv_bytes)
    pulled = [v for k, v in mdelta.items() if split_key(k)[0] == NIXL_BYTES]
    total = sum(pulled) if pulled else float(sum(shipped))
    return {
        "requests": len(traced),
        "sessions": len({r.get("session") for r in traced}),
        "ideal_hit_ratio": ideal / prompt if prompt else None,
        "reported_cached_ratio": (
            sum(int(r["cached_tokens"]) for r in told) / sum(int(r["input_len"]) for r in told)
            if told
            else None
        ),
        "reported_requests": len(told),
        "engine_hit_ratio": _engine_hit_ratios(mdelta),
        "kv_bytes_total": total,
        "offloaded_share": len(shipped) / len(traced),
        "policy": _policy(traced),
        "offloaded_by_window": offload_windows(traced),
        "kv_bytes_per_request": total / len(shipped) if shipped else None,
        "kv_bytes_from": NIXL_BYTES if pulled else "the responses' pdx.kv_bytes",
        "send_lag_ms": distribution([float(r.get("queue_ms") or 0.0) for r in traced]),
    }


#: The window of :func:`offload_windows`, seconds of the step's intended send times.
OFFLOAD_WINDOW_S = 5.0


def offload_windows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per ``OFFLOAD_WINDOW_S`` of intended send time from the step's first request: the
    requests and the share of them prefilled remotely (a policy that follows the link shows
    its turn here)."""
    times = [(float(r["t_intended_s"]), r) for r in rows if r.get("t_intended_s") is not None]
    if not times:
        return []
    t0 = min(t for t, _ in times)
    bins: dict[int, list[int]] = {}
    for t, r in times:
        remote = (r.get("pdx") or {}).get("route") == "disaggregated"
        counts = bins.setdefault(int((t - t0) // OFFLOAD_WINDOW_S), [0, 0])
        counts[0] += 1
        counts[1] += remote
    return [{"start_s": i * OFFLOAD_WINDOW_S, "requests": n, "offloaded_share": k / n}
            for i, (n, k) in sorted(bins.items())]  # fmt: skip


def _policy(rows: list[dict[str, Any]]) -> str | None:
    """The offload policy the gateway reported (``pdx.offload.policy``), when it did."""
    seen = {
        str(p) for r in rows if (p := ((r.get("pdx") or {}).get("offload") or {}).get("policy"))
    }
    return "/".join(sorted(seen)) or None


def _engine_hit_ratios(mdelta: dict[str, float]) -> dict[str, float]:
    """vLLM's prefix cache hits / queries (tokens) over the step, per engine instance."""
    hits: dict[str, float] = {}
    queries: dict[str, float] = {}
    for key, value in mdelta.items():
        name, labels = split_key(key)
        instance = labels.get("pdx_instance")
        if instance is None:
            continue
        if name == "vllm:prefix_cache_hits_total":
            hits[instance] = hits.get(instance, 0.0) + value
        elif name == "vllm:prefix_cache_queries_total":
            queries[instance] = queries.get(instance, 0.0) + value
    return {k: round(hits.get(k, 0.0) / q, 6) for k, q in sorted(queries.items()) if q > 0}


def timeline(rows: list[dict[str, Any]], t0_s: float, bin_s: float = 1.0) -> list[dict[str, Any]]:
    """Per-``bin_s`` series from the step start: finished, failed, degraded, TTFT p50 and p99."""
    if not rows:
        return []
    last = max(r["t_intended_s"] - t0_s for r in rows)
    bins: list[dict[str, Any]] = []
    for i in range(int(last // bin_s) + 1):
        lo, hi = t0_s + i * bin_s, t0_s + (i + 1) * bin_s
        in_bin = [r for r in rows if lo <= r["t_intended_s"] < hi]
        ttft = [r["ttft_ms"] for r in in_bin if r.get("ok") and r.get("ttft_ms") is not None]
        bins.append(
            {
                "t_s": i * bin_s,
                "sent": len(in_bin),
                "failed": sum(1 for r in in_bin if not r.get("ok")),
                "degraded": sum(1 for r in in_bin if (r.get("pdx") or {}).get("degraded")),
                "retries": sum(int((r.get("pdx") or {}).get("retries") or 0) for r in in_bin),
                "ttft_p50_ms": pct(ttft, 50),
                "ttft_p99_ms": pct(ttft, 99),
            }
        )
    return bins


def recovery_s(bins: list[dict[str, Any]], down_at_s: float, down_for_s: float) -> float | None:
    """Seconds from link restore until requests take the normal path again at pre-fault TTFT.

    None when there is no pre-fault baseline or the service never recovered within the step.
    """
    before = [b["ttft_p50_ms"] for b in bins if b["t_s"] + 1 <= down_at_s and b["ttft_p50_ms"]]
    if not before:
        return None
    baseline = float(np.median(before))
    up_at = down_at_s + down_for_s
    for b in bins:
        if b["t_s"] < up_at or b["ttft_p50_ms"] is None:
            continue
        if b["failed"] == 0 and b["degraded"] == 0 and b["ttft_p50_ms"] <= 1.5 * baseline:
            return max(0.0, b["t_s"] - up_at)
    return None


def derive_rates(summary: dict[str, Any], metrics_delta: dict[str, float]) -> None:
    """Add transfer_success, retry_rate, degrade_rate and eviction_rate (None when undefined).

    Per-request ``pdx`` objects are the source; ``pdx_kv_evicted_total`` comes from /metrics.
    """
    attempted = summary.get("transfers_attempted", 0)
    summary["transfer_success"] = (
        summary.get("transfers_succeeded", 0) / attempted if attempted else None
    )
    summary["retry_rate"] = summary.get("retries", 0) / attempted if attempted else None
    n = summary.get("requests", 0)
    summary["degrade_rate"] = summary.get("degraded", 0) / n if n else None
    evicted = sum(v for k, v in metrics_delta.items() if k.startswith("pdx_kv_evicted_total"))
    created = summary.get("kv_created", 0)
    has_counter = any(k.startswith("pdx_kv_evicted_total") for k in metrics_delta)
    summary["kv_evicted"] = int(evicted) if has_counter else None
    summary["eviction_rate"] = evicted / created if created and has_counter else None
    for rate, k, n in (
        ("silent_fallback_rate", "silent_fallback", "labelled_disaggregated"),
        ("output_mismatch_rate", "replay_mismatches", "replayed"),
        ("overdue_rate", "overdue", "overdue_judged"),
    ):
        if summary.get(n):
            summary[rate] = summary[k] / summary[n]
        elif n in summary:
            summary[rate] = None  # nothing to count: the gate is not judged on this step


def span_s(rows: list[dict[str, Any]]) -> float:
    """First intended send to last stream end, in seconds."""
    if not rows:
        return 0.0
    start = min(r["t_intended_s"] for r in rows)
    end = max(
        r["t_intended_s"] + (r.get("e2e_ms") or r.get("elapsed_ms") or r.get("queue_ms") or 0) / 1e3
        for r in rows
    )
    return max(0.0, end - start)
