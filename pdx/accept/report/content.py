"""What the report says, as table headers, rows and lines of plain text: the verdict headline,
the criteria, steps, prediction and recommendation tables, the gate, fault and pre-flight
lines. Shared by the Markdown and HTML renderings and by ``pdx report show``.
"""

from __future__ import annotations

from typing import Any

from pdx.accept.judge.criteria import CriterionResult
from pdx.accept.judge.stats import OFFLOAD_WINDOW_S
from pdx.accept.report.schema import Report, StepReport
from pdx.accept.target.netns import MIN_RTT_WINDOW_S


def target_line(report: Report) -> str:
    """What was loaded, in one line (everything else is in report.json ``target``)."""
    t = report.target
    model = (t.get("model") or {}).get("model")
    parts = [str(t.get("kind", "?")), str(t.get("url", ""))]
    if t.get("deploy"):
        parts.append(f"deploy={t['deploy']}")
    if model:
        synthetic = " (synthetic)" if (t.get("model") or {}).get("synthetic") else ""
        parts.append(f"model={model}{synthetic}")
    if across := (t.get("netns") or {}).get("across_sites"):
        parts.append(f"across sites: {across}")
    return " ".join(p for p in parts if p)


def _fmt(value: float | None, unit: str = "") -> str:
    if value is None:
        return "—"
    if unit == "fraction":
        return f"{value * 100:.3g} %"
    return f"{value:.4g}{(' ' + unit) if unit else ''}"


def _interval(c: CriterionResult) -> str:
    if c.interval is None:
        return "—"
    if c.method == "observed maximum":
        return "observed"
    if c.confidence <= 0:
        return "point estimate"
    low, high = c.interval
    lo = "−∞" if low is None else _fmt(low, c.unit)
    hi = "+∞" if high is None else _fmt(high, c.unit)
    return f"[{lo}, {hi}]"


def result_cell(c: CriterionResult) -> str:
    """pass / FAIL / UNDECIDED / NOT MEASURED, with what would decide it."""
    word = {
        "pass": "pass", "fail": "FAIL", "indeterminate": "UNDECIDED", "not_measured": "NOT MEASURED"
    }[c.result]  # fmt: skip
    if c.advisory:
        word += " (advisory)"
    return word + (f" ({c.note})" if c.note else "")


def not_judged_lines(report: Report) -> list[str]:
    """The criteria set to null, one line each: never counted as met."""
    return [f"Not judged: {n['name']} on {n['steps']} ({n['why']})" for n in report.not_judged]


def criteria_rows(report: Report) -> list[list[str]]:
    """Criterion table rows: name, step, measured, threshold, margin, interval, n, result."""
    return [
        [
            c.name,
            c.step,
            _fmt(c.measured, c.unit),
            _fmt(c.threshold, c.unit),
            _fmt(c.margin, c.unit),
            _interval(c),
            "—" if c.sample is None else f"{c.sample:,}",
            result_cell(c),
        ]
        for c in report.criteria
    ]


def step_rows(report: Report) -> list[list[str]]:
    """Step table rows with the headline numbers."""
    rows = []
    for s in report.steps:
        sm = s.summary
        load = f"c={s.concurrency}" if s.concurrency is not None else f"{s.rate_rps:g} rps"
        rows.append(
            [
                s.id,
                s.network,
                f"{s.input_tokens}/{s.output_tokens}",
                load,
                "valid" if s.valid else "INVALID",
                str(sm.get("requests", 0)),
                _fmt((sm.get("ttft_ms") or {}).get("p50"), "ms"),
                _fmt((sm.get("ttft_ms") or {}).get("p99"), "ms"),
                _fmt((sm.get("tpot_ms") or {}).get("p99"), "ms"),
                _fmt((sm.get("transfer_ms") or {}).get("p99"), "ms"),
                _fmt(sm.get("error_rate"), "fraction"),
                str(sm.get("degraded", 0)),
                str(sm.get("retries", 0)),
                _fmt(sm.get("achieved_rps")),
            ]
        )
    return rows


STEP_HEADERS = [
    "step",
    "network",
    "in/out tok",
    "load",
    "validity",
    "requests",
    "TTFT p50",
    "TTFT p99",
    "TPOT p99",
    "transfer p99",
    "errors",
    "degraded",
    "retries",
    "req/s",
]
CRITERIA_HEADERS = [
    "criterion",
    "step",
    "measured",
    "threshold",
    "margin",
    "interval",
    "n",
    "result",
]


PREDICTION_HEADERS = [
    "step",
    "metric",
    "predicted",
    "measured",
    "error",
    "measured interval",
    "n",
    "result",
]
_RESULT_WORD = {"within": "within", "beyond": "BEYOND", "undecided": "undecided",
                "not_compared": "—"}  # fmt: skip


def prediction_rows(report: Report, short: bool = False) -> list[list[str]]:
    """One row per step and predicted metric."""
    rows = []
    for s in report.steps:
        fitted = s.id in ((s.prediction_model or {}).get("pull_fitted_on") or [])
        for metric, e in (s.prediction or {}).items():
            lo, hi = e.get("interval") or (None, None)
            interval = "—" if e.get("interval") is None else (
                f"[{_fmt(lo, 'ms') if lo is not None else '−∞'}, "
                f"{_fmt(hi, 'ms') if hi is not None else '+∞'}]"
            )  # fmt: skip
            err = e.get("error_pct")
            rows.append(
                [
                    s.id.split("-", 1)[0] if short else s.id,
                    metric,
                    _fmt(e.get("predicted"), "ms"),
                    _fmt(e.get("measured"), "ms"),
                    "—" if err is None else f"{err:+.1f} %",
                    interval,
                    str(e.get("n", "—")),
                    _RESULT_WORD.get(str(e.get("result")), str(e.get("result")))
                    + (" (fitted)" if fitted and metric == "transfer_p50_ms" else ""),
                ]
            )
    return rows


def prediction_line(report: Report) -> str:
    """How the prediction was made and judged, with the run's count of unexplained steps."""
    ps = report.prediction_summary or {}
    tol = ps.get("error_max_pct", 25)
    where = ", ".join(ps.get("unexplained_steps") or []) or "none"
    missing = "; ".join(f"{k}: {v}" for k, v in (ps.get("not_predicted") or {}).items())
    return (
        f"Each step simulated with the deployed model, the compute the servers reported (the "
        f"step's own timings, else the run's), the link that step's probe measured and the "
        f"step's own requests. error = "
        f"(measured − predicted) / predicted; a figure is BEYOND when its whole interval lies "
        f"outside ±{tol:g} % of the prediction, within when it lies inside, undecided "
        f"otherwise. {ps.get('unexplained', 0)} of {ps.get('predicted', 0)} predicted steps "
        f"unexplained ({where})."
        + (f" Not predicted: {missing}." if missing else "")
        + (
            " vLLM's pull (round trips and fixed time) is fitted on the clean steps "
            f"{', '.join(ps['pull_fitted_on'])}: their transfer_p50_ms is a fit, not a "
            "prediction."
            if ps.get("pull_fitted_on")
            else ""
        )
    )


def unexplained_lines(report: Report) -> list[str]:
    """Per unexplained step, the figures beyond the prediction."""
    from pdx.accept.predict.prediction import explain

    tol = float((report.prediction_summary or {}).get("error_max_pct", 25))
    out = []
    for s in report.steps:
        if s.unexplained and s.prediction:
            out += [f"{s.id} unexplained: {line}" for line in explain(s.prediction, tol)]
    return out


def recommendation_rows(report: Report) -> list[list[str]]:
    """Setting, value, why."""
    return [
        [name, "—" if r.value is None else str(r.value), r.why]
        for name, r in report.recommendations.items()
    ]


def headline(report: Report) -> str:
    state = "" if report.complete else " (INCOMPLETE: interrupted or failed before the end)"
    if report.search:
        from pdx.accept.search.limit import limit_text

        return f"{report.verdict}{state} — " + "; ".join(limit_text(s) for s in report.search)
    deciding = [c for c in report.criteria if not c.advisory]
    met = sum(1 for c in deciding if c.result == "pass")
    undecided = sum(1 for c in deciding if c.result == "indeterminate")
    unmeasured = sum(1 for c in deciding if c.result == "not_measured")
    advisory = len(report.criteria) - len(deciding)
    how = (
        f"at {report.confidence:.0%} confidence"
        if report.confidence > 0
        else "on point estimates (no confidence)"
    )
    ps = report.prediction_summary or {}
    unexplained = (
        f" ({ps.get('unexplained', 0)} of {ps.get('predicted', 0)} steps unexplained)"
        if ps.get("predicted")
        else ""
    )
    extra = (f", {undecided} undecided" if undecided else "") + (
        f", {unmeasured} not measured" if unmeasured else ""
    )
    tail = f"; {len(report.not_judged)} not judged (null)" if report.not_judged else ""
    tail += f"; {advisory} advisory" if advisory else ""
    across = str((report.target.get("netns") or {}).get("across_sites") or "")
    tail += "; PLAINTEXT across sites" if across.startswith("plaintext") else ""
    return (
        f"{report.verdict}{state} — run {'VALID' if report.valid else 'INVALID'}{unexplained}; "
        f"{met}/{len(deciding)} judged criteria met{extra} {how}{tail}"
    )


def statistics_line(report: Report) -> str:
    """How the criteria were judged, in one sentence."""
    if report.confidence <= 0:
        return (
            "Criteria are judged on point estimates (judgement.confidence 0): no interval, no "
            "statement about what the sample proves."
        )
    c = report.confidence
    return (
        f"Each interval is [lower, upper] one-sided bounds at {c:.0%} confidence (together a "
        f"{2 * c - 1:.0%} two-sided interval): pass only when the whole interval clears the "
        "threshold, FAIL when it lies wholly beyond it, UNDECIDED otherwise (with the sample "
        "that would decide it), NOT MEASURED when there was no sample at all; neither of the "
        "last two passes a run. Quantiles: order statistics; rates: Clopper-Pearson; retries "
        "per transfer: Garwood; a threshold of 0 fails on any observed and passes only when "
        "none observed bounds the rate to judgement.zero_rate_bound."
    )


def _gateway_counts(mdelta: dict[str, float]) -> str:
    """Degradations, retries and transfer outcomes from the target's own counters."""
    parts = []
    for prefix, label in (
        ("pdx_gateway_degradations_total", "degradations"),
        ("pdx_gateway_kv_retries_total", "KV retries"),
        ("pdx_gateway_kv_transfers_total", "transfers"),
        ("pdx_gateway_rejections_total", "rejections"),
    ):
        hits = {k: v for k, v in mdelta.items() if k.startswith(prefix) and v}
        if hits:
            parts.append(
                f"{label} "
                + ", ".join(f"{k[len(prefix) :] or 'total'}={v:g}" for k, v in hits.items())
            )
    return "; ".join(parts)


def gate_lines(report: Report) -> list[str]:
    """Per step, the facts behind each gate (and the gates that could not be measured)."""
    lines = []
    for s in report.steps:
        sm, parts = s.summary, []
        if sm.get("labelled_disaggregated") is not None:
            parts.append(
                f"silent fallback {sm.get('silent_fallback', 0)} of "
                f"{sm['labelled_disaggregated']} requests labelled disaggregated"
            )
        if sm.get("replayed") is not None:
            parts.append(
                f"replay on the local route: {sm.get('replay_mismatches', 0)} of "
                f"{sm['replayed']} greedy requests gave other tokens"
                + (f" ({sm['replay_near_ties']} more differed at a near-tie, within "
                   f"{sm['replay_tie_logprob']} nat of the replay's choice)"
                   if sm.get("replay_near_ties") else "")
            )  # fmt: skip
        if sm.get("kv_stranded_source") == "prefill_kv_usage":
            held = sm.get("kv_stranded_max_s")
            parts.append(
                f"KV prefill held after the step's last request: {_num(held, '.2f')} s until "
                "its KV usage was back to 0"
                + (" (still held when the watch stopped)" if sm.get("kv_stranded_still_held")
                   else "")
            )  # fmt: skip
        elif sm.get("kv_objects") == 0:
            parts.append("KV held after request end: no KV object entered the store")
        elif sm.get("kv_objects") is not None and sm.get("kv_stranded_max_s") is not None:
            worst = sm.get("kv_stranded_worst") or {}
            parts.append(
                f"KV held after request end: max {sm.get('kv_stranded_max_s', 0):.3f} s over "
                f"{sm['kv_objects']} objects ({sm.get('kv_stranded_byte_s') or 0:.4g} byte·s; "
                f"{sm.get('kv_stranded_still_held', 0)} still held"
                + (f"; worst {worst.get('deleted_by')}" if worst else "")
                + ")"
            )
        if sm.get("overdue_judged") is not None:
            parts.append(
                f"overdue {sm.get('overdue', 0)} of {sm['overdue_judged']} requests "
                f"(limit {sm.get('overdue_limit_s', 0):.3g} s), {sm.get('unfinished', 0)} "
                "still waiting when the load stopped"
            )
        if sm.get("idle_ttft_ratio") is not None:
            parts.append(
                f"after {sm.get('idle_s', 0):g} s idle: burst TTFT p99 "
                f"{sm['burst_ttft_p99_ms']:.4g} ms ({sm['burst_requests']} requests) vs steady "
                f"{sm['steady_ttft_p99_ms']:.4g} ms ({sm['steady_requests']})"
            )
        parts += [f"not judged: {why}" for why in sm.get("gates_not_measured") or []]
        if parts:
            lines.append(f"- **{s.id}**: " + "; ".join(parts))
    return lines


def fault_lines(report: Report) -> list[str]:
    lines = []
    for s in report.steps:
        if s.kernel:
            lines += _kernel_lines(s)
        if not s.proxy and not s.fault_events:
            continue
        p = s.proxy or {}
        link = (
            f"proxy forwarded {p.get('bytes_total', 0)} B over "
            f"{p.get('connections', 0)} connection(s); toxics acted on {p.get('toxic_bytes', 0)} B "
            f"in {p.get('toxic_events', 0)} chunk(s); "
            f"link-down events {p.get('link_down_events', 0)}, "
            f"connections refused {p.get('connections_refused', 0)}; "
            if s.proxy
            else ""  # a fault on the processes (a killed prefill), not on the link
        )
        lines.append(
            f"- **{s.id}** ({s.network}): {link}"
            f"service: {s.summary.get('retries', 0)} retries, "
            f"{s.summary.get('degraded', 0)} degraded "
            f"({s.summary.get('degrade_reasons') or {}}), "
            f"{s.summary.get('failed', 0)} failed; recovery "
            + (f"{s.recovery_s:.1f} s" if s.recovery_s is not None else "not measured")
        )
        gw = _gateway_counts(s.metrics_delta)
        if gw:
            lines.append(f"  - gateway /metrics during the step: {gw}")
        for ev in s.fault_events:
            lines.append(f"  - t={ev.get('t_s', 0):.2f} s: {ev.get('event')}")
    return lines


def _kernel_lines(s: StepReport) -> list[str]:
    k = s.kernel or {}
    c = k.get("router_counters") or {}
    emulator = k.get("emulator", "none")
    moved = []
    for d, way in (("down", "prefill → decode"), ("up", "decode → prefill")):
        if f"{d}_packets_in" in c:
            moved.append(
                f"{way} {c[f'{d}_packets_in']} wire packets in, {c.get(f'{d}_packets_out', 0)} "
                f"out, {c.get(f'{d}_dropped_loss', 0)} lost, "
                f"{c.get(f'{d}_dropped_queue', 0)} tail-dropped"
            )
        elif f"{d}_bytes_out" in c:
            moved.append(
                f"{way} tbf sent {c[f'{d}_bytes_out']} B, over its rate "
                f"{c.get(f'{d}_overlimits', 0)} times, dropped {c.get(f'{d}_dropped_queue', 0)}"
            )
    how = "rate cap only (tbf)" if emulator == "none" else f"{emulator} emulator"
    tcp = (k.get("tcp") or {}).get("kv_sender") or {}
    seen = []
    if tcp:
        seen.append(
            f"  - TCP's own view of the KV connection {tcp.get('local')} → {tcp.get('peer')}: "
            f"min RTT {_num(tcp.get('min_rtt_step_ms'), '.1f')} ms (median of the step's "
            f"{len(tcp.get('min_rtt_windows_ms') or [])} windows of {MIN_RTT_WINDOW_S} s in "
            f"which it moved bytes); at the step's end min {_num(tcp.get('min_rtt_ms'), '.1f')} "
            f"ms, smoothed {_num(tcp.get('rtt_ms'), '.1f')} ms, {tcp.get('retrans', 0)} "
            "segments retransmitted"
        )
    vllm = any(key.startswith("vllm:") for key in s.metrics_delta or {})  # NIXL: not pdx's
    if "kv_link_cap_gbps" in k and not vllm:  # pdx's own pair across the sites: its KV pacing
        cap, kv = k["kv_link_cap_gbps"], s.summary.get("kv_transfer_gbps_p50")
        paced = "unpaced" if cap is None else f"paced to {cap * 1000:.0f} Mbit/s"
        seen.append(
            f"  - KV {paced} (kv.max_link_gbps / max_link_share); per transfer it moved "
            f"{_num(None if kv is None else kv * 1000, '.0f')} Mbit/s (median)"
        )
    for d, out in (k.get("cross_traffic_achieved") or {}).items():
        kv = s.summary.get("kv_transfer_gbps_p50")
        seen.append(
            f"  - cross-traffic {d}: {out.get('flows')} {out.get('cc')} flow(s), median "
            f"{_num(out.get('median_mbit'), '.0f')} Mbit/s over the step; KV beside them: "
            f"{_num(None if kv is None else kv * 1000, '.0f')} Mbit/s per transfer (median of "
            "each transfer's bytes over its time)"
        )
    return [
        f"- **{s.id}** ({s.network}): router hop, {how}: {k.get('summary', '-')}; during the "
        f"step {'; '.join(moved) or 'no counters'}; service: {s.summary.get('retries', 0)} "
        f"retries, {s.summary.get('degraded', 0)} degraded, {s.summary.get('failed', 0)} failed",
        *seen,
        *(f"  - `{dev}`: {text}" for dev, text in (k.get("qdiscs") or {}).items()),
    ]


def _num(value: Any, fmt: str = ".3f") -> str:
    return "–" if value is None else format(value, fmt)


def preflight_lines(pre: dict[str, Any]) -> list[str]:
    """Pre-flight in a few lines: KV size of the deployed model and the probed link."""
    lines: list[str] = []
    kv = pre.get("measure_kv") or {}
    if kv.get("error"):
        lines.append(f"- measure-kv: could not run ({kv['error']})")
    elif kv.get("result"):
        r = kv["result"]
        rows = ", ".join(f"{q['seq']} tokens → {q['kv_bytes']:,} B" for q in r["requests"])
        lines.append(
            f"- **measure-kv** ({kv['model']}, {kv['dtype']}, from {kv['model_from']}): "
            f"{r['kv_bytes_per_token']:,} B of KV per token; per request {rows}"
        )
    if pre.get("kv_sizing"):
        from pdx.accept.preflight.budget import sizing_lines

        lines += [f"- **KV budgets**: {line}" for line in sizing_lines(pre["kv_sizing"])]
    probe = pre.get("probe_link") or {}
    if probe.get("error"):
        lines.append(f"- probe-link: could not run ({probe['error']})")
    if probe.get("summary"):
        lines += _probe_lines(probe, probe["summary"])
    return lines


def _probe_lines(probe: dict[str, Any], s: dict[str, Any]) -> list[str]:
    where = str(probe.get("server", "?"))
    if probe.get("server_netns"):
        where += f" (in {probe['server_netns']})"
    ci = _num(s["goodput_ci95_pct"], ".1f")
    lines = [
        f"- **probe-link** to a probe server at the KV store, {where}, baseline "
        f"(before any step's condition): goodput store→decode {_num(s['down_gbps'])} Gbps, "
        f"decode→store {_num(s['up_gbps'])} Gbps (95 % CI ±{ci} %), "
        f"RTT p50 {_num(s['rtt_p50_ms'])} ms p99 {_num(s['rtt_p99_ms'])} ms, "
        f"loss up {_num(s['loss_up_pct'])} % down {_num(s['loss_down_pct'])} %"
    ]
    chunks = [
        f"{c['chunk_bytes'] // 1024} KiB: {_num(c['gbps'])} Gbps, p99 {_num(c['p99_ms'], '.2f')} ms"
        for c in s["chunks"]
    ]
    if chunks:
        best = s["chunk_recommended_bytes"]
        chosen = f"recommended {best} B" if best else "no size passes the chunk rule"
        lines.append(f"- chunk sweep: {'; '.join(chunks)}; {chosen}")
    rules = [
        f"{r['name']} {r['status']} ({_num(r['measured'])} vs {_num(r['threshold'])} {r['unit']})"
        for r in s["rules"]
    ]
    demand = _num(s["kv_demand_gbps"], ".6f")
    lines.append(
        f"- link verdict **{s['verdict']}** for KV demand {demand} Gbps: {', '.join(rules)}"
    )
    return lines


# --- search, baseline, loose thresholds: (title, lines, headers, rows) sections ---------------

Section = tuple[str, list[str], list[str], list[list[str]]]
SEARCH_HEADERS = ["value", "verdict", "requests", "load s", "closest latency criterion",
                  "failed / undecided", "step"]  # fmt: skip
BASELINE_HEADERS = ["step", "order", "TTFT p50 split", "colocated", "TTFT p99 split",
                    "colocated", "TPOT p50 split", "colocated", "goodput split (req/s)",
                    "colocated", "the split"]  # fmt: skip


def _with_interval(d: dict[str, Any], unit: str = " ms") -> str:
    if d.get("value") is None:
        return "–"
    iv = d.get("interval")
    span = f" [{_fmt(iv[0])}, {_fmt(iv[1])}]" if iv else ""
    return f"{d['value']:.4g}{unit}{span}"


OFFLOAD_HEADERS = ["cell", "policy", "requests", "goodput (req/s)", "TTFT p50", "TTFT p90",
                   "TTFT p99", "TPOT p50", "KV bytes", "predicted (sim)", "KV Gbps", "offloaded",
                   "decode prefill s"]  # fmt: skip


def offload_section(o: dict[str, Any]) -> Section:
    """matrix.offload: each cell's policies side by side, and what the first one pays."""
    rows = [
        [c["cell"], name, str(p["requests"]), _with_interval(p["goodput_rps"], ""),
         _with_interval(p["ttft_p50_ms"]), _with_interval(p["ttft_p90_ms"]),
         _with_interval(p["ttft_p99_ms"]), _with_interval(p["tpot_p50_ms"]),
         f"{p['kv_bytes']:,}",
         "–" if p.get("predicted_kv_bytes") is None else f"{p['predicted_kv_bytes']:,.0f}",
         f"{p['kv_gbps']:.3g}",
         "–" if p["offloaded_share"] is None else f"{100 * p['offloaded_share']:.0f} %",
         f"{p['decode_prefill_ms'] / 1e3:.3g}"]
        for c in o["cells"] for name, p in c["policies"].items()
    ]  # fmt: skip
    lines = [
        o["summary"]
        + "; run order per cell: "
        + "; ".join(f"{c['cell']} {', '.join(c['order'])}" for c in o["cells"])
        + "."
    ]
    lines += [v["line"] + "." for c in o["cells"] for v in c["versus"]]
    return ("Offload policies", lines, OFFLOAD_HEADERS, rows)


TRACE_HEADERS = ["step", "requests", "sessions", "ideal hit", "reported cached",
                 "engine hit (vLLM)", "offloaded (policy)", "KV B / request", "KV B total",
                 "send lag p50 / p99 ms"]  # fmt: skip


def _offloaded(tr: dict[str, Any]) -> str:
    share = tr.get("offloaded_share")
    text = "—" if share is None else f"{100 * share:.1f} %"
    return f"{text} ({tr['policy']})" if tr.get("policy") else text


def trace_section(steps: list[StepReport]) -> Section:
    """Trace steps: the trace's ideal prefix hit ratio beside what the engine saw."""

    def pct(v: float | None) -> str:
        return "—" if v is None else f"{100 * v:.1f} %"

    rows = []
    for s in steps:
        tr = s.summary["trace"]
        engine = ", ".join(f"{k} {pct(v)}" for k, v in tr["engine_hit_ratio"].items()) or "—"
        lag = tr["send_lag_ms"]
        rows.append([s.id, str(tr["requests"]), str(tr["sessions"]), pct(tr["ideal_hit_ratio"]),
                     pct(tr["reported_cached_ratio"]), engine, _offloaded(tr),
                     "—" if tr["kv_bytes_per_request"] is None
                     else f"{tr['kv_bytes_per_request']:,.0f}", f"{tr['kv_bytes_total']:,.0f}",
                     f"{_num(lag.get('p50'), '.1f')} / {_num(lag.get('p99'), '.1f')}"])  # fmt: skip
    lines = [
        "Each request carries its trace line; the ideal hit ratio is what an infinite prefix "
        "cache that started empty would hold of the replayed window (pdx trace stats); the "
        "engine's are its own counters over the step; offloaded is the share of requests "
        "prefilled remotely, under the gateway's router.offload.policy; KV B / request is what "
        "crossed the link per disaggregated request; the send lag is how late each request "
        "left after its scaled trace time."
    ]
    sources = sorted({s.summary["trace"].get("kv_bytes_from") or "" for s in steps} - {""})
    if sources:
        lines.append("KV bytes counted from: " + "; ".join(sources) + ".")
    for s in steps:
        windows = s.summary["trace"].get("offloaded_by_window") or []
        if len({w["offloaded_share"] for w in windows}) > 1:  # the policy turned during the step
            cells = ", ".join(
                f"{w['start_s']:.0f} s {100 * w['offloaded_share']:.0f} % ({w['requests']})"
                for w in windows
            )
            lines.append(f"{s.id} offloaded per {OFFLOAD_WINDOW_S:.0f} s of send time "
                         f"(from, share, requests): {cells}.")  # fmt: skip
    return ("Trace replay", lines, TRACE_HEADERS, rows)


def extra_sections(report: Report) -> list[Section]:
    """The sections a search, a colocated baseline or loose thresholds add to a report."""
    from pdx.accept.search.limit import limit_text

    out: list[Section] = []
    for s in report.search or []:
        lines = [limit_text(s)]
        pred = s.get("prediction") or {}
        if pred.get("why_not"):
            lines.append(f"No prediction: {pred['why_not']}.")
        elif pred:
            lines.append(f"Predicted by the {pred.get('method', 'simulator')}; calibrated on "
                         f"{pred.get('calibrated_on')}.")  # fmt: skip
        if s.get("undecided"):
            lines.append("Undecided after their extensions (counted as not GO): "
                         + ", ".join(f"{v:g}" for v in s["undecided"]))  # fmt: skip
        if s.get("disputed"):
            lines.append("GO once, then not on confirmation (never the limit): "
                         + ", ".join(f"{v:g}" for v in s["disputed"]))  # fmt: skip
        if s.get("confirm") and not s.get("confirmed") and s.get("limit") is not None:
            lines.append(
                f"The limit {s['limit']:g} was not confirmed ({s['confirm']} more "
                "GO asked by search.confirm): the search ended first (budget or probe cap)."
            )
        if s.get("non_monotone"):
            lines.append("GO beyond a value that was not (noise; the bracket ignores them): "
                         + ", ".join(f"{v:g}" for v in s["non_monotone"]))  # fmt: skip
        rows = [
            [f"{p['value']:g}", p["verdict"] + (" (extended)" if p["superseded"] else "")
             + (" (confirmation)" if p.get("confirmation") else ""),
             str(p["requests"]), f"{p['duration_s']:g}",
             f"{p['binding']} {p['worst_ratio']:.2f}× threshold" if p.get("binding") else "–",
             ", ".join(p["failed"] or p["undecided"]) or "–", p["step"]]
            for p in s["probes"]
        ]  # fmt: skip
        headers = SEARCH_HEADERS
        if s.get("kind") == "threshold":  # its points: what each threshold paid and shipped
            headers = [*SEARCH_HEADERS[:3], "goodput (req/s)", "KV bytes", "offloaded", "step"]
            rows = [[str(p["value"]), p["verdict"], str(p["requests"]),
                     _with_interval(p["goodput_rps"], ""), f"{p['kv_bytes']:,}",
                     f"{100 * (p['offloaded_share'] or 0):.0f} %", p["step"]]
                    for p in s["points"]]  # fmt: skip
        title = f"Search: {s['param']} under {s['condition']}"
        out.append((title + (f" ({s['route']})" if s.get("route") else ""), lines,
                    headers, rows))  # fmt: skip
    if report.baseline:
        b = report.baseline
        rows = [
            [r["step"], r["order"], _with_interval(r["split"]["ttft_p50_ms"]),
             _with_interval(r["colocated"]["ttft_p50_ms"]),
             _with_interval(r["split"]["ttft_p99_ms"]),
             _with_interval(r["colocated"]["ttft_p99_ms"]),
             _with_interval(r["split"]["tpot_p50_ms"]),
             _with_interval(r["colocated"]["tpot_p50_ms"]),
             _with_interval(r["split"]["goodput_rps"], ""),
             _with_interval(r["colocated"]["goodput_rps"], ""), r["verdict"]]
            for r in b["steps"]
        ]  # fmt: skip
        lines = [b["summary"] + "."] + [r["line"] for r in b["steps"]]
        if b.get("capacity"):
            lines.append(b["capacity"])
        out.append(("Split vs colocated", lines, BASELINE_HEADERS, rows))
    if report.offload:
        out.append(offload_section(report.offload))
    traced = [s for s in report.steps if s.summary.get("trace")]
    if traced:
        out.append(trace_section(traced))
    from pdx.accept.report.engine import engine_section

    engine = engine_section(report)
    if engine is not None:
        out.append(engine)
    if report.not_a_constraint:
        rows = [[n["name"], _fmt(n["threshold"]), str(n["steps"]),
                 "∞" if n["headroom"] is None else f"{n['headroom']:g}×"]
                for n in report.not_a_constraint]  # fmt: skip
        lines = ["These thresholds are more than 10× what was measured on every step: "
                 "not a constraint here, so the verdict says nothing about them."]  # fmt: skip
        out.append(("Not a constraint here", lines, ["criterion", "threshold", "steps",
                                                      "headroom"], rows))  # fmt: skip
    return out
