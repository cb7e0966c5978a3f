"""The acceptance report: one pydantic model, written as report.json, report.md and report.html.

``report.json`` follows ``report.schema.json`` (generated from :class:`Report`, shipped next to
this module). The verdict comes first everywhere; every metric shown has its formula stated.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pdx.accept.criteria import CriterionResult, ValidityResult
from pdx.errors import InputError

SCHEMA_PATH = Path(__file__).with_name("report.schema.json")
# 2: recommendations became the settings object; the list is what_to_change.
# 3: a criterion's result may be not_measured; threshold-0 criteria carry rate_bound; the link
#    verdict is a criterion per step (link_verdict); not_judged lists the criteria set to null.
SCHEMA_VERSION = 3


class StepReport(BaseModel):
    """Everything measured in one step."""

    model_config = ConfigDict(extra="forbid")
    id: str
    index: int
    network: str
    condition: dict[str, Any]
    input_tokens: int
    output_tokens: int
    concurrency: int | None
    rate_rps: float | None
    duration_s: float = Field(description="asked for")
    elapsed_s: float = Field(description="first intended send to last stream end")
    valid: bool
    validity_problems: list[str]
    summary: dict[str, Any]
    metrics_delta: dict[str, float] = Field(description="target /metrics after − before (pdx_*)")
    proxy: dict[str, Any] | None = Field(None, description="fault proxy counters for this step")
    fault_events: list[dict[str, Any]] = Field(default_factory=list)
    kernel: dict[str, Any] | None = Field(
        default=None,
        description="netns router: condition set (tbf, nft) and its counters this step",
    )
    preflight: dict[str, Any] | None = Field(
        default=None,
        description="the link probed under this step's condition before its load "
        "(preflight.probe_each_step): probe_link {command, server, report, summary}",
    )
    prediction: dict[str, dict[str, Any]] | None = Field(
        default=None,
        description="per metric (ttft_p50_ms, ttft_p99_ms, second_token_p50_ms, tpot_p50_ms, "
        "transfer_p50_ms): predicted, measured, error_pct, interval, n, result",
    )
    unexplained: bool | None = Field(
        default=None,
        description="a measured figure's whole interval lies beyond ±error_max_pct of the "
        "prediction (null: not predicted)",
    )
    prediction_model: dict[str, Any] | None = Field(
        default=None, description="the simulator inputs of the step's prediction"
    )
    timeline: list[dict[str, Any]] = Field(default_factory=list)
    recovery_s: float | None = None
    kv_stranded_byte_s: float | None = Field(
        default=None,
        description="Σ bytes × seconds the step's KV objects stayed held after request end",
    )
    resources: list[dict[str, Any]] = Field(default_factory=list)
    raw: dict[str, str] = Field(default_factory=dict, description="raw files, relative paths")


class Recommendation(BaseModel):
    """One setting the run's measurements recommend, and the figures behind it."""

    model_config = ConfigDict(extra="forbid")
    value: Any = Field(description="the setting (null when the run cannot tell)")
    why: str
    numbers: dict[str, Any] = Field(default_factory=dict)


RECOMMENDATION_NAMES = (
    "local_prefill_max_tokens",
    "kv_streams",
    "chunk_size_kb",
    "codec",
    "prefill_decode_ratio",
    "congestion_control",
)


def no_recommendations(why: str) -> dict[str, Recommendation]:
    """Every recommendation, none made, each saying why."""
    return {n: Recommendation(value=None, why=why) for n in RECOMMENDATION_NAMES}


class Report(BaseModel):
    """A signed-off (or refused) acceptance run."""

    model_config = ConfigDict(extra="forbid")
    schema_version: Literal[3] = 3
    name: str
    verdict: Literal["GO", "NO-GO", "INCONCLUSIVE"]
    valid: bool
    complete: bool
    exit_code: int
    started_at: str
    finished_at: str
    target: dict[str, Any]
    criteria: list[CriterionResult]
    not_judged: list[dict[str, str]] = Field(
        default_factory=list,
        description="criteria the playbook set to null (globally or under a condition), each "
        "with the steps it covers and why; listed, never counted as met",
    )
    validity: list[ValidityResult]
    what_to_change: list[str] = Field(
        default_factory=list,
        description="what would change each failure (schema 1: the list under recommendations)",
    )
    recommendations: dict[str, Recommendation] = Field(
        default_factory=lambda: no_recommendations("not computed"),
        description="settings for the measured link and load: local_prefill_max_tokens, "
        "kv_streams, chunk_size_kb, codec, prefill_decode_ratio, congestion_control",
    )
    prediction_summary: dict[str, Any] | None = Field(
        default=None, description="steps predicted, unexplained, the compute fitted to the run"
    )
    steps: list[StepReport]
    formulas: dict[str, str]
    metric_names: dict[str, dict[str, str]] = Field(
        default_factory=dict,
        description="each latency metric's name in vllm bench serve, AIPerf, guidellm, MLPerf",
    )
    confidence: float = Field(
        default=0.0, description="judgement.confidence; 0 = criteria judged on point estimates"
    )
    preflight: dict[str, Any] | None = None
    playbook: dict[str, Any]
    environment: dict[str, Any]
    plots: list[str] = Field(default_factory=list, description="PNG files next to the report")
    problems: list[str] = Field(default_factory=list, description="why the run is incomplete")


def report_schema() -> dict[str, Any]:
    """JSON Schema of report.json."""
    schema = Report.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["$id"] = "https://pdx.dev/schemas/accept-report-v1.json"
    return schema


def write_schema(path: Path = SCHEMA_PATH) -> Path:
    """Regenerate the shipped schema file."""
    path.write_text(json.dumps(report_schema(), indent=2, sort_keys=True) + "\n")
    return path


def load_report(directory: Path | str) -> Report:
    """Read ``DIR/report.json`` (or a report.json path) and validate it."""
    p = Path(directory)
    p = p / "report.json" if p.is_dir() else p
    if not p.is_file():
        raise InputError("report", str(directory), "a report directory containing report.json")
    try:
        data = json.loads(p.read_text())
        if isinstance(data, dict) and data.get("schema_version") == 1:
            data = upgrade_v1(data)
        if isinstance(data, dict) and data.get("schema_version") == 2:
            data = dict(data, schema_version=3)  # 3 only adds fields and a result value
        return Report.model_validate(data)
    except ValueError as exc:
        raise InputError("report", str(p), f"a valid pdx report.json ({exc})") from None


def upgrade_v1(data: dict[str, Any]) -> dict[str, Any]:
    """A schema-1 report as schema 2: its list of changes moves to what_to_change."""
    out = dict(data, schema_version=3)
    old = out.pop("recommendations", None)
    out["what_to_change"] = list(old) if isinstance(old, list) else []
    out["recommendations"] = {
        k: v.model_dump() for k, v in no_recommendations("not in a schema 1 report").items()
    }
    return out


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
                    _RESULT_WORD.get(str(e.get("result")), str(e.get("result"))),
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
        f"unexplained ({where})." + (f" Not predicted: {missing}." if missing else "")
    )


def unexplained_lines(report: Report) -> list[str]:
    """Per unexplained step, the figures beyond the prediction."""
    from pdx.accept.prediction import explain

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


def _md_table(headers: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(out)


def _headline(report: Report) -> str:
    state = "" if report.complete else " (INCOMPLETE: interrupted or failed before the end)"
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


def _metric_names_md(report: Report) -> str:
    if not report.metric_names:
        return ""
    tools = list(next(iter(report.metric_names.values())))
    rows = [[m, *(names.get(t, "") for t in tools)] for m, names in report.metric_names.items()]
    return "\n\nThe same quantities in other tools:\n\n" + _md_table(["pdx", *tools], rows)


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
            )
        if sm.get("kv_objects") == 0:
            parts.append("KV held after request end: no KV object entered the store")
        elif sm.get("kv_objects") is not None:
            worst = sm.get("kv_stranded_worst") or {}
            parts.append(
                f"KV held after request end: max {sm.get('kv_stranded_max_s', 0):.3f} s over "
                f"{sm['kv_objects']} objects ({sm.get('kv_stranded_byte_s', 0):.4g} byte·s; "
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


def _fault_lines(report: Report) -> list[str]:
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
    return [
        f"- **{s.id}** ({s.network}): router hop, {how}: {k.get('summary', '-')}; during the "
        f"step {'; '.join(moved) or 'no counters'}; service: {s.summary.get('retries', 0)} "
        f"retries, {s.summary.get('degraded', 0)} degraded, {s.summary.get('failed', 0)} failed",
        *(f"  - `{dev}`: {text}" for dev, text in (k.get("qdiscs") or {}).items()),
    ]


def render_markdown(report: Report) -> str:
    """report.md: verdict, criteria, validity, steps, faults, plots, formulas."""
    parts = [
        f"# Acceptance report: {report.name}",
        f"**Verdict: {_headline(report)}**",
        f"Started {report.started_at}, finished {report.finished_at}. Target: "
        f"`{target_line(report)}`.",
    ]
    if report.problems:
        parts.append("Problems:\n" + "\n".join(f"- {p}" for p in report.problems))
    if report.what_to_change:
        parts.append("## What to change\n" + "\n".join(f"- {r}" for r in report.what_to_change))
    parts.append(
        "## Criteria\n"
        + statistics_line(report)
        + "\n\n"
        + _md_table(CRITERIA_HEADERS, criteria_rows(report))
        + "".join(f"\n\n{line}" for line in not_judged_lines(report))
    )
    invalid = [v for v in report.validity if not v.valid]
    parts.append(
        "## Validity\n"
        + (
            "\n".join(f"- {v.step}: {'; '.join(v.problems)}" for v in invalid)
            or "Every step ran long enough, with enough requests, at the load asked for."
        )
    )
    parts.append("## Steps\n" + _md_table(STEP_HEADERS, step_rows(report)))
    if report.prediction_summary:
        parts.append(
            "## Prediction vs measurement\n"
            + prediction_line(report)
            + "\n\n"
            + _md_table(PREDICTION_HEADERS, prediction_rows(report))
            + "".join(f"\n- {line}" for line in unexplained_lines(report))
        )
    if any(r.value is not None for r in report.recommendations.values()):
        parts.append(
            "## Recommended settings\n"
            + _md_table(["setting", "value", "why"], recommendation_rows(report))
        )
    gates = gate_lines(report)
    if gates:
        parts.append("## Gates: what the servers' own records show\n" + "\n".join(gates))
    faults = _fault_lines(report)
    if faults:
        parts.append("## Faults and how the service reacted\n" + "\n".join(faults))
    if report.preflight:
        lines = preflight_lines(report.preflight)
        parts.append("## Pre-flight\n" + "\n".join(lines))
        parts.append(
            "Pre-flight data:\n```json\n" + json.dumps(report.preflight, indent=2) + "\n```"
        )
    if report.plots:
        parts.append("## Plots\n" + "\n".join(f"![{p}]({p})" for p in report.plots))
    parts.append(
        "## Formulas\n"
        + "\n".join(f"- `{k}` = {v}" for k, v in report.formulas.items())
        + _metric_names_md(report)
    )
    return "\n\n".join(parts) + "\n"


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
        lines.append(f"- chunk sweep: {'; '.join(chunks)}; recommended {best} B")
    rules = [
        f"{r['name']} {r['status']} ({_num(r['measured'])} vs {_num(r['threshold'])} {r['unit']})"
        for r in s["rules"]
    ]
    demand = _num(s["kv_demand_gbps"], ".6f")
    lines.append(
        f"- link verdict **{s['verdict']}** for KV demand {demand} Gbps: {', '.join(rules)}"
    )
    return lines


def _css_class(cell: str) -> str:
    return "fail" if cell.startswith(("FAIL", "INVALID", "UNDECIDED", "BEYOND", "NOT MEAS")) else ""


def _html_table(headers: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join(
        "<tr>"
        + "".join(f'<td class="{_css_class(c)}">{html.escape(c)}</td>' for c in row)
        + "</tr>"
        for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


_CSS = """
body{font-family:system-ui,sans-serif;margin:2em;color:#222;max-width:1200px}
.verdict{font-size:2em;font-weight:bold;padding:.4em .6em;border-radius:6px;display:inline-block}
.GO{background:#d8f5d0;color:#185c0f}.NO-GO{background:#fbd5d5;color:#8a1010}
.INCONCLUSIVE{background:#fdf0c4;color:#6b4d00}
table{border-collapse:collapse;margin:1em 0;font-size:.9em}
td,th{border:1px solid #bbb;padding:.25em .5em;text-align:left}th{background:#eee}
td.fail{color:#8a1010;font-weight:bold}img{max-width:100%;border:1px solid #ddd;margin:.5em 0}
code{background:#f3f3f3;padding:0 .2em}
"""


def render_html(report: Report, images: dict[str, str]) -> str:
    """report.html: self-contained (CSS inline, plots as base64 PNG data URIs)."""
    esc = html.escape
    parts = [
        f"<h1>Acceptance report: {esc(report.name)}</h1>",
        f'<div id="verdict" class="verdict {esc(report.verdict)}">'
        f"Verdict: {esc(_headline(report))}</div>",
        f"<p>Started {esc(report.started_at)}, finished {esc(report.finished_at)}. Target: "
        f"<code>{esc(target_line(report))}</code></p>",
    ]
    if report.problems:
        parts.append("<ul>" + "".join(f"<li>{esc(p)}</li>" for p in report.problems) + "</ul>")
    if report.what_to_change:
        items = "".join(f"<li>{esc(r)}</li>" for r in report.what_to_change)
        parts.append(f"<h2>What to change</h2><ul>{items}</ul>")
    parts.append(
        f"<h2>Criteria</h2><p>{esc(statistics_line(report))}</p>"
        + _html_table(CRITERIA_HEADERS, criteria_rows(report))
        + "".join(f"<p>{esc(line)}</p>" for line in not_judged_lines(report))
    )
    invalid = [v for v in report.validity if not v.valid]
    items = "".join(f"<li>{esc(v.step)}: {esc('; '.join(v.problems))}</li>" for v in invalid)
    parts.append(
        "<h2>Validity</h2>" + (f"<ul>{items}</ul>" if items else "<p>All steps valid.</p>")
    )
    parts.append("<h2>Steps</h2>" + _html_table(STEP_HEADERS, step_rows(report)))
    if report.prediction_summary:
        items = "".join(f"<li>{esc(line)}</li>" for line in unexplained_lines(report))
        parts.append(
            f"<h2>Prediction vs measurement</h2><p>{esc(prediction_line(report))}</p>"
            + _html_table(PREDICTION_HEADERS, prediction_rows(report))
            + (f"<ul>{items}</ul>" if items else "")
        )
    if any(r.value is not None for r in report.recommendations.values()):
        parts.append(
            "<h2>Recommended settings</h2>"
            + _html_table(["setting", "value", "why"], recommendation_rows(report))
        )
    gates = gate_lines(report)
    if gates:
        items = "".join(f"<li>{esc(g.lstrip('- ').replace('**', ''))}</li>" for g in gates)
        parts.append(f"<h2>Gates: what the servers' own records show</h2><ul>{items}</ul>")
    faults = _fault_lines(report)
    if faults:
        items = "".join(f"<li>{esc(f.lstrip('- ').replace('**', ''))}</li>" for f in faults)
        parts.append(f"<h2>Faults and how the service reacted</h2><ul>{items}</ul>")
    if report.preflight:
        items = "".join(f"<li>{esc(line.lstrip('- ').replace('**', ''))}</li>"
                        for line in preflight_lines(report.preflight))  # fmt: skip
        parts.append(f'<h2>Pre-flight</h2><ul id="preflight">{items}</ul>')
    for name in report.plots:
        if name in images:
            parts.append(f'<h3>{esc(name)}</h3><img alt="{esc(name)}" src="{images[name]}">')
    items = "".join(
        f"<li><code>{esc(k)}</code> = {esc(v)}</li>" for k, v in report.formulas.items()
    )
    parts.append(f"<h2>Formulas</h2><ul>{items}</ul>")
    if report.metric_names:
        tools = list(next(iter(report.metric_names.values())))
        rows = [[m, *(n.get(t, "") for t in tools)] for m, n in report.metric_names.items()]
        parts.append(
            "<h3>The same quantities in other tools</h3>" + _html_table(["pdx", *tools], rows)
        )
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f"<title>pdx accept: {esc(report.name)} {esc(report.verdict)}</title>"
        f"<style>{_CSS}</style></head><body>{''.join(parts)}</body></html>\n"
    )


def write_report(report: Report, directory: Path, images: dict[str, str]) -> Path:
    """Write report.json, report.md and report.html into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "report.json").write_text(report.model_dump_json(indent=2) + "\n")
    (directory / "report.md").write_text(render_markdown(report))
    (directory / "report.html").write_text(render_html(report, images))
    return directory


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
            change = cb.measured - ca.measured
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
                "margin_change": cb.margin - ca.margin
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
