"""report.md: the report as Markdown, verdict first, built from the rows and lines of
:mod:`pdx.accept.report.content`, with every formula stated at the end.
"""

from __future__ import annotations

import json

from pdx.accept.report import content as c
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
        f"**Verdict: {c.headline(report)}**",
        f"Started {report.started_at}, finished {report.finished_at}. Target: "
        f"`{c.target_line(report)}`.",
    ]
    if report.problems:
        parts.append("Problems:\n" + "\n".join(f"- {p}" for p in report.problems))
    if report.what_to_change:
        parts.append("## What to change\n" + "\n".join(f"- {r}" for r in report.what_to_change))
    parts.append(
        "## Criteria\n"
        + c.statistics_line(report)
        + "\n\n"
        + _md_table(c.CRITERIA_HEADERS, c.criteria_rows(report))
        + "".join(f"\n\n{line}" for line in c.not_judged_lines(report))
    )
    invalid = [v for v in report.validity if not v.valid]
    parts.append(
        "## Validity\n"
        + (
            "\n".join(f"- {v.step}: {'; '.join(v.problems)}" for v in invalid)
            or "Every step ran long enough, with enough requests, at the load asked for."
        )
    )
    for title, lines, headers, rows in c.extra_sections(report):
        body = "\n\n".join(lines)
        parts.append(f"## {title}\n{body}" + (f"\n\n{_md_table(headers, rows)}" if rows else ""))
    parts.append("## Steps\n" + _md_table(c.STEP_HEADERS, c.step_rows(report)))
    if report.prediction_summary:
        parts.append(
            "## Prediction vs measurement\n"
            + c.prediction_line(report)
            + "\n\n"
            + _md_table(c.PREDICTION_HEADERS, c.prediction_rows(report))
            + "".join(f"\n- {line}" for line in c.unexplained_lines(report))
        )
    if any(r.value is not None for r in report.recommendations.values()):
        parts.append(
            "## Recommended settings\n"
            + _md_table(["setting", "value", "why"], c.recommendation_rows(report))
        )
    gates = c.gate_lines(report)
    if gates:
        parts.append("## Gates: what the servers' own records show\n" + "\n".join(gates))
    faults = c.fault_lines(report)
    if faults:
        parts.append("## Faults and how the service reacted\n" + "\n".join(faults))
    if report.preflight:
        lines = c.preflight_lines(report.preflight)
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
