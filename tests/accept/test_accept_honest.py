"""A verdict never passes on nothing: no data, small samples, gates that cannot fail.

Unit tests of the decision rules (each checked against an independent computation) and real
``pdx accept`` runs of the smoke playbook that move no KV or replay too little to prove a 0.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from pdx.accept.judge import confidence as ci
from pdx.accept.judge.criteria import CriterionResult, judge_link, judge_step, run_verdict
from pdx.accept.judge.repeat import summarize_runs
from pdx.accept.playbook import Criteria
from pdx.accept.report import Report
from pdx.accept.steps import Step
from pdx.cli.main import app

C = 0.95
STEP = Step(0, 48, 8, 2, None, "normal", 15.0)
SMOKE = Path(__file__).resolve().parents[2] / "playbooks" / "smoke.yaml"


# --- quantile sample size ----------------------------------------------------------------


def _binom_cdf(k: int, m: int, q: float) -> float:
    """Independent: P(Binomial(m, q) <= k), summed term by term in log space."""
    if k < 0:
        return 0.0
    log_q, log_p = math.log(q), math.log1p(-q)
    terms = [
        math.lgamma(m + 1)
        - math.lgamma(i + 1)
        - math.lgamma(m - i + 1)
        + i * log_q
        + (m - i) * log_p
        for i in range(min(k, m) + 1)
    ]
    top = max(terms)
    return min(1.0, math.exp(top) * math.fsum(math.exp(t - top) for t in terms))


def _decides(share: float, q: float, m: int) -> bool:
    """Independent: m values, share of them under the threshold, decide the q-quantile."""
    below = math.floor(share * m + 1e-9)
    if share > q:  # pass: the u-th order statistic (u <= below) bounds it from above
        return _binom_cdf(below - 1, m, q) >= C
    return 1.0 - _binom_cdf(below, m, q) >= C  # fail: the lower bound is above the threshold


@pytest.mark.parametrize(("n", "over", "q"), [(200, 1, 0.99), (100, 12, 0.9), (50, 20, 0.5)])
def test_quantile_sample_size_holds_for_every_larger_sample(n: int, over: int, q: float) -> None:
    """The answer is the smallest n from which every larger sample decides (a brute-force
    scan); the decision is not monotone, so the first deciding size is not it."""
    values = [1.0] * (n - over) + [3.0] * over
    got = ci.quantile_needed(values, q, 2.0, C)
    share = (n - over) / n
    scan_to = 2 * (got or n) + 200
    undecided = [m for m in range(n, scan_to) if not _decides(share, q, m)]
    assert got == (undecided[-1] + 1 if undecided else n)
    if (n, over) == (200, 1):  # p99 with 0.5 % over: 1,182 decides first, 1,441 for good
        first = next(m for m in range(n, scan_to) if _decides(share, q, m))
        assert (first, got) == (1182, 1441)


# --- threshold 0 -------------------------------------------------------------------------


def _errors(k: int, n: int) -> dict[str, Any]:
    return {"failed": k, "requests": n, "ok": n - k, "error_rate": k / n if n else None}


def _one(summary: dict[str, Any], name: str = "error_rate_max", **crit: Any) -> CriterionResult:
    criteria = Criteria(**{"transfer_success_min": None, "retry_rate_max": None,
                           "degrade_rate_max": None, "silent_fallback_max": None,
                           "output_mismatch_max": None, "kv_stranded_max_s": None,
                           "overdue_requests_max": None, "error_rate_max": None,
                           **crit})  # fmt: skip
    (c,) = [r for r in judge_step(STEP, summary, criteria, {}, C, 0.01) if r.name == name]
    return c


def test_zero_threshold_needs_a_sample_that_bounds_the_rate() -> None:
    at_299 = _one(_errors(0, 299), error_rate_max=0.0)
    assert at_299.result == "pass" and at_299.rate_bound == pytest.approx(1 - 0.05 ** (1 / 299))
    at_298 = _one(_errors(0, 298), error_rate_max=0.0)
    assert at_298.result == "indeterminate" and at_298.requests_needed == 299
    assert at_298.rate_bound is not None and at_298.rate_bound > 0.01
    assert _one(_errors(1, 5000), error_rate_max=0.0).result == "fail"
    assert _one(_errors(0, 0) | {"requests": 0}, error_rate_max=0.0).result == "not_measured"


def _replays(mismatches: int, replayed: int, errors: int = 0) -> dict[str, Any]:
    rate = mismatches / replayed if replayed else None
    return {"replay_mismatches": mismatches, "replayed": replayed, "replay_errors": errors,
            "output_mismatch_rate": rate}  # fmt: skip


def test_replays_that_error_stay_in_the_denominator() -> None:
    one = _one(_replays(0, 1), "output_mismatch_max", output_mismatch_max=0.0)
    assert one.result == "indeterminate" and one.rate_bound == pytest.approx(0.95)
    errored = _one(_replays(0, 300, errors=3), "output_mismatch_max", output_mismatch_max=0.0)
    assert errored.result == "indeterminate" and "could not be compared" in errored.note
    loose = _one(_replays(0, 300, errors=30), "output_mismatch_max", output_mismatch_max=0.05)
    assert loose.result == "indeterminate"  # 30 unknown of 300: the upper bound passes 5 %
    assert _one(_replays(0, 300), "output_mismatch_max", output_mismatch_max=0.0).result == "pass"


@pytest.mark.parametrize(("replays", "most_pass"), [(16, 0.186), (300, 1e-12)])
def test_a_codec_that_corrupts_10_percent_fails_a_smoke_step(
    replays: int, most_pass: float
) -> None:
    """Each replay of a codec that corrupts 10 % of outputs mismatches with chance 0.1; the
    step passes only when none does: 0.9^16 = 18.5 % with the old 16 replays, 0.9^300 ≈ 2e-14
    with the smoke's 300. Drawn 2,000 times and judged by the real rule."""
    rng = random.Random(7)
    passed = 0
    for _ in range(2000):
        k = sum(rng.random() < 0.1 for _ in range(replays))
        c = _one(_replays(k, replays), "output_mismatch_max", output_mismatch_max=0.0)
        passed += c.result == "pass"
    assert 0.9**replays <= most_pass
    assert passed == 0  # 16 replays are indeterminate even with none seen; 300 find it


# --- idle burst, link verdict, run verdict ------------------------------------------------


def test_idle_burst_never_passes_when_the_burst_cannot_bound_its_p99() -> None:
    crit = Criteria(idle_ttft_ratio_max=2.0)
    summary = {"idle_s": 5, "idle_ttft_ratio": 1.0, "steady_requests": 400}
    samples = {"steady_ttft_ms": [10.0] * 400, "burst_ttft_ms": [10.0] * 20}
    (c,) = [r for r in judge_step(STEP, summary, crit, samples, C) if r.name.startswith("idle")]
    assert c.result == "indeterminate" and c.interval is not None and c.interval[1] is None
    assert c.requests_needed == 299
    slow = {"steady_ttft_ms": [10.0] * 400, "burst_ttft_ms": [1000.0] * 20}
    summary_slow = {**summary, "idle_ttft_ratio": 100.0}
    (d,) = [r for r in judge_step(STEP, summary_slow, crit, slow, C) if r.name.startswith("idle")]
    assert d.result == "fail"  # a burst 100x steady: its lower bound alone clears 2x


def test_link_verdict_criterion() -> None:
    go = {"result": "GO", "go": True, "rules": [{"name": "loss", "status": "pass"}]}
    nogo = {"result": "NO-GO", "go": False, "rules": [{"name": "loss", "status": "fail"}]}
    open_rule = [{"name": "loss", "status": "indeterminate"}]
    unsure = {"result": "INCONCLUSIVE", "go": False, "rules": open_rule}
    assert judge_link("s00", go, "", False).result == "pass"
    failed = judge_link("s00", nogo, "", False)
    assert failed.result == "fail" and failed.measured == 1
    assert judge_link("s00", unsure, "", False).result == "indeterminate"
    missing = judge_link("s00", None, "not probed", False)
    assert missing.result == "not_measured" and missing.note == "not probed"
    assert run_verdict(True, [failed]) == "NO-GO"
    assert run_verdict(True, [judge_link("s00", nogo, "", True)]) == "INCONCLUSIVE"  # advisory
    assert run_verdict(True, [judge_link("s00", go, "", False), missing]) == "INCONCLUSIVE"
    assert run_verdict(True, []) == "INCONCLUSIVE"  # nothing judged is not a GO


# --- --repeat ----------------------------------------------------------------------------


def _runs(rows: list[list[CriterionResult]]) -> list[Report]:
    return [
        Report(
            name="r",
            verdict="GO",
            valid=True,
            complete=True,
            exit_code=0,
            started_at="",
            finished_at="",
            target={},
            criteria=r,
            validity=[],
            steps=[],
            formulas={},
            playbook={},
            environment={},
        )
        for r in rows
    ]


def _c(name: str, measured: float, threshold: float, sample: int, method: str) -> CriterionResult:
    return CriterionResult(name=name, step="s00-x", measured=measured, threshold=threshold,
                           margin=threshold - measured, passed=True, unit="s", result="pass",
                           confidence=C, interval=(measured, measured), sample=sample,
                           method=method)  # fmt: skip


def test_repeat_point_values_compare_with_the_threshold_not_each_other() -> None:
    runs = _runs([[_c("kv_stranded_max_s", v, 5.0, 300, "observed maximum")]
                  for v in (0.011, 0.012, 0.015)])  # fmt: skip
    summary = summarize_runs(runs, [Path("a"), Path("b"), Path("c")], C)
    (row,) = summary.rows
    assert not row.unstable and summary.verdict == "GO" and row.mean_result == "pass"


def test_repeat_rates_judged_by_their_sampling_spread_with_holm() -> None:
    def rates(*ks: int) -> list[Report]:
        return _runs([[_c("error_rate_max", k / 300, 0.5, 300, "Clopper-Pearson")] for k in ks])

    dirs = [Path("a"), Path("b"), Path("c")]
    close = summarize_runs(rates(0, 1, 0), dirs, C)
    assert not close.rows[0].unstable and close.rows[0].p_value is not None
    apart = summarize_runs(rates(0, 60, 1), dirs, C)
    assert apart.rows[0].unstable and apart.rows[0].p_value < 0.001
    assert apart.verdict == "INCONCLUSIVE"


def test_repeat_a_real_difference_too_small_to_move_the_decision_is_not_unstable() -> None:
    def rates(*ks: int) -> list[Report]:
        return _runs([[_c("error_rate_max", k / 30000, 0.5, 30000, "Clopper-Pearson")]
                      for k in ks])  # fmt: skip

    dirs = [Path("a"), Path("b"), Path("c")]
    # 0, 60 and 1 errors in 30,000: beyond sampling spread, but 0.2 % apart against 50 %.
    small = summarize_runs(rates(0, 60, 1), dirs, C)
    (row,) = small.rows
    assert row.significant and row.p_value is not None and row.p_value < 0.001
    assert not row.unstable and small.unstable_steps == [] and small.verdict == "GO"
    # With no tolerance the same runs make the step unstable.
    strict = summarize_runs(rates(0, 60, 1), dirs, C, tolerance=0.0)
    assert strict.rows[0].unstable and strict.verdict == "INCONCLUSIVE"


# --- real runs ---------------------------------------------------------------------------


def _accept(tmp_path: Path, *sets: str) -> dict[str, Any]:
    args = ["accept", str(SMOKE), "--out", str(tmp_path), "--no-progress", "--json"]
    base = ["matrix.network=[normal]", "matrix.duration_s=8", "validity.min_duration_s=4",
            "preflight.probe_link=false"]  # fmt: skip
    for item in [*base, *sets]:
        args += ["--set", item]
    result = CliRunner().invoke(app, args)
    data: dict[str, Any] = json.loads(result.stdout)
    assert result.exit_code == data["exit_code"], result.output[-2000:]
    return data


def _by_name(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in data["criteria"]}


@pytest.mark.slow
@pytest.mark.alone
def test_a_run_that_moved_no_kv_is_not_go(tmp_path: Path) -> None:
    """Every prompt prefilled locally: no KV crossed, so nothing shows the link carries it."""
    data = _accept(tmp_path, "target.deploy_set=[router.local_prefill_max_tokens=100000]")
    assert data["verdict"] != "GO" and data["exit_code"] != 0
    got = _by_name(data)
    for name in ("transfer_p99_ms", "transfer_success_min", "retry_rate_max",
                 "kv_stranded_max_s", "silent_fallback_max"):  # fmt: skip
        assert got[name]["result"] == "not_measured" and not got[name]["passed"], got[name]
    assert data["steps"][0]["summary"]["routes"].get("disaggregated", 0) == 0
    assert got["error_rate_max"]["result"] != "not_measured"  # what was measured is judged
    # The playbook left the breaker's bound to the deploy: it follows the TTFT judged here.
    assert "router.ttft_budget_ms=10000" in data["target"]["deploy_args"]


@pytest.mark.slow
@pytest.mark.alone
def test_one_replay_cannot_prove_no_mismatch(tmp_path: Path) -> None:
    data = _accept(tmp_path, "judgement.replay_requests=1")
    mismatch = _by_name(data)["output_mismatch_max"]
    assert mismatch["result"] == "indeterminate" and mismatch["sample"] == 1
    assert mismatch["rate_bound"] == pytest.approx(0.95) and mismatch["requests_needed"] == 299
    assert data["verdict"] == "INCONCLUSIVE"
    # smoke.yaml sets router.degrade_p99_ms itself: no TTFT budget is added.
    assert not [a for a in data["target"]["deploy_args"] if a.startswith("router.ttft_budget")]
