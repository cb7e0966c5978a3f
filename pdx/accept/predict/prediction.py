"""The simulator beside every step: what ``pdx simulate`` predicts, what the step measured.

For each step the simulator runs with the deployed model (pre-flight measure-kv), the compute
the servers reported over the whole run (:func:`pdx.sim.calibrate.compute_fits`: prefill time
per token, decode step, KV store put and decode's reassembly), the link the step's own probe
measured under its condition (RTT p50, goodput with the deploy's stripes, downstream loss) and
the step's own requests (each request's intended send time, prompt and output length,
replayed; the router's local-prefill threshold decides which ship). It models pdx's flow:
prefill streams the first token across the link, stores the KV, decode pulls it (Stat + Get
when striped: two round trips) and makes the other tokens.

A figure is **beyond** the prediction when the measured figure's whole confidence interval
(order statistics at the playbook's confidence) lies outside ±``error_max_pct`` of the
predicted value, **within** when the whole interval lies inside it, **undecided** otherwise
(too few requests to tell); a step with any figure beyond is *unexplained*.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from pdx.accept.judge import confidence as ci
from pdx.accept.judge.stats import samples
from pdx.accept.playbook import Playbook

# predicted metric -> (per-request sample in pdx.accept.judge.stats.samples, quantile)
METRICS: dict[str, tuple[str, float]] = {
    "ttft_p50_ms": ("ttft_ms", 0.50),
    "ttft_p99_ms": ("ttft_ms", 0.99),
    "second_token_p50_ms": ("second_token_ms", 0.50),
    "tpot_p50_ms": ("tpot_ms", 0.50),
    "transfer_p50_ms": ("transfer_ms", 0.50),
}
# more figures the recommendations compare with criteria
EXTRA: dict[str, tuple[str, float]] = {"tpot_p99_ms": ("tpot_ms", 0.99)}
Judged = Literal["within", "beyond", "undecided", "not_compared"]


@dataclass(frozen=True)
class DeployFacts:
    """What the deploy config says about the pair the simulator must imitate."""

    prefill_instances: int
    decode_instances: int
    max_batch: int
    local_prefill_max_tokens: int
    kv_streams: int
    chunk_size_kb: int
    codec: str
    congestion_control: str
    engine: str = "pdx"
    # blocks of prefix cache per instance the engine keeps (its KV cache, or pdx decode's KV
    # budget, over block size × bytes per token), for trace steps
    prefix_cache_blocks: int | None = None
    # pdx's router.offload.policy as the simulator models it (length, uncached, break_even;
    # None: a length rule before vLLM's pull of what decode lacks)
    offload_policy: str | None = None


def deploy_facts(pb: Playbook, playbook_dir: Path) -> DeployFacts:
    """The deploy's pools, batch, router threshold and KV transport settings."""
    from pdx.accept.preflight.kv import deploy_config
    from pdx.serving.deploy_config import local_prefill_threshold

    cfg = deploy_config(pb.target, playbook_dir)
    blocks, policy = None, None
    if cfg.engine == "vllm" and cfg.vllm.kv_cache_bytes:
        blocks = _vllm_cache_blocks(pb, playbook_dir, cfg)
    elif cfg.engine == "pdx" and cfg.prefix_cache.enabled:
        blocks = _cache_blocks(pb, playbook_dir, cfg.prefix_cache.block_tokens,
                               cfg.decode.kv_budget_bytes)  # fmt: skip
        policy = cfg.router.offload.policy
    return DeployFacts(
        prefill_instances=max(1, cfg.prefill.count),
        decode_instances=cfg.decode.count,
        max_batch=cfg.decode.max_batch,
        local_prefill_max_tokens=local_prefill_threshold(cfg),
        kv_streams=cfg.kv.streams,
        chunk_size_kb=cfg.kv.chunk_size_kb,
        codec=cfg.kv.codec,
        congestion_control=cfg.kv.congestion_control,
        engine=cfg.engine,
        prefix_cache_blocks=blocks,
        offload_policy=policy,
    )


def _vllm_cache_blocks(pb: Playbook, playbook_dir: Path, cfg: Any) -> int | None:
    """Blocks of prefix cache one vLLM instance keeps: its KV cache over a block's bytes."""
    block = cfg.vllm.block_size or 16  # vLLM's default on CPU and GPU
    return _cache_blocks(pb, playbook_dir, block, cfg.vllm.kv_cache_bytes)


def _cache_blocks(pb: Playbook, playbook_dir: Path, block: int, budget: int) -> int | None:
    """Blocks of ``block`` tokens a cache of ``budget`` bytes holds (None: not sizable)."""
    from pdx.accept.preflight.kv import kv_bytes_at

    try:
        per_block = kv_bytes_at(pb, playbook_dir, [block])[block]
    except Exception:  # the model cannot be sized: no cache modelled
        return None
    return max(1, int(budget // max(1, per_block)))


def goodput_bps(link: dict[str, Any], streams: int) -> float | None:
    """Store → decode goodput (bits/s) with the run closest to ``streams`` stripes."""
    runs = [r for r in link.get("down_runs") or [] if r.get("gbps")]
    if runs:
        fit = [r for r in runs if int(r["streams"]) <= streams] or runs
        best = max(fit, key=lambda r: (int(r["streams"]), float(r["gbps"])))
        return float(best["gbps"]) * 1e9
    return float(link["down_gbps"]) * 1e9 if link.get("down_gbps") else None


def sim_fields(
    compute: dict[str, Any], model: dict[str, Any], link: dict[str, Any], facts: DeployFacts
) -> dict[str, Any] | None:
    """The simulator's configuration for one step (None when the link was not measured)."""
    bps = goodput_bps(link, facts.kv_streams)
    if not bps or link.get("rtt_p50_ms") is None:
        return None
    return {
        **{k: v for k, v in model.items() if k != "model_preset"},
        **compute,
        "decode_weight_reads": "per_step",
        "first_token_from": "prefill",
        "link_bytes_per_s": bps / 8,
        "link_rtt_s": float(link["rtt_p50_ms"]) / 1e3,
        "link_loss": min(0.5, float(link.get("loss_down_pct") or 0.0) / 100),
        "link_round_trips": 2.0 if facts.kv_streams > 1 else 1.0,
        "link_sharing": "fair",  # concurrent transfers are TCP flows sharing the link's rate
        # BBR's goodput already holds its losses; CUBIC's stalls are what the stall model adds
        "link_loss_recovery": "pipelined" if facts.congestion_control == "bbr" else "stall",
        "prefill_instances": facts.prefill_instances,
        "decode_instances": facts.decode_instances,
        "max_decode_batch": facts.max_batch,
        # the router prefills locally below its threshold; the simulator at or below its own
        "local_prefill_max_tokens": max(0, facts.local_prefill_max_tokens - 1),
        "prefix_cache_blocks": facts.prefix_cache_blocks,
        "offload_policy": facts.offload_policy,
        "modes": ["disaggregated"],
    }


def step_workload(records: list[dict[str, Any]], trace: Any = None, block_size: int = 0) -> Any:
    """The step's requests as a simulator trace: intended send times, prompt and output; for a
    replayed ``trace`` also each request's hash ids (by its trace line) and the (scaled)
    ``block_size`` they count in, so the simulator's prefix caches see the trace's reuse."""
    from pdx.sim.workload import Workload

    rows = [r for r in records if not r.get("unfinished") and r.get("input_len")]
    if not rows:
        return None
    t0 = min(float(r["t_intended_s"]) for r in rows)
    rows.sort(key=lambda r: float(r["t_intended_s"]))
    ids = None
    if trace is not None and trace.has_reuse:
        by_line = {req.line: req.hash_ids for req in trace.requests}
        ids = [by_line.get(int(r.get("trace_line") or 0), ()) for r in rows]
    return Workload(
        [float(r["t_intended_s"]) - t0 for r in rows],
        [int(r["input_len"]) for r in rows],
        [max(1, int(r.get("output_tokens") or r.get("output_len_requested") or 1)) for r in rows],
        "the step's requests",
        hash_ids=ids,
        block_size=block_size if ids else 0,
    )


def simulate_step(fields: dict[str, Any], workload: Any) -> dict[str, float | None]:
    """Predicted figures (ms) for the step, percentiles as pdx accept computes them.

    When the model is random (a prefill-time spread, loss, jitter) the step's requests are
    simulated again with other seeds until about 2,000 requests are pooled, so a predicted
    quantile is the model's, not one draw's.
    """
    from pdx.sim.config import SimConfig
    from pdx.sim.engine import run_mode

    cfg = SimConfig.model_validate(fields)
    random = cfg.prefill_time_sigma > 0 or cfg.link_loss > 0 or cfg.link_jitter_s > 0
    rounds = min(200, max(1, -(-2000 // len(workload)))) if random else 1
    pooled: dict[str, list[np.ndarray]] = {k: [] for k in ("ttft_ms", "second_token_ms",
                                                           "tpot_ms", "transfer_ms")}  # fmt: skip
    for k in range(rounds):
        seeded = cfg.model_copy(update={"workload": cfg.workload.model_copy(
            update={"seed": cfg.workload.seed + 10 * k})})  # fmt: skip
        tr = run_mode(seeded, workload, "disaggregated")
        arrival = np.asarray(tr.arrival_s)
        first, finish = np.asarray(tr.first_token_s), np.asarray(tr.finish_s)
        out = np.asarray(tr.output_tokens, dtype=float)
        pooled["ttft_ms"].append((first - arrival) * 1e3)
        pooled["second_token_ms"].append((np.asarray(tr.second_token_s) - arrival) * 1e3)
        pooled["tpot_ms"].append(
            np.where(out > 1, (finish - first) / np.maximum(out - 1, 1), np.nan) * 1e3
        )
        if cfg.first_token_from == "decode":  # vLLM's flow: the gateway times decode's call
            # (the KV handle handed over) → decode's first token, the pull and a step included
            pooled["transfer_ms"].append((first - np.asarray(tr.transfer_start_s)) * 1e3)
        else:
            pooled["transfer_ms"].append(np.asarray(tr.link_time_s) * 1e3)
    predicted: dict[str, float | None] = {}
    for metric, (sample, q) in {**METRICS, **EXTRA}.items():
        values = np.concatenate(pooled[sample])
        values = values[~np.isnan(values)]
        predicted[metric] = float(np.percentile(values, q * 100)) if len(values) else None
    return predicted


def judge(
    predicted: float | None, values: list[float], q: float, confidence: float, tol_pct: float
) -> dict[str, Any]:
    """One figure: predicted, measured, error in percent, the measured interval, the result."""
    measured = float(np.percentile(values, q * 100)) if values else None
    entry: dict[str, Any] = {
        "predicted": predicted,
        "measured": measured,
        "error_pct": None,
        "interval": None,
        "n": len(values),
        "result": "not_compared",
    }
    if predicted is None or measured is None or predicted <= 0:
        return entry
    entry["error_pct"] = (measured - predicted) / predicted * 100
    lo_ok, hi_ok = predicted * (1 - tol_pct / 100), predicted * (1 + tol_pct / 100)
    if confidence <= 0:
        entry["result"] = "within" if lo_ok <= measured <= hi_ok else "beyond"
        return entry
    b = ci.quantile_bounds(values, q, confidence)
    entry["interval"] = [b.low, b.high]
    if (b.low is not None and b.low > hi_ok) or (b.high is not None and b.high < lo_ok):
        entry["result"] = "beyond"
    elif b.low is not None and b.high is not None and b.low >= lo_ok and b.high <= hi_ok:
        entry["result"] = "within"
    else:
        entry["result"] = "undecided"
    return entry


def compare(
    predicted: dict[str, float | None],
    records: list[dict[str, Any]],
    confidence: float,
    tol_pct: float,
) -> tuple[dict[str, dict[str, Any]], bool]:
    """Per metric ``{predicted, measured, error_pct, interval, n, result}``; unexplained?"""
    measured = samples(records)
    out = {
        m: judge(predicted.get(m), measured.get(sample, []), q, confidence, tol_pct)
        for m, (sample, q) in METRICS.items()
    }
    return out, any(e["result"] == "beyond" for e in out.values())


def explain(prediction: dict[str, dict[str, Any]], tol_pct: float) -> list[str]:
    """One line per figure beyond the prediction: which, by how much, and what that means."""
    lines = []
    for metric, e in prediction.items():
        if e["result"] != "beyond":
            continue
        lo, hi = e["interval"] or [None, None]
        where = "above" if (e["error_pct"] or 0) > 0 else "below"
        span = f"[{_ms(lo)}, {_ms(hi)}]"
        lines.append(
            f"{metric} measured {_ms(e['measured'])} ({e['error_pct']:+.0f} %), predicted "
            f"{_ms(e['predicted'])}: its interval {span} lies wholly {where} ±{tol_pct:g} %"
        )
    return lines


def _ms(value: float | None) -> str:
    return "∞" if value is None else f"{value:.4g} ms"


@dataclass
class StepPrediction:
    """One step's prediction, its simulator inputs, and whether the step is unexplained."""

    figures: dict[str, dict[str, Any]] | None
    unexplained: bool | None
    model: dict[str, Any]
    fields: dict[str, Any] | None = None
    workload: Any = None


def predict_step(
    fields: dict[str, Any] | None,
    records: list[dict[str, Any]],
    link_from: str,
    confidence: float,
    tol_pct: float,
    trace: Any = None,
    block_size: int = 0,
) -> StepPrediction:
    """Simulate one step and compare; a step the simulator cannot model says why."""
    workload = step_workload(records, trace, block_size)
    model: dict[str, Any] = {"link_from": link_from, "fields": fields}
    missing = [k for k in ("prefill_flops", "decode_hbm_bytes_per_s")
               if fields is not None and k not in fields]  # fmt: skip
    if fields is None or workload is None or missing:
        if fields is None:
            why = "no link figures (the step's probe failed)"
        elif workload is None:
            why = "no requests"
        else:
            why = f"no measured {', '.join(missing)} (the servers reported no timings)"
        model["error"] = why
        return StepPrediction(None, None, model)
    figures, unexplained = compare(simulate_step(fields, workload), records, confidence, tol_pct)
    return StepPrediction(figures, unexplained, model, fields, workload)


def run_summary(
    steps: list[tuple[str, StepPrediction]], tol_pct: float, fits: list[dict[str, Any]]
) -> dict[str, Any]:
    """The run's prediction in brief: how many steps were predicted and which are unexplained."""
    predicted = [(sid, p) for sid, p in steps if p.figures is not None]
    return {
        "error_max_pct": tol_pct,
        "steps": len(steps),
        "predicted": len(predicted),
        "unexplained": sum(1 for _, p in predicted if p.unexplained),
        "unexplained_steps": [sid for sid, p in predicted if p.unexplained],
        "not_predicted": {sid: p.model.get("error") for sid, p in steps if p.figures is None},
        "compute_fits": fits,
    }
