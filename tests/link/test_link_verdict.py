"""Verdict rules: each rule's measured value, threshold, margin and outcome."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pdx.errors import InputError
from pdx.link.chunks import choose_chunk
from pdx.link.verdict import VerdictRules, judge, kv_demand_from_report


def _report(**over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "throughput": {"up_gbps": 10.0, "down_gbps": 8.0},
        "rtt_ms": {"p99": 2.0},
        # 10 of 20,000 lost downstream: 0.05 %, bounded to <= 0.085 % at 95 % (under 0.1 %)
        "loss": {"up": 0.0, "down": 0.05, "probes": 20_000, "up_count": 0, "down_count": 10},
        "chunks": [
            {"chunk_bytes": 1 << 20, "p99_ms": 3.0},
            {"chunk_bytes": 4 << 20, "p99_ms": 12.0},
        ],
        "chunk_recommended_bytes": 4 << 20,
    }
    base.update(over)
    return base


def _rules(verdict: Any) -> dict[str, Any]:
    return {r.name: r for r in verdict.rules}


def test_every_rule_passes_with_margin() -> None:
    verdict = judge(_report(), VerdictRules(kv_gbps=5.0, ttft_budget_ms=100.0))
    rules = _rules(verdict)
    assert verdict.go
    assert rules["kv_bandwidth"].threshold == pytest.approx(7.0)
    assert rules["kv_bandwidth"].margin == pytest.approx(2.0)
    assert rules["rtt"].threshold == pytest.approx(20.0) and rules["rtt"].measured == 2.0
    assert rules["loss"].measured == 0.05 and rules["loss"].margin == pytest.approx(0.05)
    assert rules["chunk_p99"].measured == 12.0 and rules["chunk_p99"].threshold == 15.0


@pytest.mark.parametrize(
    ("report", "rules", "failing"),
    [
        (_report(), VerdictRules(kv_gbps=7.5), "kv_bandwidth"),
        (_report(rtt_ms={"p99": 25.0}), VerdictRules(ttft_budget_ms=100), "rtt"),
        (
            _report(loss={"up": 2.0, "down": 0.0, "probes": 10_000, "up_count": 200}),
            VerdictRules(),
            "loss",
        ),
        (_report(chunk_recommended_bytes=None), VerdictRules(ttft_budget_ms=10), "chunk_p99"),
    ],
)
def test_one_failing_rule_makes_no_go(
    report: dict[str, Any], rules: VerdictRules, failing: str
) -> None:
    verdict = judge(report, rules)
    judged = _rules(verdict)
    assert not verdict.go
    assert judged[failing].status == "fail" and judged[failing].margin < 0
    assert [r.name for r in verdict.rules if r.status == "fail"] == [failing]


def test_kv_direction_picks_the_bandwidth_compared() -> None:
    for direction, avail in (("up", 10.0), ("down", 8.0), ("both", 8.0)):
        rule = _rules(judge(_report(), VerdictRules(kv_gbps=1.0, kv_direction=direction)))
        assert rule["kv_bandwidth"].threshold == pytest.approx(0.7 * avail)


def test_rules_without_inputs_are_skipped_and_say_why() -> None:
    verdict = judge({"loss": None, "throughput": None}, VerdictRules(kv_gbps=1.0))
    # nothing judged is not a GO: the verdict says which rules it needed
    assert not verdict.go and verdict.result == "INCONCLUSIVE" and verdict.judged == []
    assert "not judged: kv_bandwidth, rtt, loss" in verdict.why
    assert {r.status for r in verdict.rules} == {"skip"}
    assert all(r.detail for r in verdict.rules)


def test_loss_is_judged_on_its_bound_not_the_point_estimate() -> None:
    """None lost of 100 probes bounds loss only to 3 %: undecided, never a pass of 0.1 %."""
    few = _rules(judge(_report(loss={"up": 0.0, "down": 0.0, "probes": 100}), VerdictRules()))
    assert few["loss"].status == "indeterminate" and "2,995" in few["loss"].detail
    enough = {"up": 0.0, "down": 0.0, "probes": 2995, "up_count": 0, "down_count": 0}
    assert _rules(judge(_report(loss=enough), VerdictRules()))["loss"].status == "pass"
    fewer = {**enough, "probes": 2994}
    assert _rules(judge(_report(loss=fewer), VerdictRules()))["loss"].status == "indeterminate"


def test_verdict_needs_bandwidth_rtt_and_loss_judged() -> None:
    only_loss = judge(_report(), VerdictRules())
    assert only_loss.result == "INCONCLUSIVE" and not only_loss.go
    assert only_loss.judged == ["loss"] and "kv_bandwidth, rtt" in only_loss.why
    full = judge(_report(), VerdictRules(kv_gbps=5.0, ttft_budget_ms=100.0))
    assert full.result == "GO" and full.go


def _kv_file(tmp_path: Path, data: Any) -> Path:
    path = tmp_path / "kv.json"
    path.write_text(json.dumps(data))
    return path


def test_kv_report_takes_the_largest_request_or_the_chosen_seq(tmp_path: Path) -> None:
    path = _kv_file(
        tmp_path,
        {
            "kv_bytes_per_token": 327680,
            "requests": [
                {"seq": 1024, "kv_bytes": 335_544_320},
                {"seq": 8192, "kv_bytes": 2_684_354_560},
            ],
        },
    )
    gbps, why = kv_demand_from_report(path, qps=2.0)
    assert gbps == pytest.approx(2_684_354_560 * 2 * 8 / 1e9)
    assert "seq 8192" in why
    gbps, _ = kv_demand_from_report(path, qps=2.0, seq=1024)
    assert gbps == pytest.approx(335_544_320 * 2 * 8 / 1e9)
    with pytest.raises(InputError, match="--seq"):
        kv_demand_from_report(path, qps=2.0, seq=77)


@pytest.mark.parametrize(
    "content", ['{"requests": []}', '{"requests": [{"seq": 1}]}', "[1]", "not json"]
)
def test_bad_kv_reports_name_the_file(tmp_path: Path, content: str) -> None:
    path = tmp_path / "kv.json"
    path.write_text(content)
    with pytest.raises(InputError, match="--kv-report"):
        kv_demand_from_report(path, qps=1.0)


def test_missing_kv_report_and_bad_qps(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="existing"):
        kv_demand_from_report(tmp_path / "nope.json", qps=1.0)
    with pytest.raises(InputError, match="--qps"):
        kv_demand_from_report(tmp_path / "nope.json", qps=0)


# A user's sweep on a 20 ms RTT, 0.2 % loss link: the best goodput (4 MiB) misses a 500 ms
# budget's chunk limit (15 %: 75 ms) while 256 KiB and 1 MiB are within it.
SWEEP = [
    {"chunk_bytes": 256 << 10, "gbps": 0.110, "p99_ms": 47.8},
    {"chunk_bytes": 1 << 20, "gbps": 0.340, "p99_ms": 56.8},
    {"chunk_bytes": 2 << 20, "gbps": 0.534, "p99_ms": 90.5},
    {"chunk_bytes": 4 << 20, "gbps": 0.631, "p99_ms": 122.7},
    {"chunk_bytes": 8 << 20, "gbps": 0.450, "p99_ms": 317.9},
]


def test_the_chunk_rule_judges_every_size_and_the_recommended_size_passes() -> None:
    rules = VerdictRules(ttft_budget_ms=500)
    assert rules.chunk_p99_limit_ms == pytest.approx(75.0)
    assert choose_chunk(SWEEP) == 4 << 20  # goodput alone: the size the user was given
    chosen = choose_chunk(SWEEP, max_p99_ms=rules.chunk_p99_limit_ms)
    assert chosen == 1 << 20  # the best goodput among the sizes that pass
    rule = _rules(judge(_report(chunks=SWEEP, chunk_recommended_bytes=chosen), rules))["chunk_p99"]
    assert rule.status == "pass" and rule.measured == 56.8
    assert rule.margin == pytest.approx(75.0 - 56.8)
    assert rule.sizes is not None
    assert [s["status"] for s in rule.sizes] == ["pass", "pass", "fail", "fail", "fail"]
    assert [s["recommended"] for s in rule.sizes] == [False, True, False, False, False]
    assert rule.sizes[3]["margin"] == pytest.approx(75.0 - 122.7)
    assert "pass: 256.0 KiB (47.8 ms), 1.0 MiB (56.8 ms); fail: 2.0 MiB" in rule.detail
    assert "1.0 MiB chunk, the size to use" in rule.detail


def test_the_chunk_rule_fails_only_when_no_size_passes_and_says_so() -> None:
    rules = VerdictRules(ttft_budget_ms=200)  # 30 ms: nothing in the sweep
    chosen = choose_chunk(SWEEP, max_p99_ms=rules.chunk_p99_limit_ms)
    assert chosen is None
    verdict = judge(_report(chunks=SWEEP, chunk_recommended_bytes=chosen), rules)
    rule = _rules(verdict)["chunk_p99"]
    assert rule.status == "fail" and verdict.result == "NO-GO"
    assert rule.measured == 47.8  # the nearest size
    assert rule.sizes is not None and {s["status"] for s in rule.sizes} == {"fail"}
    assert not any(s["recommended"] for s in rule.sizes)
    assert (
        rule.detail.startswith("no swept chunk size's p99 is within")
        and "pass: none" in rule.detail
    )


def test_a_report_rejudged_at_a_tighter_budget_is_judged_on_a_size_that_passes() -> None:
    """pdx accept re-judges a saved report at its own budget: the probe's recommended 1 MiB
    misses 52.5 ms, 256 KiB does not; the rule names the size to use instead."""
    rule = _rules(judge(_report(chunks=SWEEP, chunk_recommended_bytes=1 << 20),
                        VerdictRules(ttft_budget_ms=350)))["chunk_p99"]  # fmt: skip
    assert rule.status == "pass" and rule.measured == 47.8
    assert "the report recommended 1.0 MiB, which fails this budget" in rule.detail
