"""``pdx accept --search``: the bracket logic on known limits, the playbook and CLI checks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from pdx.accept.playbook import load_playbook
from pdx.accept.search.limit import Axis, Bracket, limit_text, probe_verdict, result
from pdx.cli.main import app
from pdx.errors import ConfigError

SMOKE = Path(__file__).parents[2] / "playbooks" / "smoke.yaml"


def _walk(axis: Axis, limit: float, predicted: float | None = None) -> Bracket:
    """Drive a bracket against a system that is GO exactly up to ``limit``."""
    b = Bracket(axis)
    for _ in range(40):
        v = b.next_value(predicted)
        if v is None:
            return b
        ok = v <= limit if axis.worse_up else v >= limit
        b.record(v, "GO" if ok else "NO-GO")
    raise AssertionError(f"the search did not end: {b}")


@pytest.mark.parametrize("limit", [11.0, 23.4, 37.0, 63.0])
def test_bracket_holds_the_limit_and_is_as_narrow_as_asked(limit: float) -> None:
    ax = Axis("rate", 10.0, 64.0)
    b = _walk(ax, limit)
    assert b.outcome(True) == "found"
    assert b.good is not None and b.bad is not None
    assert b.good <= limit < b.bad
    assert b.bad - b.good <= 0.1 * b.good + 1e-9


def test_a_good_prediction_saves_probes() -> None:
    ax = Axis("rate", 2.0, 64.0)
    blind, told = _walk(ax, 30.0), _walk(ax, 30.0, predicted=29.0)
    assert told.good is not None and told.good <= 30.0 < (told.bad or 0)
    assert len(told.probed) < len(blind.probed)


def test_bandwidth_searches_downwards() -> None:
    ax = Axis("bandwidth_mbps", 10.0, 10_000.0)
    b = _walk(ax, 180.0)
    assert b.outcome(True) == "found"
    assert b.bad is not None and b.good is not None and b.bad < 180.0 <= b.good
    assert b.probed[0] == 10_000.0  # the best link first


def test_loss_bisects_geometrically_over_decades() -> None:
    ax = Axis("loss", 0.0001, 0.05)
    b = _walk(ax, 0.003)
    assert b.good is not None and b.good <= 0.003 < (b.bad or 1)
    assert len(b.probed) <= 12


def test_concurrency_ends_on_neighbouring_integers() -> None:
    b = _walk(Axis("concurrency", 1.0, 64.0), 9.0)
    assert (b.good, b.bad) == (9.0, 10.0)


def test_edges_of_the_range() -> None:
    ax = Axis("rtt_ms", 1.0, 200.0)
    assert _walk(ax, 500.0).outcome(True) == "above_range"
    below = _walk(ax, 0.5)
    assert below.outcome(True) == "below_range" and below.probed == [1.0]


def test_undecided_and_non_monotone_probes_never_widen_the_limit() -> None:
    b = Bracket(Axis("rate", 10.0, 64.0))
    b.record(10.0, "GO")
    b.record(20.0, "INCONCLUSIVE")
    assert (b.good, b.bad, b.bad_undecided, b.undecided) == (10.0, 20.0, True, [20.0])
    b.record(30.0, "GO")  # beyond a value that was not GO: noise, kept apart
    assert b.good == 10.0 and b.non_monotone == [30.0]
    r = result(b, [], "normal", True, None)
    assert r["limit"] == 10.0 and r["undecided"] == [20.0] and r["outcome"] == "undecided"
    assert "undecided" in limit_text(r)


class _C:
    def __init__(self, name: str, result: str, advisory: bool = False) -> None:
        self.name, self.result, self.advisory = name, result, advisory


def test_probe_verdicts() -> None:
    assert probe_verdict(True, False, [_C("ttft_p50_ms", "pass")])[0] == "GO"
    assert probe_verdict(True, False, [_C("ttft_p50_ms", "fail")])[0] == "NO-GO"
    assert probe_verdict(False, True, [_C("ttft_p50_ms", "pass")])[0] == "NO-GO"  # load short
    assert probe_verdict(False, False, [_C("ttft_p50_ms", "pass")])[0] == "INCONCLUSIVE"
    assert probe_verdict(True, False, [_C("ttft_p99_ms", "indeterminate")])[0] == "INCONCLUSIVE"
    assert probe_verdict(True, False, [_C("link_verdict", "fail", advisory=True)])[0] == (
        "INCONCLUSIVE"
    )  # advisory criteria never decide; nothing left to judge


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("search.range=[40, 2]", "expected 0 < LO < HI (got 40:2)"),
        ('search.range="a:b"', "expected LO:HI, two numbers"),
        ("search.param=speed", "search.param"),
        ("search.budget_s=0", "search.budget_s"),
    ],
)
def test_bad_search_settings_name_the_field(override: str, needle: str) -> None:
    with pytest.raises(ConfigError) as exc:
        load_playbook(SMOKE, dotted=[override])
    assert needle in str(exc.value)


def test_cli_refuses_a_bad_range_before_deploying(tmp_path: Path) -> None:
    args = ["accept", str(SMOKE), "--search", "rate", "--search-range", "5", "--out", str(tmp_path)]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 2 and "--search-range" in r.output and "LO:HI" in r.output
    assert not any(tmp_path.iterdir())


def _crit(name: str, measured: float, threshold: float, hi: float | None = None) -> Any:
    from pdx.accept.judge.criteria import CriterionResult

    interval = (None, hi) if hi is not None else None
    return CriterionResult(name=name, step="s00", measured=measured, threshold=threshold,
                           margin=None, passed=True, unit="ms", interval=interval)  # fmt: skip


def test_loose_thresholds_are_flagged_only_when_loose_on_every_step() -> None:
    from pdx.accept.judge.criteria import loose_criteria

    rows = [
        _crit("tpot_p99_ms", 12.0, 2000.0, hi=15.0),
        _crit("tpot_p99_ms", 40.0, 2000.0, hi=60.0),  # both steps > 10x below: flagged
        _crit("ttft_p50_ms", 20.0, 2000.0, hi=25.0),
        _crit("ttft_p50_ms", 400.0, 2000.0, hi=450.0),  # one step within 10x: a constraint
        _crit("transfer_success_min", 0.9999, 0.99),  # shortfall 0.0001 vs 0.01: 100x
        _crit("error_rate_max", 0.0, 0.0),  # a threshold of 0 is never loose
    ]
    flagged = {n["name"]: n for n in loose_criteria(rows)}
    assert set(flagged) == {"tpot_p99_ms", "transfer_success_min"}
    assert flagged["tpot_p99_ms"]["headroom"] == pytest.approx(2000 / 60, abs=0.1)
    assert flagged["tpot_p99_ms"]["steps"] == 2


def test_the_split_pays_costs_or_shows_no_difference() -> None:
    from pdx.accept.judge.baseline import compare
    from pdx.accept.steps import Step

    def side(p50: float, lo: float, hi: float, good: float) -> dict[str, Any]:
        q = {"value": p50, "interval": [lo, hi]}
        return {"ttft_p50_ms": q, "ttft_p99_ms": q, "tpot_p50_ms": q, "requests": 100,
                "goodput_rps": {"value": good, "interval": [good - 1, good + 1]}}  # fmt: skip

    st = Step(0, 2048, 16, 1, None, "wan10", 30)
    twin = Step(0, 2048, 16, 1, None, "wan10-colocated", 30)
    fast, slow = side(300, 280, 320, 5.0), side(600, 560, 640, 5.0)
    assert compare(st, twin, fast, slow, True)["verdict"] == "pays"
    row = compare(st, twin, slow, fast, False)
    assert row["verdict"] == "costs" and row["ttft_p50_delta_ms"] == 300
    assert "the split costs here" in row["line"] and "+100 %" in row["line"]
    overlap = side(310, 250, 650, 5.0)
    assert compare(st, twin, overlap, slow, True)["verdict"] == "no difference shown"
    fast_but_fewer = side(300, 280, 320, 2.0)  # TTFT better, goodput wholly below
    mixed = compare(st, twin, fast_but_fewer, slow, True)
    assert mixed["verdict"] == "mixed" and mixed["better"] == ["TTFT p50"]
    assert "pays on TTFT p50 and costs on goodput" in mixed["line"]


def test_report_diff_compares_two_searches() -> None:
    from pdx.accept.report.diff import _limit_status

    a = {"param": "rate", "bracket": [20.0, 24.0]}
    assert _limit_status(a, {"param": "rate", "bracket": [30.0, 33.0]}) == "higher limit"
    assert _limit_status(a, {"param": "rate", "bracket": [12.0, 14.0]}) == "lower limit"
    assert _limit_status(a, {"param": "rate", "bracket": [22.0, 26.0]}) == "brackets overlap"
    bw = {"param": "bandwidth_mbps", "bracket": [50.0, 40.0]}
    assert _limit_status(bw, {"param": "bandwidth_mbps", "bracket": [20.0, 15.0]}) == (
        "lower limit (better)"
    )


class _Linear:
    """A limit model whose closest criterion grows as value / limit (the crossing logic only)."""

    axis = Axis("rate", 10.0, 64.0)

    def __init__(self, limit: float) -> None:
        self.limit, self.step = limit, type("S", (), {"id": "s00"})()
        self.link: dict[str, Any] = {}
        self.pull: dict[str, Any] = {}

    def why_not(self) -> None:
        return None

    def ratio(self, v: float) -> tuple[float, str, dict[str, Any]]:
        return v / self.limit, "ttft_p50_ms", {}


@pytest.mark.parametrize(
    ("limit", "predicted", "extrapolated", "below"),
    [(30.0, 30.0, None, False), (100.0, None, 100.0, False), (5.0, None, None, True)],
)
def test_the_predicted_limit_in_past_and_below_the_range(
    limit: float, predicted: float | None, extrapolated: float | None, below: bool
) -> None:
    from pdx.accept.search.predict import predict

    r = predict(_Linear(limit))  # type: ignore[arg-type]
    if predicted is None:
        assert r["predicted_limit"] is None
    else:
        assert r["predicted_limit"] == pytest.approx(predicted, rel=0.01)
    got = r["extrapolated_limit"]
    assert (got is None) if extrapolated is None else got == pytest.approx(extrapolated, rel=0.01)
    assert r["predicted_below_range"] is below


def _walk_noisy(axis: Axis, verdicts: dict[float, list[str]], confirm: int = 1) -> Bracket:
    """Drive a bracket against a system whose verdict at each value is given in turn."""
    b = Bracket(axis, confirm=confirm)
    seen: dict[float, int] = {}
    for _ in range(40):
        v = b.next_value(None)
        if v is None:
            return b
        k = seen.get(v, 0)
        seen[v] = k + 1
        script = verdicts.get(v)
        default = "GO" if v <= 20.0 else "NO-GO"
        b.record(v, script[k] if script and k < len(script) else default)
    raise AssertionError(f"the search did not end: {b}")


def test_the_limit_is_confirmed_before_it_is_found() -> None:
    ax = Axis("rate", 10.0, 64.0, resolution=2.0)
    b = _walk_noisy(ax, {})
    assert b.outcome(True) == "found" and b.confirmed and b.good is not None
    assert b.good <= 20.0 < (b.bad or 0) and b.probed.count(b.good) == 2
    r = result(b, [], "normal", True, None)
    assert r["confirmed"] and r["confirm"] == 1 and r["disputed"] == []
    # confirm 0: one GO is enough, as before
    assert _walk_noisy(ax, {}, confirm=0).probed.count(b.good) == 1


def test_a_lucky_go_that_fails_its_confirmation_is_disputed_and_the_search_goes_below() -> None:
    ax = Axis("rate", 10.0, 64.0, resolution=2.0)
    # 24 is GO once by luck (the system carries 20), then NO-GO when confirmed
    b = Bracket(ax, confirm=1)
    for v, verdict in ((10.0, "GO"), (24.0, "GO"), (25.0, "NO-GO")):
        b.record(v, verdict)
    assert b.next_value(None) == 24.0  # narrow: the GO end again
    b.record(24.0, "NO-GO")
    assert b.disputed == [24.0] and (b.good, b.bad) == (10.0, 24.0) and not b.confirmed
    assert b.outcome(True) == "undecided"
    while (v := b.next_value(None)) is not None:
        b.record(v, "GO" if v <= 20.0 else "NO-GO")
    assert b.outcome(True) == "found" and b.good is not None and 18.0 <= b.good <= 20.0
    assert b.disputed == [24.0] and b.go_counts[b.good] == 2


def test_an_unconfirmed_limit_is_not_found_when_the_budget_ends() -> None:
    b = Bracket(Axis("rate", 10.0, 64.0, resolution=2.0), confirm=1)
    for v, verdict in ((10.0, "GO"), (20.0, "GO"), (21.0, "NO-GO")):
        b.record(v, verdict)
    assert b.outcome(False) == "budget_exhausted"
    r = result(b, [], "normal", False, None)
    assert r["limit"] == 20.0 and not r["confirmed"]
