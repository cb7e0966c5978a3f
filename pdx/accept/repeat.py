"""``pdx accept --repeat N``: the same playbook N times, and how much the runs agree.

Per (criterion, step): every run's measured value and interval, the across-run mean with its
Student t interval and the coefficient of variation. A criterion whose runs' intervals do not
all overlap disagrees beyond what each run's sample explains: its step is flagged unstable.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, Field

from pdx.accept.confidence import mean_bounds
from pdx.accept.report import Report

Verdict = Literal["GO", "NO-GO", "INCONCLUSIVE"]


class RepeatRow(BaseModel):
    """One criterion on one step across the runs."""

    criterion: str
    step: str
    unit: str
    measured: list[float | None]
    results: list[str]
    intervals: list[tuple[float | None, float | None] | None]
    mean: float | None
    mean_interval: tuple[float | None, float | None] | None = Field(
        description="Student t bounds on the across-run mean at the run's confidence"
    )
    cv: float | None = Field(description="sample standard deviation / mean")
    unstable: bool = Field(description="the runs' intervals do not all overlap")


class RepeatSummary(BaseModel):
    """What ``--repeat`` writes to ``repeat.json``."""

    name: str
    runs: int
    confidence: float
    verdict: Verdict
    exit_code: int
    verdicts: list[str]
    reports: list[str] = Field(description="each run's report directory")
    rows: list[RepeatRow]
    unstable_steps: list[str]


def _overlap(intervals: list[tuple[float | None, float | None] | None]) -> bool:
    lows = [(-math.inf if i[0] is None else i[0]) for i in intervals if i is not None]
    highs = [(math.inf if i[1] is None else i[1]) for i in intervals if i is not None]
    return not lows or max(lows) <= min(highs)


def summarize_runs(reports: list[Report], dirs: list[Path], confidence: float) -> RepeatSummary:
    """Across-run statistics of every (criterion, step) and the combined verdict."""
    keys: dict[tuple[str, str], str] = {}
    for r in reports:
        for c in r.criteria:
            keys.setdefault((c.name, c.step), c.unit)
    rows = []
    for (name, step), unit in keys.items():
        found = [next((c for c in r.criteria if (c.name, c.step) == (name, step)), None)
                 for r in reports]  # fmt: skip
        values = [c.measured if c else None for c in found]
        present = [v for v in values if v is not None]
        mean = float(np.mean(present)) if present else None
        sd = float(np.std(present, ddof=1)) if len(present) > 1 else None
        bounds = mean_bounds(present, confidence) if confidence > 0 else None
        intervals = [c.interval if c else None for c in found]
        rows.append(
            RepeatRow(
                criterion=name,
                step=step,
                unit=unit,
                measured=values,
                results=[c.result if c else "absent" for c in found],
                intervals=intervals,
                mean=mean,
                mean_interval=bounds.as_pair() if bounds else None,
                cv=(sd / mean) if sd is not None and mean else None,
                unstable=not _overlap(intervals),
            )
        )
    unstable = sorted({r.step for r in rows if r.unstable})
    verdicts: list[str] = [r.verdict for r in reports]
    verdict: Verdict = (
        "NO-GO"
        if "NO-GO" in verdicts
        else "INCONCLUSIVE"
        if "INCONCLUSIVE" in verdicts or unstable
        else "GO"
    )
    return RepeatSummary(
        name=reports[0].name if reports else "",
        runs=len(reports),
        confidence=confidence,
        verdict=verdict,
        exit_code={"GO": 0, "NO-GO": 1, "INCONCLUSIVE": 3}[verdict],
        verdicts=verdicts,
        reports=[str(d) for d in dirs],
        rows=rows,
        unstable_steps=unstable,
    )


def write_summary(summary: RepeatSummary, directory: Path) -> Path:
    """``repeat.json`` in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "repeat.json"
    path.write_text(json.dumps(summary.model_dump(mode="json"), indent=2) + "\n")
    return path


def repeat_rows(summary: RepeatSummary) -> list[list[str]]:
    """Table rows: criterion, step, per-run values, mean [t interval], CV, stability."""

    def fmt(v: float | None) -> str:
        return "—" if v is None else f"{v:.4g}"

    out = []
    for r in summary.rows:
        interval = ""
        if r.mean_interval is not None:
            lo, hi = r.mean_interval
            interval = f" [{fmt(lo)}, {fmt(hi)}]"
        out.append(
            [
                r.criterion,
                r.step.split("-", 1)[0],
                " / ".join(fmt(v) for v in r.measured),
                fmt(r.mean) + interval,
                "—" if r.cv is None else f"{r.cv:.1%}",
                " / ".join(r.results),
                "UNSTABLE" if r.unstable else "stable",
            ]
        )
    return out


REPEAT_HEADERS = ["criterion", "step", "per run", "mean [t interval]", "CV", "results", "runs"]


def render_repeat(console: Any, summary: RepeatSummary) -> None:
    """Verdict over the runs, then the across-run table."""
    from rich.markup import escape
    from rich.table import Table

    colour = {"GO": "green", "INCONCLUSIVE": "yellow"}.get(summary.verdict, "red")
    unstable = ", ".join(summary.unstable_steps) or "none"
    console.print(
        f"[bold {colour}]{summary.verdict}[/] over {summary.runs} runs of {summary.name} "
        f"({', '.join(summary.verdicts)}); unstable steps: {unstable}"
    )
    t = Table(title="across runs", title_justify="left")
    for h in REPEAT_HEADERS:
        t.add_column(h)
    for row in repeat_rows(summary):
        t.add_row(*[escape(c) for c in row])
    console.print(t)
