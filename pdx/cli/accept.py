"""``pdx accept PLAYBOOK`` and ``pdx report show|diff``: thin commands over :mod:`pdx.accept`."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import typer

from pdx.cli.output import emit, err_console
from pdx.errors import InputError


def accept(
    playbook: Path = typer.Argument(..., help="playbook YAML (see playbooks/)"),
    out: Path = typer.Option(Path("reports"), "--out", help="directory that receives the report"),
    set_: list[str] = typer.Option(
        [],
        "--set",
        help="override any playbook field by dotted path, e.g. criteria.ttft_p99_ms=500",
    ),
    as_json: bool = typer.Option(False, "--json", help="print report.json instead of a summary"),
    no_progress: bool = typer.Option(
        False,
        "--no-progress",
        help="nothing on stderr while it runs: no bar, no progress lines (one per stage and "
        "step, time-stamped, printed also when stderr is not a terminal)",
    ),
    repeat: int = typer.Option(
        1, "--repeat", min=1, max=100, help="run the playbook N times; judge how the runs agree"
    ),
    search: str | None = typer.Option(
        None,
        "--search",
        help="find the limit of rate, concurrency, rtt_ms, loss or bandwidth_mbps (the bracket "
        "from the last GO to the first NO-GO), or the router.offload.threshold_tokens with the "
        "best goodput at the least egress; sets search.param",
    ),
    search_range: str | None = typer.Option(
        None, "--search-range", metavar="LO:HI", help="the range searched (search.range)"
    ),
    search_resolution: float | None = typer.Option(
        None, "--search-resolution", help="stop when the bracket is this narrow"
    ),
    search_budget_s: float | None = typer.Option(
        None, "--search-budget-s", help="wall time the probes may take (search.budget_s)"
    ),
    baseline: str | None = typer.Option(
        None,
        "--baseline",
        help="colocated: run each step again with every request prefilled "
        "locally and put the split beside it (sets baseline)",
    ),
) -> None:
    """Run a playbook: deploy or target, load, inject faults, judge.

    Exit 0 GO, 1 NO-GO, 3 INCONCLUSIVE (the sample cannot decide a criterion), 2 could not run.
    With --search: 0 a limit was found (or the whole range is GO), 1 NO-GO already at the
    range's good end, 3 no limit decided (undecided probes, budget spent).
    """
    from pdx.accept.playbook import load_playbook

    dotted = [*set_, *_search_overrides(search, search_range, search_resolution, search_budget_s)]
    if baseline is not None:
        dotted.append(f"baseline={baseline}")
    pb = load_playbook(playbook, dotted=dotted)
    if pb.search.param is not None:
        if repeat > 1:
            raise InputError("--repeat", str(repeat), "1 with --search (each probe is a run)")
        _search(pb, playbook, out, as_json=as_json, no_progress=no_progress)
    if repeat > 1:
        _repeat(pb, playbook, out, repeat, as_json=as_json, no_progress=no_progress)
    run = _run_once(pb, playbook, out, no_progress)
    assert run.report is not None
    _verdict_line(run.report, run.report_dir, as_json=as_json, no_progress=no_progress)
    emit(run.report, as_json=as_json, render=lambda c, r: _render_summary(c, r, run.report_dir))
    raise typer.Exit(run.report.exit_code)


def _search_overrides(
    param: str | None, span: str | None, resolution: float | None, budget_s: float | None
) -> list[str]:
    """The --search options as playbook overrides (search.*), checked where YAML cannot."""
    out = [] if param is None else [f"search.param={param}"]
    if span is not None:
        lo, sep, hi = span.partition(":")
        try:
            out.append(f"search.range=[{float(lo)!r}, {float(hi)!r}]")
        except ValueError:
            raise InputError("--search-range", span, "LO:HI, two numbers, e.g. 2:40") from None
        if not sep:
            raise InputError("--search-range", span, "LO:HI, two numbers, e.g. 2:40")
    if resolution is not None:
        out.append(f"search.resolution={resolution!r}")
    if budget_s is not None:
        out.append(f"search.budget_s={budget_s!r}")
    return out


def _search(pb: Any, playbook: Path, out: Path, *, as_json: bool, no_progress: bool) -> None:
    """``--search PARAM``: probes until the bracket is narrow; the report holds every one."""
    import asyncio

    from pdx.accept.search.limit import THRESHOLD, limit_text
    from pdx.accept.search.run import SearchRun
    from pdx.accept.search.threshold import ThresholdSearch

    def on_probe(p: Any, ctx: dict[str, Any]) -> None:
        if no_progress:
            return
        ratio = f", {p.binding} at {p.worst_ratio:.2f}× its threshold" if p.binding else ""
        why = f" ({', '.join(p.failed or p.undecided)})" if p.verdict != "GO" else ""
        err_console().print(
            f"probe {p.step}: {ctx['param']} {p.value:g}"
            f"{' (confirmation)' if p.confirmation else ''} → {p.verdict}{why}{ratio}; "
            f"{p.requests} requests, {p.wall_s:.0f} s",
            soft_wrap=True,
            markup=False,
            highlight=False,
        )

    kind = ThresholdSearch if pb.search.param == THRESHOLD else SearchRun
    run = kind(pb, playbook, out, on_probe, None if no_progress else stage_line)
    try:
        asyncio.run(run.execute())
    except (KeyboardInterrupt, asyncio.CancelledError):
        where = f"; partial report: {run.report_dir}" if run.report else ""
        typer.echo(f"interrupted ({run.interrupted_by}){where}", err=True)
        raise typer.Exit(143 if run.interrupted_by == "SIGTERM" else 130) from None
    report = run.report
    assert report is not None
    _verdict_line(report, run.report_dir, as_json=as_json, no_progress=no_progress)

    def render(console: Any, r: Any) -> None:
        for s in r.search or []:
            console.print(limit_text(s), soft_wrap=True, markup=False, highlight=False)
        console.print(f"report: {run.report_dir}/report.html")

    emit(report, as_json=as_json, render=render)
    raise typer.Exit(report.exit_code)


def _run_once(pb: Any, playbook: Path, out: Path, no_progress: bool) -> Any:
    """One AcceptRun to completion; Ctrl-C / SIGTERM exit 130 / 143 with a partial report."""
    import asyncio

    from pdx.accept.run import AcceptRun

    # the bar on a terminal only: elsewhere the stage lines say what it would
    progress = _Progress() if not no_progress and err_console().is_terminal else None
    run = AcceptRun(
        pb,
        playbook,
        out,
        progress.update if progress else None,
        None if no_progress else stage_line,
    )
    try:
        if progress:
            progress.start(run)
        asyncio.run(run.execute())
    except (KeyboardInterrupt, asyncio.CancelledError):
        if progress:
            progress.stop()
        where = f"; partial report: {run.report_dir}" if run.report else ""
        typer.echo(f"interrupted ({run.interrupted_by}){where}", err=True)
        raise typer.Exit(143 if run.interrupted_by == "SIGTERM" else 130) from None
    finally:
        if progress:
            progress.stop()
    return run


def _repeat(
    pb: Any, playbook: Path, out: Path, times: int, *, as_json: bool, no_progress: bool
) -> None:
    """``--repeat N``: N full runs under one directory, then their agreement."""
    from pdx.accept.judge.repeat import render_repeat, summarize_runs, write_summary
    from pdx.accept.run import report_dir_for

    root = report_dir_for(out, f"{pb.name}-repeat")
    reports, dirs = [], []
    for i in range(times):
        run = _run_once(pb, playbook, root, no_progress)
        assert run.report is not None
        reports.append(run.report)
        dirs.append(run.report_dir)
        if not as_json:
            err_console().print(f"run {i + 1}/{times}: {run.report.verdict} ({run.report_dir})")
    summary = summarize_runs(reports, dirs, pb.judgement.confidence, pb.judgement.repeat_tolerance)
    path = write_summary(summary, root)

    def render(console: Any, data: Any) -> None:
        render_repeat(console, data)
        console.print(f"summary: {path}")

    emit(summary, as_json=as_json, render=render)
    raise typer.Exit(summary.exit_code)


def stage_line(line: str) -> None:
    """One progress line on stderr (time-stamped; above the bar on a terminal), so scripts
    and CI logs see a run move: target, pre-flight, each step's start and end."""
    err_console().print(
        f"{time.strftime('%H:%M:%S')} {line}", markup=False, highlight=False, soft_wrap=True
    )


def _verdict_line(report: Any, directory: Path, *, as_json: bool, no_progress: bool) -> None:
    """The verdict on stderr where stdout will not show it (``--json``, or not a terminal)."""
    if no_progress or not (as_json or not sys.stderr.isatty()):
        return
    stage_line(f"verdict: {report.verdict} (exit {report.exit_code}); report: {directory}")


class _Progress:
    """Rich progress over the matrix (stderr), with ETA from the planned step durations."""

    def __init__(self) -> None:
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        self.bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TimeRemainingColumn(),
            console=err_console(),
            transient=True,
        )
        self.task: Any = None
        self.done_before: dict[int, float] = {}

    def start(self, run: Any) -> None:
        acc = 0.0
        for s in run.steps:
            self.done_before[s.index] = acc
            acc += s.duration_s
        self.task = self.bar.add_task(f"{run.pb.name}", total=run.total_s)
        self.bar.start()

    def update(self, index: int, step: Any, seconds: float) -> None:
        n = len(self.done_before)
        self.bar.update(
            self.task,
            completed=self.done_before[index] + seconds,
            description=f"step {index + 1}/{n} {step.id}",
        )

    def stop(self) -> None:
        self.bar.stop()


def _render_summary(console: Any, report: Any, directory: Path) -> None:
    from pdx.accept.report.show import render_report

    render_report(console, report)
    console.print(f"report: {directory}/report.html")


def show(directory: Path = typer.Argument(..., help="a report directory")) -> None:
    """Summarise a report in the terminal: verdict, criteria, steps."""
    from pdx.accept.report import load_report
    from pdx.accept.report.show import render_report

    report = load_report(directory)
    emit(report, as_json=False, render=render_report)


def diff(
    a: Path = typer.Argument(..., help="the earlier report directory"),
    b: Path = typer.Argument(..., help="the later report directory"),
    as_json: bool = typer.Option(False, "--json", help="print the rows as JSON"),
) -> None:
    """Per criterion and step: what changed between report A and report B (measured value,
    threshold, margin, result), then the prediction errors and the recommended settings."""
    from pdx.accept.report import (
        diff_predictions,
        diff_recommendations,
        diff_reports,
        diff_searches,
        load_report,
        smallest_margin,
    )
    from pdx.accept.report.show import render_diff

    ra, rb = load_report(a), load_report(b)
    data = {
        "a": {"verdict": ra.verdict, "name": ra.name},
        "b": {"verdict": rb.verdict, "name": rb.name},
        "rows": diff_reports(ra, rb),
        "smallest_margin": {"a": smallest_margin(ra), "b": smallest_margin(rb)},
        "predictions": diff_predictions(ra, rb),
        "recommendations": diff_recommendations(ra, rb),
        "searches": diff_searches(ra, rb),
    }
    emit(data, as_json=as_json, render=render_diff)


def register(app: typer.Typer) -> None:
    """Add ``accept`` and the ``report`` group."""
    app.command("accept")(accept)
    report = typer.Typer(help="Read acceptance reports.", no_args_is_help=True)
    report.command("show")(show)
    report.command("diff")(diff)
    app.add_typer(report, name="report")
