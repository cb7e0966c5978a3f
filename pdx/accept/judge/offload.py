"""``matrix.offload``: offload policies side by side on the same traffic.

Each matrix cell is run once per policy (and per ``matrix.offload_rounds``), every request of a
step sending ``pdx_offload: {policy}`` to pdx's gateway, so the policies share one deployment,
one link and one machine; the order is reversed from one round (and cell) to the next. A trace
step's tokens are salted with its step id (:func:`pdx.accept.load.locust.trace_salt`): each
policy replays the same reuse, and none finds the prefix caches an earlier step warmed.

The verdict is the first policy's (the candidate); the other policies' criteria are judged and
shown as advisory. Per cell the report sets the policies side by side, each policy's steps
pooled: goodput (requests within every per-request latency threshold per second, Garwood
interval), TTFT p50/p90/p99 and TPOT p50 (order-statistic intervals), KV bytes and Gbps across
the link, the share offloaded, and decode's own prefill time. The candidate *pays* over another
policy when its TTFT p90 interval lies wholly below the other's or its goodput interval wholly
above, and neither is the other way; *costs* in the mirror case; *mixed*; or the sample shows
no difference. KV bytes are counted, not sampled: the line gives their ratio.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pdx.accept.judge.baseline import above, side
from pdx.accept.playbook import Playbook
from pdx.accept.steps import Step, step_criteria
from pdx.units import human_bytes

QUANTILES = (("ttft_p50_ms", "ttft_ms", 0.5), ("ttft_p90_ms", "ttft_ms", 0.9),
             ("ttft_p99_ms", "ttft_ms", 0.99), ("tpot_p50_ms", "tpot_ms", 0.5))  # fmt: skip


def step_body(extra_body: dict[str, Any], step: Step) -> dict[str, Any]:
    """The request fields of a step's load: the playbook's, plus the step's policy."""
    choice: dict[str, Any] = {}
    if step.offload is not None:
        choice["policy"] = step.offload
    if step.threshold_tokens is not None:
        choice["threshold_tokens"] = step.threshold_tokens
    return {**extra_body, "pdx_offload": choice} if choice else extra_body


def advisory(pb: Playbook, step: Step) -> bool:
    """Whether the step runs a policy other than the candidate (shown, never deciding)."""
    policies = pb.matrix.offload or []
    return bool(policies) and step.offload is not None and step.offload != policies[0]


def policy_side(pb: Playbook, step: Step, outcomes: list[Any]) -> dict[str, Any]:
    """One policy's figures over its steps of one cell (records pooled, elapsed summed)."""
    rows = [r for o in outcomes for r in o.records]
    elapsed = sum(float(o.report.elapsed_s or 0.0) for o in outcomes)
    crit, conf = step_criteria(pb, step), pb.judgement.confidence
    out = side(rows, elapsed, crit, conf, QUANTILES)
    pdx = [r.get("pdx") or {} for r in rows]
    shipped = [int(p.get("kv_bytes") or 0) for p in pdx if p.get("route") == "disaggregated"]
    timings = [float((p.get("timings_ms") or {}).get("local_prefill") or 0.0) for p in pdx]
    out |= {
        "steps": [o.step.id for o in outcomes],
        "kv_bytes": sum(shipped),
        "kv_gbps": round(sum(shipped) * 8 / max(elapsed, 1e-9) / 1e9, 6),
        "offloaded_share": round(len(shipped) / len(rows), 4) if rows else None,
        "decode_prefill_ms": round(sum(timings), 3),
        "elapsed_s": round(elapsed, 3),
    }
    return out


def compare(
    pb: Playbook,
    outcomes: list[Any],
    playbook_dir: Path | None = None,
    preflight: dict[str, Any] | None = None,
) -> dict[str, Any] | None:
    """The report's ``offload`` section: per cell every policy's figures and the candidate
    against each other policy; None without ``matrix.offload``. With the pre-flight's KV per
    token, a trace cell's policies also get the simulator's KV bytes (``predicted_kv_bytes``)."""
    policies = pb.matrix.offload
    if not policies:
        return None
    predict: Callable[[Step, str, int], float | None] = _no_prediction
    if any(o.step.workload is not None for o in outcomes):
        # a model it cannot size: the comparison goes without the prediction
        with contextlib.suppress(Exception):
            predict = _bytes_predictor(pb, playbook_dir, preflight)
    cells: dict[int, list[Any]] = {}
    for o in outcomes:
        if o.step.cell is not None:
            cells.setdefault(o.step.cell, []).append(o)
    rows = []
    for _, mine in sorted(cells.items()):
        sides = {}
        for policy in policies:
            ran = [o for o in mine if o.step.offload == policy]
            if ran:
                sides[policy] = policy_side(pb, ran[0].step, ran)
                try:
                    guess = predict(ran[0].step, policy, len(ran))
                except Exception:  # a prediction must never cost the reviewer the comparison
                    guess = None
                sides[policy]["predicted_kv_bytes"] = guess
        first = mine[0].step
        name = first.id.removesuffix(f"-{first.offload}").split("-", 1)[1]
        order = [o.step.offload for o in mine]
        versus = [_versus(policies[0], p, sides[policies[0]], sides[p], name)
                  for p in policies[1:] if policies[0] in sides and p in sides]  # fmt: skip
        rows.append({"cell": name, "order": order, "policies": sides, "versus": versus})
    counts: dict[str, int] = {}
    for row in rows:
        for v in row["versus"]:
            counts[v["verdict"]] = counts.get(v["verdict"], 0) + 1
    head = (
        f"{policies[0]} (the verdict's policy) beside {', '.join(policies[1:])}: "
        + (", ".join(f"{k} in {n}" for k, n in sorted(counts.items())) or "nothing to compare")
        + f" of {sum(counts.values())} comparisons"
    )
    return {"candidate": policies[0], "policies": list(policies), "summary": head, "cells": rows}


def _no_prediction(step: Step, policy: str, runs: int) -> float | None:
    return None


def _bytes_predictor(
    pb: Playbook, playbook_dir: Path | None, preflight: dict[str, Any] | None
) -> Callable[[Step, str, int], float | None]:
    """(step, policy, its runs) → the KV bytes ``pdx simulate`` ships on the step's trace window
    under that policy (on vLLM, ``length`` ships only what decode lacks), with prefix caches
    that never evict (the deploy's hold the window), KV per token from the pre-flight's
    measure-kv (else the deployed model sized analytically);
    None where it cannot say (no trace, a target pdx did not deploy)."""
    kv = ((preflight or {}).get("measure_kv") or {}).get("result") or {}
    per_token = float(kv.get("kv_bytes_per_token") or 0.0)
    local_max, engine = None, "pdx"
    if pb.target.deploy is not None and playbook_dir is not None:
        from pdx.accept.preflight.kv import deploy_config, kv_bytes_at
        from pdx.serving.deploy_config import local_prefill_threshold

        if not per_token:  # no measure-kv in the pre-flight: the deployed model, sized as it does
            per_token = kv_bytes_at(pb, playbook_dir, [1024])[1024] / 1024
        deployed = deploy_config(pb.target, playbook_dir)
        local_max = max(0, local_prefill_threshold(deployed) - 1)
        engine = deployed.engine

    def predict(step: Step, policy: str, runs: int) -> float | None:
        if step.workload is None or local_max is None:
            return None
        from pdx.sim.config import load_sim_config
        from pdx.sim.runner import simulate

        w = pb.load.workloads[step.workload]
        workload = {"trace": w.trace, "format": w.format, "block_size": w.block_size,
                    "length_scale": w.length_scale, "time_scale": step.time_scale or w.time_scale,
                    "start_s": w.start_s, "duration_s": w.duration_s,
                    "max_requests": w.max_requests}  # fmt: skip
        cfg = load_sim_config(overrides={
            "modes": ["disaggregated"], "kv_bytes_per_token": per_token,
            "local_prefill_max_tokens": local_max, "prefix_cache_blocks": 10**7,
            # vLLM decides by length but its NIXL pull moves only what decode lacks: the
            # simulator's model without a policy (pdx's own pair ships the whole prompt)
            "offload_policy": None if (engine, policy) == ("vllm", "length") else policy,
            "workload": workload,
        })  # fmt: skip
        shipped = simulate(cfg).disaggregated
        got = None if shipped is None else shipped.kv_shipped_bytes
        return None if got is None else float(got) * runs

    return predict


def _versus(
    mine: str, other: str, a: dict[str, Any], b: dict[str, Any], cell: str
) -> dict[str, Any]:
    """The candidate ``a`` against policy ``b`` on one cell."""

    def wins(x: dict[str, Any], y: dict[str, Any]) -> list[str]:
        ttft = above(y["ttft_p90_ms"], x["ttft_p90_ms"])  # x's interval wholly below y's
        goodput = above(x["goodput_rps"], y["goodput_rps"])
        return [w for w, yes in (("TTFT p90", ttft), ("goodput", goodput)) if yes]

    better, worse = wins(a, b), wins(b, a)
    verdict = ("mixed" if better and worse else "pays" if better else "costs" if worse
               else "no difference shown")  # fmt: skip
    kv_ratio = a["kv_bytes"] / b["kv_bytes"] if b["kv_bytes"] else None
    head = {
        "pays": f"{mine} pays over {other} ({', '.join(better)})",
        "costs": f"{mine} costs against {other} ({', '.join(worse)})",
        "mixed": f"{mine} pays on {', '.join(better)} and costs on {', '.join(worse)} "
        f"against {other}",
        "no difference shown": f"no difference in TTFT p90 or goodput this sample can show "
        f"between {mine} and {other}",
    }[verdict]
    kv = ""
    if kv_ratio is not None:
        kv = f"; KV {human_bytes(a['kv_bytes'])} vs {human_bytes(b['kv_bytes'])} "
        kv += f"({(kv_ratio - 1) * 100:+.0f} %)"
    pa, pb_ = a.get("predicted_kv_bytes"), b.get("predicted_kv_bytes")
    if pa is not None and pb_ is not None:
        kv += f", predicted {human_bytes(pa)} vs {human_bytes(pb_)} (pdx simulate)"
    share = "; offloaded " + " vs ".join(
        "–" if s["offloaded_share"] is None else f"{100 * s['offloaded_share']:.0f} %"
        for s in (a, b)
    )
    return {
        "policy": other,
        "verdict": verdict,
        "better": better,
        "worse": worse,
        "kv_bytes_ratio": None if kv_ratio is None else round(kv_ratio, 4),
        "line": f"{cell}: {head}: TTFT p90 {_ms(a['ttft_p90_ms'])} vs {_ms(b['ttft_p90_ms'])}; "
        f"goodput {_rps(a['goodput_rps'])} vs {_rps(b['goodput_rps'])} req/s{kv}{share}",
    }


def _ms(d: dict[str, Any]) -> str:
    if d["value"] is None:
        return "–"
    iv = d.get("interval")
    if not iv or None in iv:
        return f"{d['value']:.4g} ms"
    return f"{d['value']:.4g} ms [{iv[0]:.4g}, {iv[1]:.4g}]"


def _rps(d: dict[str, Any]) -> str:
    iv = d.get("interval")
    if not iv or iv[0] is None or iv[1] is None:
        return f"{d['value']:g}"
    return f"{d['value']:g} [{iv[0]:g}, {iv[1]:g}]"
