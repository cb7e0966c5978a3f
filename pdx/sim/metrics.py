"""Statistics of one simulated mode: latency percentiles, goodput, utilisation, queues."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdx.sim.config import SimConfig
from pdx.sim.engine import EngineTrace

PERCENTILE_METHOD = "nearest-rank: sorted(x)[min(n-1, floor(n*p))]"


def nearest_rank(values: np.ndarray, p: float) -> float:
    """``sorted(values)[floor(n*p)]`` with the index clamped to the last element (NaNs, the
    requests a figure does not apply to, are left out)."""
    values = values[~np.isnan(values)]
    n = len(values)
    if n == 0:
        return math.nan
    idx = min(n - 1, math.floor(n * p))
    return float(np.partition(values, idx)[idx])


def weighted_nearest_rank(values: np.ndarray, counts: np.ndarray, p: float) -> float:
    """Nearest-rank percentile of a sample where ``values[i]`` occurs ``counts[i]`` times."""
    total = int(counts.sum())
    if total == 0:
        return math.nan
    order = np.argsort(values, kind="stable")
    cum = np.cumsum(counts[order])
    idx = min(total - 1, math.floor(total * p))
    return float(values[order][int(np.searchsorted(cum, idx, side="right"))])


def max_in_queue(enter_s: np.ndarray, leave_s: np.ndarray) -> int:
    """Most items waiting at once, given when each entered and left (leaving wins ties)."""
    if len(enter_s) == 0:
        return 0
    times = np.concatenate([enter_s, leave_s])
    deltas = np.concatenate([np.ones(len(enter_s)), -np.ones(len(leave_s))])
    order = np.lexsort((deltas, times))
    return int(np.cumsum(deltas[order]).max())


@dataclass
class ModeResult:
    """Everything reported for one serving mode. Times in seconds."""

    mode: str
    requests: int
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p95_s: float
    ttft_p99_s: float
    ttft_mean_s: float
    itl_mean_s: float
    itl_p50_s: float
    itl_p95_s: float
    itl_p99_s: float
    tpot_mean_s: float
    tpot_p50_s: float
    tpot_p99_s: float
    e2e_p50_s: float
    e2e_p99_s: float
    goodput_fraction: float
    goodput_req_per_s: float
    throughput_tokens_per_s: float
    makespan_s: float
    prefill_utilisation: float
    decode_utilisation: float
    link_utilisation: float | None
    link_bytes: float | None
    link_mean_gbps: float | None
    transfer_p50_s: float | None
    transfer_p99_s: float | None
    link_time_p50_s: float | None
    link_time_p99_s: float | None
    second_token_p50_s: float
    second_token_p99_s: float
    prefill_wait_mean_s: float
    prefill_queue_mean: float
    prefill_queue_max: int
    link_queue_mean: float | None
    link_queue_max: int | None
    decode_queue_mean: float
    decode_queue_max: int
    decode_batch_mean: float
    decode_steps: int
    local_prefill_requests: int
    events: int
    # a trace with hash ids and prefix_cache_blocks: the prefix its prefill found cached
    prefix_hit_ratio: float | None = None
    kv_shipped_bytes: float | None = None  # raw KV of the shipped (uncached) tokens
    kv_shipped_bytes_per_request: float | None = None  # over the requests that shipped any


def _latency(tr: EngineTrace, cfg: SimConfig) -> dict[str, np.ndarray]:
    arrival = np.asarray(tr.arrival_s)
    ready = np.asarray(tr.ready_s)
    finish = np.asarray(tr.finish_s)
    out = np.asarray(tr.output_tokens, dtype=float)
    if cfg.first_token_from == "prefill":  # as vLLM and pdx accept: (E2E - TTFT) / (n - 1)
        first = np.asarray(tr.first_token_s)
        with np.errstate(divide="ignore", invalid="ignore"):
            tpot = np.where(out > 1, (finish - first) / (out - 1), np.nan)
    else:
        first, tpot = ready, (finish - ready) / out
    return {
        "arrival": arrival,
        "ttft": first - arrival,
        "tpot": tpot,
        "e2e": finish - arrival,
        "second": np.asarray(tr.second_token_s) - arrival,
        "finish": finish,
        "out": out,
    }


def _itl(tr: EngineTrace) -> dict[str, Any]:
    d = np.asarray(tr.step_s)
    k = np.asarray(tr.step_count, dtype=np.int64)
    steps = int(k.sum())
    batch = np.asarray(tr.step_batch, dtype=float)
    return {
        "itl_mean_s": float((d * k).sum() / steps) if steps else math.nan,
        "itl_p50_s": weighted_nearest_rank(d, k, 0.50),
        "itl_p95_s": weighted_nearest_rank(d, k, 0.95),
        "itl_p99_s": weighted_nearest_rank(d, k, 0.99),
        "decode_batch_mean": float((batch * k).sum() / steps) if steps else math.nan,
        "decode_steps": steps,
    }


def _link(tr: EngineTrace, makespan: float) -> dict[str, Any]:
    shipped = ~np.asarray(tr.local_prefill, dtype=bool) & ~np.isnan(tr.transfer_start_s)
    if tr.mode == "colocated" or not shipped.any():
        keys = ("link_utilisation", "link_bytes", "link_mean_gbps", "transfer_p50_s")
        more = ("link_time_p50_s", "link_time_p99_s", "link_queue_mean", "link_queue_max")
        return dict.fromkeys((*keys, "transfer_p99_s", *more))
    pf_end = np.asarray(tr.prefill_end_s)[shipped]
    xfer_start = np.asarray(tr.transfer_start_s)[shipped]
    transfer = np.asarray(tr.ready_s)[shipped] - pf_end
    on_link = np.asarray(tr.link_time_s)[shipped]
    return {
        "link_time_p50_s": nearest_rank(on_link, 0.50),
        "link_time_p99_s": nearest_rank(on_link, 0.99),
        "link_utilisation": tr.link_busy_s / makespan,
        "link_bytes": tr.link_bytes,
        "link_mean_gbps": tr.link_bytes * 8 / 1e9 / makespan,
        "transfer_p50_s": nearest_rank(transfer, 0.50),
        "transfer_p99_s": nearest_rank(transfer, 0.99),
        "link_queue_mean": float((xfer_start - pf_end).sum() / makespan),
        "link_queue_max": max_in_queue(pf_end, xfer_start),
    }


def summarize(tr: EngineTrace, cfg: SimConfig) -> ModeResult:
    """Reduce a raw engine trace to the reported figures."""
    lat = _latency(tr, cfg)
    arrival, ttft, tpot = lat["arrival"], lat["ttft"], lat["tpot"]
    makespan = float(lat["finish"].max() - arrival.min()) or math.inf
    tpot_ok = np.isnan(tpot) | (tpot <= cfg.slo_tpot_s)  # one token: no TPOT to miss
    good = int(((ttft <= cfg.slo_ttft_s) & tpot_ok).sum())
    pf_start = np.asarray(tr.prefill_start_s)
    ready, join = np.asarray(tr.ready_s), np.asarray(tr.join_s)
    return ModeResult(
        mode=tr.mode,
        requests=len(arrival),
        ttft_p50_s=nearest_rank(ttft, 0.50),
        ttft_p90_s=nearest_rank(ttft, 0.90),
        ttft_p95_s=nearest_rank(ttft, 0.95),
        ttft_p99_s=nearest_rank(ttft, 0.99),
        ttft_mean_s=float(ttft.mean()),
        tpot_mean_s=float(np.nanmean(tpot)) if (~np.isnan(tpot)).any() else math.nan,
        second_token_p50_s=nearest_rank(lat["second"], 0.50),
        second_token_p99_s=nearest_rank(lat["second"], 0.99),
        tpot_p50_s=nearest_rank(tpot, 0.50),
        tpot_p99_s=nearest_rank(tpot, 0.99),
        e2e_p50_s=nearest_rank(lat["e2e"], 0.50),
        e2e_p99_s=nearest_rank(lat["e2e"], 0.99),
        goodput_fraction=good / len(arrival),
        goodput_req_per_s=good / makespan,
        throughput_tokens_per_s=float(lat["out"].sum() / makespan),
        makespan_s=makespan,
        prefill_utilisation=tr.prefill_busy_s / (tr.prefill_servers * makespan),
        decode_utilisation=tr.decode_busy_s / (tr.decode_servers * makespan),
        prefill_wait_mean_s=float((pf_start - arrival).mean()),
        prefill_queue_mean=float((pf_start - arrival).sum() / makespan),
        prefill_queue_max=max_in_queue(arrival, pf_start),
        decode_queue_mean=float(np.clip(join - ready, 0, None).sum() / makespan),
        decode_queue_max=max_in_queue(ready, np.maximum(join, ready)),
        local_prefill_requests=int(sum(tr.local_prefill)),
        events=tr.events,
        **_itl(tr),
        **_link(tr, makespan),
        **_prefix(tr, cfg),
    )


def _prefix(tr: EngineTrace, cfg: SimConfig) -> dict[str, Any]:
    """What the prefix caches saved (the hit ratio) and what crossed the link instead."""
    prompt = float(sum(tr.prompt_tokens))
    out: dict[str, Any] = {
        "prefix_hit_ratio": sum(tr.cached_tokens) / prompt if cfg.prefix_cache_blocks else None
    }
    if tr.mode == "disaggregated":
        shipped = [s for s, local in zip(tr.shipped_tokens, tr.local_prefill, strict=True)
                   if not local and s > 0]  # fmt: skip
        total = sum(shipped) * cfg.kv_bytes_per_token
        out["kv_shipped_bytes"] = total
        out["kv_shipped_bytes_per_request"] = total / len(shipped) if shipped else 0.0
    return out
