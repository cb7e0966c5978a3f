"""Terminal rendering of reports and report diffs (rich tables)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from pdx.accept.report import Report
from pdx.accept.report import content as c
from pdx.accept.report.diff import difference


def _mark(cell: str) -> str:
    text = escape(cell)
    if cell.startswith(("FAIL", "INVALID", "BEYOND")):
        return f"[bold red]{text}[/]"
    if cell.startswith(("UNDECIDED", "NOT MEASURED")):
        return f"[bold yellow]{text}[/]"
    return text


def _table(title: str, headers: list[str], rows: list[list[str]]) -> Table:
    t = Table(title=title, title_justify="left")
    for h in headers:
        t.add_column(h)
    for row in rows:
        t.add_row(*[_mark(c) for c in row])
    return t


_COMPACT = [
    "step",
    "validity",
    "reqs",
    "TTFT p50",
    "TTFT p99",
    "TPOT p99",
    "xfer p99",
    "errors",
    "degraded",
    "retries",
    "req/s",
    "KV held s",
]


def _num(value: Any) -> str:
    return "—" if value is None else f"{value:.4g}"


def _compact_rows(report: Report, short: dict[str, str]) -> list[list[str]]:
    rows = []
    for st in report.steps:
        sm = st.summary
        rows.append(
            [
                short[st.id],
                "valid" if st.valid else "INVALID",
                str(sm.get("requests", 0)),
                _num((sm.get("ttft_ms") or {}).get("p50")),
                _num((sm.get("ttft_ms") or {}).get("p99")),
                _num((sm.get("tpot_ms") or {}).get("p99")),
                _num((sm.get("transfer_ms") or {}).get("p99")),
                str(sm.get("failed", 0)),
                str(sm.get("degraded", 0)),
                str(sm.get("retries", 0)),
                _num(sm.get("achieved_rps")),
                _num(sm.get("kv_stranded_max_s")),
            ]
        )
    return rows


def render_report(console: Console, report: Report) -> None:
    """Verdict first, then criteria, steps and what to change."""
    colour = {"GO": "green", "INCONCLUSIVE": "yellow"}.get(report.verdict, "red")
    console.print(f"[bold {colour}]{c.headline(report)}[/]  ({report.name})")
    for p in report.problems:
        console.print(f"problem: {p}")
    for title, lines, headers, rows in c.extra_sections(report):
        console.print(f"[bold]{escape(title)}[/]")
        for line in lines:
            console.print(line, markup=False, highlight=False)
        if rows:
            console.print(_table("", headers, rows))
    short = {st.id: st.id.split("-", 1)[0] for st in report.steps}
    crit = [[r[0], short.get(r[1], r[1]), *r[2:]] for r in c.criteria_rows(report)]
    console.print(_table("criteria", c.CRITERIA_HEADERS, crit))
    console.print(c.statistics_line(report), markup=False, highlight=False)
    for line in c.not_judged_lines(report):
        console.print(line, markup=False, highlight=False)
    console.print(_table("steps (ms unless stated)", _COMPACT, _compact_rows(report, short)))
    for full, brief in short.items():
        console.print(f"{brief} = {full}")
    for st in report.steps:
        for why in st.summary.get("gates_not_measured") or []:
            console.print(f"{short[st.id]}: not judged: {why}", markup=False, highlight=False)
    if report.prediction_summary:
        rows = c.prediction_rows(report, short=True)
        console.print(_table("prediction vs measurement (ms)", c.PREDICTION_HEADERS, rows))
        console.print(c.prediction_line(report), markup=False, highlight=False)
        for line in c.unexplained_lines(report):
            console.print(line, markup=False, highlight=False)
    if any(r.value is not None for r in report.recommendations.values()):
        t = Table(title="recommended settings", title_justify="left")
        for h in ("setting", "value", "why"):
            t.add_column(h, overflow="fold")
        for row in c.recommendation_rows(report):
            t.add_row(*(escape(c) for c in row))
        console.print(t)
    for r in report.what_to_change:
        console.print(f"- {r}", markup=False, highlight=False)
    if report.preflight:
        console.print("pre-flight:")
        for line in c.preflight_lines(report.preflight):
            console.print(line.replace("**", ""), markup=False, highlight=False)


def _short_step(step_id: str) -> str:
    parts = step_id.split("-", 4)
    return f"{parts[0]} {parts[-1]}" if len(parts) == 5 else step_id


def shown_change(a: float | None, b: float | None, change: float | None) -> float | None:
    """The change between A and B as the table shows them (4 significant digits each): a
    difference the shown figures do not carry (0.9990001 → 1, "change 0.0009999") is not
    printed as if they did."""
    if a is None or b is None or change is None:
        return change
    return difference(float(f"{a:.4g}"), float(f"{b:.4g}"))


def render_diff(console: Console, data: dict[str, Any]) -> None:
    """One row per (criterion, step) with A, B, the change and pass/fail movement."""
    a, b = data["a"], data["b"]
    console.print(f"A: {a['name']} {a['verdict']}  →  B: {b['name']} {b['verdict']}")
    t = Table()
    for h in ("criterion", "step", "A", "B", "change", "threshold A→B", "margin A→B", "status"):
        t.add_column(h)
    fmt = lambda v: "—" if v is None else f"{v:.4g}"  # noqa: E731
    for r in data["rows"]:
        t.add_row(
            r["criterion"],
            _short_step(r["step"]),
            fmt(r["a_measured"]),
            fmt(r["b_measured"]),
            fmt(shown_change(r["a_measured"], r["b_measured"], r["change"])),
            f"{fmt(r['a_threshold'])}→{fmt(r['b_threshold'])}",
            f"{fmt(r.get('a_margin'))}→{fmt(r.get('b_margin'))}",
            r["status"],
        )
    console.print(t)
    for r in data.get("searches") or []:
        route = f" ({r['route']})" if r.get("route") else ""
        console.print(
            f"search {r['param']} under {r['condition']}{route}: limit A {fmt(r['a_limit'])} "
            f"{r['a_bracket']} → B {fmt(r['b_limit'])} {r['b_bracket']}: {r['status']}",
            markup=False,
            highlight=False,
        )
    small = data.get("smallest_margin") or {}
    if small.get("a") or small.get("b"):

        def one(m: dict[str, Any] | None) -> str:
            if not m:
                return "—"
            return f"{m['margin_pct']:.0f} % ({m['criterion']} of {_short_step(m['step'])})"

        console.print(
            f"smallest margin, share of its threshold: A {one(small.get('a'))} → "
            f"B {one(small.get('b'))}",
            markup=False,
            highlight=False,
        )
    _render_prediction_diff(console, data.get("predictions") or [])
    _render_recommendation_diff(console, data.get("recommendations") or [])


def _render_prediction_diff(console: Console, rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    t = Table(title="prediction error (measured vs predicted)", title_justify="left")
    for h in ("step", "metric", "error A", "error B", "result A→B"):
        t.add_column(h)
    pct = lambda v: "—" if v is None else f"{v:+.1f} %"  # noqa: E731
    for r in rows:
        t.add_row(
            _short_step(r["step"]),
            r["metric"],
            pct(r.get("a_error_pct")),
            pct(r.get("b_error_pct")),
            f"{r.get('a_result')}→{r.get('b_result')}",
        )
    console.print(t)


def _render_recommendation_diff(console: Console, rows: list[dict[str, Any]]) -> None:
    if not any(r["a_value"] is not None or r["b_value"] is not None for r in rows):
        return
    t = Table(title="recommendations", title_justify="left")
    for h in ("setting", "A", "B", "changed"):
        t.add_column(h)
    for r in rows:
        t.add_row(r["name"], str(r["a_value"]), str(r["b_value"]), "yes" if r["changed"] else "")
    console.print(t)
