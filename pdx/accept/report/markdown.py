"""report.md: the report as Markdown, verdict first, built from the rows and lines of
:mod:`pdx.accept.report.content`, with every formula stated at the end.
"""

from __future__ import annotations

import json

from pdx.accept.report.content import (
    CRITERIA_HEADERS,
    PREDICTION_HEADERS,
    STEP_HEADERS,
    _fault_lines,
    _headline,
    criteria_rows,
    gate_lines,
    not_judged_lines,
    prediction_line,
    prediction_rows,
    preflight_lines,
    recommendation_rows,
    statistics_line,
    step_rows,
    target_line,
    unexplained_lines,
)
from pdx.accept.report.schema import Report


def _md_table(headers: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(out)


def _metric_names_md(report: Report) -> str:
    if not report.metric_names:
        return ""
    tools = list(next(iter(report.metric_names.values())))
    rows = [[m, *(names.get(t, "") for t in tools)] for m, names in report.metric_names.items()]
    return "\n\nThe same quantities in other tools:\n\n" + _md_table(["pdx", *tools], rows)


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
