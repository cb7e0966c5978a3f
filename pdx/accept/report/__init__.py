"""The acceptance report, written as report.json, report.md and report.html: the schema and its
loading (:mod:`.schema`), the shared rows and lines (:mod:`.content`), the Markdown and HTML
renderings (:mod:`.markdown`, :mod:`.html`), writing a report directory (:mod:`.write`) and the
comparison of two reports (:mod:`.diff`). This module re-exports what the rest of pdx uses.
"""

from pdx.accept.report.content import (
    CRITERIA_HEADERS,
    PREDICTION_HEADERS,
    criteria_rows,
    extra_sections,
    headline,
    not_judged_lines,
    prediction_line,
    prediction_rows,
    preflight_lines,
    recommendation_rows,
    statistics_line,
    unexplained_lines,
)
from pdx.accept.report.diff import (
    diff_predictions,
    diff_recommendations,
    diff_reports,
    diff_searches,
    smallest_margin,
)
from pdx.accept.report.schema import (
    RECOMMENDATION_NAMES,
    SCHEMA_PATH,
    SCHEMA_VERSION,
    Recommendation,
    Report,
    StepReport,
    load_report,
    no_recommendations,
    report_schema,
)
from pdx.accept.report.write import write_report

__all__ = [
    "CRITERIA_HEADERS",
    "PREDICTION_HEADERS",
    "RECOMMENDATION_NAMES",
    "SCHEMA_PATH",
    "SCHEMA_VERSION",
    "Recommendation",
    "Report",
    "StepReport",
    "criteria_rows",
    "diff_predictions",
    "diff_recommendations",
    "diff_reports",
    "diff_searches",
    "extra_sections",
    "headline",
    "load_report",
    "no_recommendations",
    "not_judged_lines",
    "prediction_line",
    "prediction_rows",
    "preflight_lines",
    "recommendation_rows",
    "report_schema",
    "smallest_margin",
    "statistics_line",
    "unexplained_lines",
    "write_report",
]
