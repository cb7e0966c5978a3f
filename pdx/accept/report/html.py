"""report.html: the report as one self-contained HTML page (CSS inline, plots as data URIs),
built from the same rows and lines as report.md, with failing and undecided cells marked.
"""

from __future__ import annotations

import html

from pdx.accept.report import content as c
from pdx.accept.report.schema import Report


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
        f"Verdict: {esc(c.headline(report))}</div>",
        f"<p>Started {esc(report.started_at)}, finished {esc(report.finished_at)}. Target: "
        f"<code>{esc(c.target_line(report))}</code></p>",
    ]
    if report.problems:
        parts.append("<ul>" + "".join(f"<li>{esc(p)}</li>" for p in report.problems) + "</ul>")
    if report.what_to_change:
        items = "".join(f"<li>{esc(r)}</li>" for r in report.what_to_change)
        parts.append(f"<h2>What to change</h2><ul>{items}</ul>")
    parts.append(
        f"<h2>Criteria</h2><p>{esc(c.statistics_line(report))}</p>"
        + _html_table(c.CRITERIA_HEADERS, c.criteria_rows(report))
        + "".join(f"<p>{esc(line)}</p>" for line in c.not_judged_lines(report))
    )
    invalid = [v for v in report.validity if not v.valid]
    items = "".join(f"<li>{esc(v.step)}: {esc('; '.join(v.problems))}</li>" for v in invalid)
    parts.append(
        "<h2>Validity</h2>" + (f"<ul>{items}</ul>" if items else "<p>All steps valid.</p>")
    )
    for title, lines, headers, rows in c.extra_sections(report):
        paras = "".join(f"<p>{esc(line)}</p>" for line in lines)
        table = _html_table(headers, rows) if rows else ""
        parts.append(f"<h2>{esc(title)}</h2>{paras}{table}")
    parts.append("<h2>Steps</h2>" + _html_table(c.STEP_HEADERS, c.step_rows(report)))
    if report.prediction_summary:
        items = "".join(f"<li>{esc(line)}</li>" for line in c.unexplained_lines(report))
        parts.append(
            f"<h2>Prediction vs measurement</h2><p>{esc(c.prediction_line(report))}</p>"
            + _html_table(c.PREDICTION_HEADERS, c.prediction_rows(report))
            + (f"<ul>{items}</ul>" if items else "")
        )
    if any(r.value is not None for r in report.recommendations.values()):
        parts.append(
            "<h2>Recommended settings</h2>"
            + _html_table(["setting", "value", "why"], c.recommendation_rows(report))
        )
    gates = c.gate_lines(report)
    if gates:
        items = "".join(f"<li>{esc(g.lstrip('- ').replace('**', ''))}</li>" for g in gates)
        parts.append(f"<h2>Gates: what the servers' own records show</h2><ul>{items}</ul>")
    faults = c.fault_lines(report)
    if faults:
        items = "".join(f"<li>{esc(f.lstrip('- ').replace('**', ''))}</li>" for f in faults)
        parts.append(f"<h2>Faults and how the service reacted</h2><ul>{items}</ul>")
    if report.preflight:
        items = "".join(f"<li>{esc(line.lstrip('- ').replace('**', ''))}</li>"
                        for line in c.preflight_lines(report.preflight))  # fmt: skip
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
