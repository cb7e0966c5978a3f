"""What probe-link recommends for ``pdx deploy`` agrees with what it measured: the fewest
streams its own 1- and N-stream goodput shows are needed, a chunk size that passes its own
chunk rule, and the figures behind each."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import pytest
from rich.console import Console

from pdx.cli.probe import render_report
from pdx.link.chunks import choose_chunk
from pdx.link.probe import recommend, stream_advice
from pdx.link.stats import mean_ci95
from pdx.link.verdict import VerdictRules, judge

# A user's probe of a 20 ms RTT, 0.2 % loss link (Gbit/s, 95 % interval of the mean)
USER_RUNS = [
    ("up", 1, 0.560, [0.544, 0.576]),
    ("up", 4, 0.952, [0.910, 0.994]),
    ("down", 1, 0.626, [0.606, 0.646]),
    ("down", 4, 0.960, [0.917, 1.003]),
]
USER_SWEEP = [
    {"chunk_bytes": 256 << 10, "gbps": 0.110, "p50_ms": 33.9, "p99_ms": 47.8, "count": 54},
    {"chunk_bytes": 1 << 20, "gbps": 0.340, "p50_ms": 49.1, "p99_ms": 56.8, "count": 42},
    {"chunk_bytes": 2 << 20, "gbps": 0.534, "p50_ms": 58.6, "p99_ms": 90.5, "count": 33},
    {"chunk_bytes": 4 << 20, "gbps": 0.631, "p50_ms": 104.0, "p99_ms": 122.7, "count": 20},
    {"chunk_bytes": 8 << 20, "gbps": 0.450, "p50_ms": 180.6, "p99_ms": 317.9, "count": 7},
]


def _runs(rows: list[tuple[str, int, float, list[float] | None]]) -> list[dict[str, Any]]:
    return [{"direction": d, "streams": n, "gbps": g, "ci95_gbps": ci,
             "intervals_gbps": [g] * 50} for d, n, g, ci in rows]  # fmt: skip


def _report(rows: list[tuple[str, int, float, list[float] | None]]) -> dict[str, Any]:
    runs = _runs(rows)
    best = {d: max(r["gbps"] for r in runs if r["direction"] == d) for d in ("up", "down")}
    return {
        "target": "10.77.1.1:5301",
        "settings": {"sample_interval_s": 0.1},
        "rtt_ms": {"p50": 20.5, "p99": 22.3},
        "loss": {"up": 0.2, "down": 0.2},
        "throughput": {
            "up_gbps": best["up"],
            "down_gbps": best["down"],
            "runs": runs,
            "ci95_pct": 4.4,
            "converged": True,
        },
        "tcp": {"single_stream": {}},
        "chunks": [],
        "chunk_recommended_bytes": None,
    }


def test_the_users_link_gets_the_streams_its_own_table_shows_are_needed() -> None:
    rec = recommend(_report(USER_RUNS), kv_direction="up")
    assert rec is not None
    assert rec["set"]["kv.streams"] == 4  # one stream reaches 0.560 of 0.952: not "fills it"
    why = rec["why"]
    assert why.startswith("×4: the fewest streams within 5% of the best goodput measured up")
    assert "up ×1 0.560 [0.544-0.576], ×4 0.952 [0.910-0.994] Gbit/s → ×4" in why
    assert "down (not the KV direction) ×1 0.626 [0.606-0.646], ×4 0.960" in why
    assert "95 % CI of a test's mean over its 50 0.1 s samples" in why
    assert "more than ×4 was not measured (--streams)" in why
    up = rec["streams"]["by_direction"]["up"]
    assert up["streams"] == 4 and up["best_gbps"] == 0.952
    assert up["runs"][0] == {"streams": 1, "gbps": 0.560, "ci95_gbps": [0.544, 0.576],
                             "samples": 50}  # fmt: skip


@pytest.mark.parametrize(
    ("one", "streams"),
    [(0.905, 1), (0.904, 4)],  # within 5 % of 0.952 is 0.9044 or more
)
def test_one_stream_within_five_percent_of_the_best_is_enough(one: float, streams: int) -> None:
    rows = [("up", 1, one, None), ("up", 4, 0.952, None)]
    assert stream_advice(_runs(rows), "up")["streams"] == streams


def test_the_kv_direction_decides_which_direction_counts() -> None:
    rows = [("up", 1, 0.95, [0.93, 0.97]), ("up", 4, 0.96, [0.94, 0.98]),
            ("down", 1, 0.50, [0.48, 0.52]), ("down", 4, 0.96, [0.93, 0.99])]  # fmt: skip
    runs = _runs(rows)
    assert stream_advice(runs, "up")["streams"] == 1
    assert stream_advice(runs, "down")["streams"] == 4
    both = stream_advice(runs, "both")
    assert both["streams"] == 4  # the larger count: both directions carry KV
    assert "measured up and down (the KV direction, --kv-direction both)" in both["why"]
    assert "(not the KV direction)" in stream_advice(runs, "up")["why"]


def test_an_interval_comes_from_the_samples_when_a_run_lacks_one() -> None:
    samples = [0.5, 0.6, 0.55, 0.58, 0.52]
    runs = [{"direction": "up", "streams": 1, "gbps": 0.55, "intervals_gbps": samples},
            {"direction": "up", "streams": 4, "gbps": 0.9}]  # fmt: skip
    advice = stream_advice(runs, "up")
    ci = mean_ci95(samples)
    figures = advice["by_direction"]["up"]["runs"]
    assert figures[0]["ci95_gbps"] == pytest.approx([ci.low, ci.high])
    assert figures[1]["ci95_gbps"] is None and figures[1]["samples"] is None
    assert "a figure without one is a single mean, with no interval" in advice["why"]


def test_no_runs_no_stream_advice() -> None:
    report = _report(USER_RUNS)
    report["throughput"]["runs"] = []
    rec = recommend(report, kv_direction="up")
    assert rec is not None and "kv.streams" not in rec["set"]
    assert "kv.streams not advised" in rec["why"]


def _judged(budget_ms: float | None) -> dict[str, Any]:
    """The user's report as probe-link assembles it: chunk choice, recommendation, verdict."""
    rules = VerdictRules(kv_gbps=0.3, ttft_budget_ms=budget_ms, kv_direction="up")
    report = _report(USER_RUNS) | {"chunks": USER_SWEEP}
    report["chunk_recommended_bytes"] = choose_chunk(
        USER_SWEEP, max_p99_ms=rules.chunk_p99_limit_ms
    )
    report["recommendations"] = recommend(report, "up", rules.chunk_p99_limit_ms)
    report["verdict"] = asdict(judge(report, rules))
    return report


def test_the_recommended_chunk_passes_the_verdicts_own_rule() -> None:
    report = _judged(500)
    rec = report["recommendations"]
    assert rec["set"]["kv.chunk_size_kb"] == 1024  # not 4096, which misses 75 ms
    chunk_rule = next(r for r in report["verdict"]["rules"] if r["name"] == "chunk_p99")
    assert chunk_rule["status"] == "pass" and chunk_rule["measured"] == 56.8
    recommended = [s["chunk_bytes"] for s in chunk_rule["sizes"] if s["recommended"]]
    assert recommended == [report["chunk_recommended_bytes"]] == [1 << 20]
    why = rec["chunk"]["why"]
    assert why.startswith("1.0 MiB: the smallest size within 90% of the best goodput among")
    assert "(chunk_p99: 256.0 KiB 47.8 ms, 1.0 MiB 56.8 ms)" in why
    assert "4.0 MiB moved the most (0.631 Gbit/s) but its p99 is 122.7 ms" in why


def test_no_chunk_is_recommended_when_none_passes() -> None:
    report = _judged(200)  # 30 ms
    assert report["chunk_recommended_bytes"] is None
    assert "kv.chunk_size_kb" not in report["recommendations"]["set"]
    assert report["recommendations"]["chunk"]["why"].startswith("none: no swept size's p99")
    assert report["verdict"]["result"] == "NO-GO" and "chunk_p99" in report["verdict"]["why"]


def test_without_a_budget_the_chunk_is_chosen_on_goodput_alone() -> None:
    report = _judged(None)
    assert report["chunk_recommended_bytes"] == 4 << 20
    assert "no TTFT budget, so no p99 was judged" in report["recommendations"]["chunk"]["why"]


def test_the_text_output_shows_the_figures_and_each_sizes_rule() -> None:
    console = Console(record=True, width=200)
    shown = {"rtt_ms": None, "loss": None, "rtt_under_load_ms": None, "mtu": None, "tcp": None}
    render_report(console, _judged(500) | shown | {"chunk_transport": "tcp"})
    text = console.export_text()
    assert "recommended for pdx deploy: --set kv.streams=4 --set kv.link_gbps=0.96" in text
    assert "  - kv.streams ×4: the fewest streams" in text
    assert "  - kv.chunk_size_kb 1.0 MiB: the smallest size" in text
    rows = [line for line in text.splitlines() if line.startswith("│") and "iB" in line]
    assert any("1.0 MiB *" in r and "PASS" in r for r in rows)
    assert any("4.0 MiB" in r and "FAIL" in r for r in rows)
    assert "among those whose p99 passes chunk_p99 (≤ 75 ms)" in text
