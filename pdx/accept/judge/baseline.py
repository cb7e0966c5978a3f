"""``baseline: colocated``: does the split pay here? Each step beside its colocated twin.

Every step of the matrix is run twice on the same deployment, back to back: once as the
playbook asks (the router ships KV where its threshold says), once with every request sent
``pdx_route: local`` (decode prefills it: no KV crosses the link). The order alternates from
step to step, so neither side always runs on a warmer or a more tired machine. The twin's
criteria are judged and shown but are advisory: the baseline never decides the verdict.

Per step the report sets the two side by side: TTFT p50 / p99 and TPOT p50 with their
order-statistic intervals, and goodput: the requests per second that met every per-request
latency threshold (TTFT ≤ ``ttft_p99_ms``, TPOT ≤ ``tpot_p99_ms``, whichever the playbook
sets), with its Garwood (Poisson) interval. The split *pays* when its TTFT p50 interval lies
wholly below the twin's or its goodput interval wholly above, and neither is the other way;
it *costs* in the mirror case; *mixed* when one figure pays and the other costs; otherwise
the sample shows no difference.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import numpy as np

from pdx.accept.judge import confidence as ci
from pdx.accept.judge.stats import samples
from pdx.accept.playbook import Criteria, Playbook
from pdx.accept.steps import Step, step_criteria


class AcceptRun(Protocol):
    """What the baseline drives of a run (:class:`pdx.accept.run.AcceptRun`)."""

    pb: Playbook
    steps: list[Step]
    local_nets: set[str]
    baseline_rows: list[dict[str, Any]]

    @property
    def outcomes(self) -> Any: ...

    @property
    def baseline_outcomes(self) -> Any: ...

    async def _run_step(self, step: Step, locustfile: Path) -> Any: ...


SUFFIX = "colocated"
QUANTILES = (("ttft_p50_ms", "ttft_ms", 0.5), ("ttft_p99_ms", "ttft_ms", 0.99),
             ("tpot_p50_ms", "tpot_ms", 0.5))  # fmt: skip


def twin_name(network: str) -> str:
    """The colocated twin's condition name (its step id ends with it)."""
    return f"{network}-{SUFFIX}"


def side(
    rows: list[dict[str, Any]],
    elapsed_s: float,
    criteria: Criteria,
    confidence: float,
    quantiles: tuple[tuple[str, str, float], ...] = QUANTILES,
) -> dict[str, Any]:
    """One side's figures: quantiles and goodput, each ``{value, interval}``."""
    values = samples(rows)
    out: dict[str, Any] = {"requests": len(rows)}
    for name, key, q in quantiles:
        xs = values[key]
        if not xs:
            out[name] = {"value": None, "interval": None}
            continue
        b = ci.quantile_bounds(xs, q, confidence) if confidence else None
        out[name] = {
            "value": round(float(np.percentile(xs, q * 100)), 3),
            "interval": [b.low, b.high] if b is not None else None,
        }
    met = sum(1 for r in rows if _meets(r, criteria))
    span = max(elapsed_s, 1e-9)
    rate = ci.poisson_rate_bounds(met, span, confidence) if confidence else None
    interval = None if rate is None else [
        None if b is None else round(b, 3) for b in (rate.low, rate.high)]  # fmt: skip
    out["goodput_rps"] = {"value": round(met / span, 3), "interval": interval, "met": met}
    out["disaggregated"] = sum(1 for r in rows if (r.get("pdx") or {}).get("route") ==
                               "disaggregated")  # fmt: skip
    return out


def _meets(row: dict[str, Any], c: Criteria) -> bool:
    if not row.get("ok"):
        return False
    ttft, tpot = row.get("ttft_ms"), row.get("tpot_ms")
    if c.ttft_p99_ms is not None and (ttft is None or ttft > c.ttft_p99_ms):
        return False
    return not (c.tpot_p99_ms is not None and tpot is not None and tpot > c.tpot_p99_ms)


def above(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether a's interval lies wholly above b's."""
    ia, ib = a.get("interval"), b.get("interval")
    return bool(ia and ib and ia[0] is not None and ib[1] is not None and ia[0] > ib[1])


def compare(
    step: Step, twin: Step, split: dict[str, Any], colo: dict[str, Any], split_first: bool
) -> dict[str, Any]:
    """One step's row: both sides, the differences, and what the split pays or costs."""
    s50, c50 = split["ttft_p50_ms"], colo["ttft_p50_ms"]
    sg, cg = split["goodput_rps"], colo["goodput_rps"]
    better = [w for w, yes in (("TTFT p50", above(c50, s50)), ("goodput", above(sg, cg))) if yes]
    worse = [w for w, yes in (("TTFT p50", above(s50, c50)), ("goodput", above(cg, sg))) if yes]
    if better and worse:
        verdict = "mixed"
    elif better:
        verdict = "pays"
    elif worse:
        verdict = "costs"
    else:
        verdict = "no difference shown"
    delta = None
    if s50["value"] is not None and c50["value"] is not None:
        delta = round(s50["value"] - c50["value"], 3)
    return {
        "step": step.id,
        "colocated_step": twin.id,
        "order": "split first" if split_first else "colocated first",
        "split": split,
        "colocated": colo,
        "ttft_p50_delta_ms": delta,
        "goodput_delta_rps": round(sg["value"] - cg["value"], 3),
        "verdict": verdict,
        "better": better,
        "worse": worse,
        "line": line(step.id, verdict, (better, worse), (s50, c50), (sg, cg)),
    }


def line(
    step: str,
    verdict: str,
    which: tuple[list[str], list[str]],
    ttft: tuple[dict[str, Any], dict[str, Any]],
    goodput: tuple[dict[str, Any], dict[str, Any]],
) -> str:
    """``s00…: the split pays here (TTFT p50): TTFT p50 41 ms split vs 63 ms colocated …``."""

    def ms(d: dict[str, Any]) -> str:
        return "–" if d["value"] is None else f"{d['value']:.4g} ms"

    (s50, c50), (sg, cg) = ttft, goodput
    pct = ""
    if s50["value"] is not None and c50["value"]:
        pct = f" ({(s50['value'] - c50['value']) / c50['value'] * 100:+.0f} %)"
    better, worse = which
    head = {
        "pays": f"the split pays here ({', '.join(better)})",
        "costs": f"the split costs here ({', '.join(worse)})",
        "mixed": f"the split pays on {', '.join(better)} and costs on {', '.join(worse)}",
        "no difference shown": "no difference this sample can show",
    }[verdict]
    return (
        f"{step}: {head}: TTFT p50 {ms(s50)} split vs {ms(c50)} colocated{pct}; goodput "
        f"{sg['value']:g} vs {cg['value']:g} req/s"
    )


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's baseline section: every step's row and one line over all of them."""
    counts = {v: sum(1 for r in rows if r["verdict"] == v)
              for v in ("pays", "costs", "mixed", "no difference shown")}  # fmt: skip
    if counts["costs"] and not counts["pays"]:
        head = f"the split costs in {counts['costs']} of {len(rows)} steps and pays in none"
    elif counts["pays"] and not counts["costs"]:
        head = f"the split pays in {counts['pays']} of {len(rows)} steps and costs in none"
    elif counts["pays"] or counts["costs"]:
        head = f"the split pays in {counts['pays']} and costs in {counts['costs']} of {len(rows)}"
    elif counts["mixed"]:
        head = f"the split pays on one figure and costs on another in {counts['mixed']} steps"
    else:
        head = f"no difference the samples can show in any of {len(rows)} steps"
    return {"kind": "colocated", "summary": head, "counts": counts, "steps": rows}


def add_twins(run: AcceptRun) -> None:
    """The twin conditions (each step's condition, every request local) on the run's playbook."""
    for net in list(run.pb.matrix.network):
        name = twin_name(net)
        run.pb.conditions.setdefault(name, run.pb.conditions[net])
        run.local_nets.add(name)


async def run_with_twins(run: AcceptRun, locustfile: Path) -> None:
    """Every step and its colocated twin, the order alternating from step to step."""
    from dataclasses import replace

    for step in run.steps:
        twin = replace(step, network=twin_name(step.network))  # same index: the same prompts
        split_first = step.index % 2 == 0
        done = {}
        for s in (step, twin) if split_first else (twin, step):
            done[s.network] = await run._run_step(s, locustfile)
        main, other = done[step.network], done[twin.network]
        for c in other.criteria:
            c.advisory = True  # shown, never deciding
        run.outcomes.append(main)
        run.baseline_outcomes.append(other)
        crit, conf = step_criteria(run.pb, step), run.pb.judgement.confidence
        row = compare(
            step,
            twin,
            side(main.records, main.report.elapsed_s, crit, conf),
            side(other.records, other.report.elapsed_s, crit, conf),
            split_first,
        )
        row["colocated_criteria"] = [
            {"name": c.name, "result": c.result, "measured": c.measured, "threshold": c.threshold}
            for c in other.criteria
        ]
        row["colocated_valid"] = other.validity.valid
        run.baseline_rows.append(row)


def capacity_line(searches: list[dict[str, Any]]) -> str:
    """``--search`` with the baseline: the limit of the split beside the colocated one."""
    parts = []
    for split in (s for s in searches if s.get("route") == "split"):
        twin = next((s for s in searches if s.get("route") == "colocated"
                     and s["condition"] == twin_name(split["condition"])), None)  # fmt: skip
        if twin is None:
            continue
        a, b, unit = split["limit"], twin["limit"], split["unit"]
        if a is None or b is None:
            verdict = "cannot be compared (a search found no limit)"
        elif split["bracket"][1] is not None and split["bracket"][1] <= b:
            verdict = "the split carries less"
        elif twin["bracket"][1] is not None and twin["bracket"][1] <= a:
            verdict = "the split carries more"
        else:
            verdict = "their brackets overlap"
        parts.append(f"{split['param']} limit under {split['condition']}: split {a} vs colocated "
                     f"{b} {unit}: {verdict}")  # fmt: skip
    return "; ".join(parts) or "no split/colocated pair of searches finished"
