"""``pdx accept --repeat N``: the same playbook N times, and how much the runs agree.

Per (criterion, step): every run's measured value and interval, the across-run mean with its
Student t interval (what the repeat judges: pass when the whole t interval clears the
threshold) and the coefficient of variation. A row is unstable when the runs disagree beyond
what their own samples explain, tested per kind of figure and corrected for the number of rows
(Holm, at 1 − confidence), by at least ``judgement.repeat_tolerance`` of the threshold:

- rates (k of n): a χ² test of homogeneity (Fisher's exact test for two runs);
- rates per exposure (retries per transfer): a χ² test of the counts against the exposures;
- quantiles (p50, p99): the runs' per-request values against their pooled quantile (how many
  of each run fall above it), the same χ² / Fisher test; without the raw records, intervals
  that do not overlap;
- point values (the longest stranded KV, the idle ratio, the link verdict): compared with the
  threshold, not with each other — unstable only when some runs pass and others fail.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, Field
from scipy import stats as sps

from pdx.accept.judge.confidence import decide, mean_bounds
from pdx.accept.judge.criteria import CriterionResult, criterion_spec
from pdx.accept.judge.stats import read_records, samples
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
    mean_result: str | None = Field(
        default=None, description="the t interval of the mean against the threshold"
    )
    cv: float | None = Field(description="sample standard deviation / mean")
    test: str = Field(default="", description="how the runs were compared")
    p_value: float | None = Field(default=None, description="of that test, before correction")
    significant: bool = Field(
        default=False, description="the runs disagree beyond their sampling spread (Holm)"
    )
    unstable: bool = Field(
        description="significant, and the runs differ by at least judgement.repeat_tolerance "
        "of the threshold: enough to move the decision"
    )


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


def _table_p(table: np.ndarray) -> float:
    """p of homogeneity of a runs × 2 table (Fisher for two runs, χ² beyond)."""
    table = table[table.sum(axis=1) > 0]
    if len(table) < 2 or (table.sum(axis=0) == 0).any():
        return 1.0  # one run with data, or every run on the same side: nothing disagrees
    if len(table) == 2:
        return float(sps.fisher_exact(table.astype(int))[1])
    return float(sps.chi2_contingency(table)[1])


def _rate_p(found: list[CriterionResult]) -> float:
    k = np.array([round((c.measured or 0.0) * (c.sample or 0)) for c in found], dtype=float)
    n = np.array([c.sample or 0 for c in found], dtype=float)
    return _table_p(np.column_stack([k, n - k]))


def _poisson_p(found: list[CriterionResult]) -> float:
    k = np.array([(c.measured or 0.0) * (c.sample or 0) for c in found], dtype=float)
    n = np.array([c.sample or 0 for c in found], dtype=float)
    if k.sum() <= 0 or (n > 0).sum() < 2:
        return 1.0
    keep = n > 0
    expected = k[keep].sum() * n[keep] / n[keep].sum()
    return float(sps.chisquare(k[keep], expected)[1])


def _quantile_p(values: list[list[float]], q: float) -> float:
    pooled = np.quantile(np.concatenate([np.asarray(v, dtype=float) for v in values]), q)
    table = np.array([[sum(x > pooled for x in v), sum(x <= pooled for x in v)] for v in values])
    return _table_p(table.astype(float))


def _raw_values(dirs: list[Path], step: str, key: str) -> list[list[float]] | None:
    """Each run's per-request values behind a quantile criterion (None: a run lacks them)."""
    out = []
    for d in dirs:
        rows = read_records(d / "raw" / step) if (d / "raw" / step).is_dir() else []
        values = samples(rows).get(key) or []
        if not values:
            return None
        out.append(values)
    return out


_Q = {"p50": 0.5, "p99": 0.99}


def _compare(
    name: str, step: str, found: list[CriterionResult | None], dirs: list[Path]
) -> tuple[str, float | None, bool]:
    """(test, p value, unstable without a p value) for one row."""
    present = [c for c in found if c is not None and c.result != "not_measured"]
    if len(present) < 2:
        return "fewer than two runs measured it", None, False
    _, method, key = criterion_spec(name)
    if method == "proportion":
        return "homogeneity of k/n (Fisher / chi-square)", _rate_p(present), False
    if method == "poisson":
        return "counts against exposures (chi-square)", _poisson_p(present), False
    if method == "quantile":
        raw = _raw_values(
            [d for d, c in zip(dirs, found, strict=False) if c is not None], step, key
        )
        q = _Q.get(name.split("_")[1], 0.5)
        if raw is not None:
            return (
                "runs against the pooled quantile (Fisher / chi-square)",
                _quantile_p(raw, q),
                False,
            )
        return (
            "interval overlap (no raw records)",
            None,
            not _overlap([c.interval for c in present]),
        )
    sides = {c.result for c in present} & {"pass", "fail"}
    return "each run against the threshold", None, len(sides) > 1


def _holm(p_values: list[float | None], alpha: float) -> list[bool]:
    """Which tests reject at family-wise ``alpha`` (Holm's step-down; None never rejects)."""
    order = sorted((p, i) for i, p in enumerate(p_values) if p is not None)
    reject = [False] * len(p_values)
    m = len(order)
    for rank, (p, i) in enumerate(order):
        if p > alpha / (m - rank):
            break
        reject[i] = True
    return reject


def material(values: list[float], threshold: float | None, tolerance: float) -> bool:
    """The runs' spread is at least ``tolerance`` of the threshold (any spread for 0)."""
    if len(values) < 2:
        return False
    spread = max(values) - min(values)
    if threshold is None:
        return spread > 0
    return spread > 0 and spread >= tolerance * abs(threshold)


def summarize_runs(
    reports: list[Report], dirs: list[Path], confidence: float, tolerance: float = 0.1
) -> RepeatSummary:
    """Across-run statistics of every (criterion, step) and the combined verdict.

    A row is unstable when the runs disagree beyond their own sampling spread (Holm) *and*
    by at least ``tolerance`` of the threshold: on a shared machine whole runs differ by a
    few per cent that their large samples show as significant, and a difference that small
    against the threshold cannot change the decision.
    """
    keys: dict[tuple[str, str], str] = {}
    for r in reports:
        for c in r.criteria:
            keys.setdefault((c.name, c.step), c.unit)
    rows, p_values, flagged = [], [], []
    row_threshold: dict[tuple[str, str], float | None] = {}
    for (name, step), unit in keys.items():
        found = [next((c for c in r.criteria if (c.name, c.step) == (name, step)), None)
                 for r in reports]  # fmt: skip
        values = [c.measured if c else None for c in found]
        present = [v for v in values if v is not None]
        mean = float(np.mean(present)) if present else None
        sd = float(np.std(present, ddof=1)) if len(present) > 1 else None
        bounds = mean_bounds(present, confidence) if confidence > 0 else None
        threshold = next((c.threshold for c in found if c is not None), None)
        row_threshold[(name, step)] = threshold
        mean_result = None
        if bounds is not None and threshold is not None and len(present) > 1:
            mean_result = decide(bounds, threshold, criterion_spec(name)[0])
        test, p, by_rule = _compare(name, step, found, dirs)
        p_values.append(p)
        flagged.append(by_rule)
        rows.append(
            RepeatRow(
                criterion=name,
                step=step,
                unit=unit,
                measured=values,
                results=[c.result if c else "absent" for c in found],
                intervals=[c.interval if c else None for c in found],
                mean=mean,
                mean_interval=bounds.as_pair() if bounds else None,
                mean_result=mean_result,
                cv=(sd / mean) if sd is not None and mean else None,
                test=test,
                p_value=p,
                unstable=False,
            )
        )
    rejected = _holm(p_values, 1.0 - confidence if confidence > 0 else 0.05)
    for row, by_test, by_rule in zip(rows, rejected, flagged, strict=True):
        row.significant = by_test or by_rule
        present = [v for v in row.measured if v is not None]
        row.unstable = row.significant and (
            by_rule or material(present, row_threshold[(row.criterion, row.step)], tolerance)
        )
    unstable = sorted({r.step for r in rows if r.unstable})
    verdicts: list[str] = [r.verdict for r in reports]
    mean_results = {r.mean_result for r in rows}
    verdict: Verdict = (
        "NO-GO"
        if "NO-GO" in verdicts or "fail" in mean_results
        else "INCONCLUSIVE"
        if "INCONCLUSIVE" in verdicts or unstable or "indeterminate" in mean_results
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
                r.mean_result or "—",
                " / ".join(r.results),
                _agreement(r) + (f" (p={r.p_value:.2g})" if r.p_value is not None else ""),
            ]
        )
    return out


def _agreement(r: RepeatRow) -> str:
    if r.unstable:
        return "UNSTABLE"
    return "differs, within tolerance" if r.significant else "stable"


REPEAT_HEADERS = [
    "criterion", "step", "per run", "mean [t interval]", "CV", "t judged", "results", "runs"
]  # fmt: skip


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
