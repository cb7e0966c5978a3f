"""Writing a report directory: report.json, report.md and report.html side by side."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

from pdx import __version__
from pdx.accept.report.html import render_html
from pdx.accept.report.markdown import render_markdown
from pdx.accept.report.schema import Report


def write_report(report: Report, directory: Path, images: dict[str, str]) -> Path:
    """Write report.json, report.md and report.html into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "report.json").write_text(report.model_dump_json(indent=2) + "\n")
    (directory / "report.md").write_text(render_markdown(report))
    (directory / "report.html").write_text(render_html(report, images))
    return directory


def environment() -> dict[str, Any]:
    """What the report says of the machine and pdx that ran it."""
    return {
        "pdx_version": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
    }
