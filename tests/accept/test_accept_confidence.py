"""Confidence bounds and three-valued judgement, each bound checked by an independent route.

The independent computations use only the standard library: binomial tails summed exactly in
log space and inverted by bisection (Clopper–Pearson), closed forms for zero counts, order
statistic coverage from the binomial sum, and a Monte Carlo coverage check.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import pytest

from pdx.accept.judge import confidence as ci
from pdx.accept.judge.criteria import EXIT_CODES, CriterionResult, judge_step, run_verdict
from pdx.accept.playbook import Criteria
from pdx.accept.predict.remedies import undecided_steps
from pdx.accept.steps import Step

C = 0.95
STEP = Step(0, 48, 8, 2, None, "normal", 15.0)


def _log_pmf(n: int, k: int, p: float) -> float:
    if p <= 0:
        return 0.0 if k == 0 else -math.inf
    if p >= 1:
        return 0.0 if k == n else -math.inf
    log_comb = math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)
    return log_comb + k * math.log(p) + (n - k) * math.log1p(-p)


def _tail_ge(n: int, k: int, p: float) -> float:
    """P(Binomial(n, p) >= k), summed exactly term by term."""
    return sum(math.exp(_log_pmf(n, i, p)) for i in range(k, n + 1))


def _bisect(f: Callable[[float], float], target: float, increasing: bool) -> float:
    lo, hi = 0.0, 1.0
    for _ in range(80):
        mid = (lo + hi) / 2
        if (f(mid) < target) == increasing:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _cp_independent(k: int, n: int, c: float) -> tuple[float, float]:
    """Clopper–Pearson from its definition: P(X >= k | L) = 1 − c and P(X <= k | U) = 1 − c."""
    low = 0.0 if k == 0 else _bisect(lambda p: _tail_ge(n, k, p), 1 - c, increasing=True)
    high = 1.0 if k == n else _bisect(lambda p: 1 - _tail_ge(n, k + 1, p), 1 - c, increasing=False)
    return low, high


def _transfers(ok: int, failed: int) -> dict[str, float]:
    n = ok + failed
    return {"transfers_attempted": n, "transfers_succeeded": ok, "transfer_success": ok / n,
            "ok": n, "requests": n}  # fmt: skip


def _judge_success(ok: int, failed: int) -> CriterionResult:
    crit = Criteria(transfer_success_min=0.999, retry_rate_max=None, degrade_rate_max=None,
                    error_rate_max=None, silent_fallback_max=None, output_mismatch_max=None,
                    kv_stranded_max_s=None, overdue_requests_max=None)  # fmt: skip
    (c,) = judge_step(STEP, _transfers(ok, failed), crit, {}, C)
    return c


def test_445_transfers_without_failure_cannot_prove_999_per_mille() -> None:
    c = _judge_success(445, 0)
    assert c.result == "indeterminate" and not c.passed
    assert c.requests_needed == 2995 and c.sample_unit == "transfers"
    low, high = c.interval
    assert low == pytest.approx(0.05 ** (1 / 445), abs=1e-12)  # closed form for k = n
    assert low == pytest.approx(0.99330, abs=1e-5) and high == 1.0
    # 2,995 is the first n with (1 − c)^(1/n) ≥ 0.999, by direct search
    assert min(n for n in range(1, 5000) if 0.05 ** (1 / n) >= 0.999) == 2995


def test_3000_transfers_without_failure_pass() -> None:
    c = _judge_success(3000, 0)
    assert c.result == "pass" and c.passed and c.requests_needed is None
    assert c.interval is not None
    assert c.interval[0] == pytest.approx(0.05 ** (1 / 3000), abs=1e-12)
    assert 0.05 ** (1 / 3000) >= 0.999


@pytest.mark.parametrize(
    ("ok", "failed", "result"), [(2995, 5, "indeterminate"), (2990, 10, "fail")]
)
def test_failures_in_3000_transfers(ok: int, failed: int, result: str) -> None:
    c = _judge_success(ok, failed)
    assert c.result == result
    low, high = _cp_independent(ok, ok + failed, C)
    assert c.interval == pytest.approx((low, high), abs=1e-9)
    if result == "fail":
        assert high < 0.999 and c.requests_needed is None
    else:
        assert low < 0.999 < high
        # at 5 failures per 3,000 the rate is 0.00167 > 0.001: more transfers would fail it
        needed = c.requests_needed
        assert needed is not None and needed > 3000
        rate = failed / (ok + failed)
        assert ci.proportion_bounds(needed * (1 - rate), needed, C).high < 0.999
        assert ci.proportion_bounds((needed - 1) * (1 - rate), needed - 1, C).high >= 0.999


@pytest.mark.parametrize(
    "values",
    [
        [5.0] * 200,  # all identical, far under the threshold
        [0.4 * i for i in range(200)],  # spread, all under
        [1.0] * 199 + [99.0],  # a single slow outlier
    ],
)
def test_p99_on_200_requests_cannot_pass_whatever_the_values(values: list[float]) -> None:
    summary = {"ttft_ms": {"p99": float(sorted(values)[-2]), "count": 200.0}, "ok": 200}
    crit = Criteria(ttft_p99_ms=100, transfer_success_min=None, retry_rate_max=None,
                    degrade_rate_max=None, error_rate_max=None, silent_fallback_max=None,
                    output_mismatch_max=None, kv_stranded_max_s=None,
                    overdue_requests_max=None)  # fmt: skip
    (c,) = judge_step(STEP, summary, crit, {"ttft_ms": values}, C)
    assert c.result == "indeterminate" and c.interval[1] is None  # no upper bound exists
    assert c.requests_needed == 299
    # Independent: the n-th (largest) of n values is above the p99 with probability
    # 1 − 0.99^n, which first reaches 0.95 at n = 299.
    assert C > 1 - 0.99**200 and 1 - 0.99**298 < C <= 1 - 0.99**299
    assert ci.quantile_order_indices(299, 0.99, C)[1] == 299


def test_p99_on_200_slow_requests_is_provably_over() -> None:
    """The other side of the same bound: 200 values all above the threshold do fail it."""
    summary = {"ttft_ms": {"p99": 5000.0, "count": 200.0}, "ok": 200}
    crit = Criteria(ttft_p99_ms=100, transfer_success_min=None, retry_rate_max=None,
                    degrade_rate_max=None, error_rate_max=None, silent_fallback_max=None,
                    output_mismatch_max=None, kv_stranded_max_s=None,
                    overdue_requests_max=None)  # fmt: skip
    (c,) = judge_step(STEP, summary, crit, {"ttft_ms": [5000.0] * 200}, C)
    assert c.result == "fail"
    lo_rank, _ = ci.quantile_order_indices(200, 0.99, C)
    assert lo_rank is not None
    # Independent: P(Binomial(200, 0.99) >= l) >= 0.95 for the rank used, not for l + 1.
    assert _tail_ge(200, lo_rank, 0.99) >= C > _tail_ge(200, lo_rank + 1, 0.99)


def test_order_statistic_bounds_cover_the_true_quantile() -> None:
    """Monte Carlo: exponential samples of 400; the p99 bounds hold at least 95 % of the time."""
    rng = random.Random(7)
    true_p99 = -math.log(0.01)
    above = below = 0
    trials = 400
    for _ in range(trials):
        xs = [rng.expovariate(1.0) for _ in range(400)]
        b = ci.quantile_bounds(xs, 0.99, C)
        above += b.high is not None and b.high >= true_p99
        below += b.low is not None and b.low <= true_p99
    assert above / trials >= 0.92 and below / trials >= 0.92  # 0.95 less Monte Carlo noise


def test_poisson_and_t_bounds_against_closed_forms() -> None:
    b = ci.poisson_rate_bounds(0, 300, C)
    assert b.low == 0 and b.high == pytest.approx(-math.log(0.05) / 300, rel=1e-9)
    assert ci.poisson_needed(0, 100, 0.01, "max", C) == 300  # −ln 0.05 / 0.01 = 299.6
    xs = [float(x) for x in range(10)]  # mean 4.5, s = 3.0277
    t = ci.mean_bounds(xs, C)
    half = 1.8331129 * math.sqrt(sum((x - 4.5) ** 2 for x in xs) / 9) / math.sqrt(10)  # t table
    assert t.low == pytest.approx(4.5 - half, rel=1e-6) and t.high == pytest.approx(4.5 + half)


def test_threshold_zero_is_judged_on_the_count() -> None:
    crit = Criteria(error_rate_max=0.0, transfer_success_min=None, retry_rate_max=None,
                    degrade_rate_max=None)  # fmt: skip
    clean = {"requests": 445, "failed": 0, "error_rate": 0.0, "ok": 445}
    (c,) = [r for r in judge_step(STEP, clean, crit, {}, C) if r.name == "error_rate_max"]
    assert c.result == "pass" and c.interval[1] == pytest.approx(1 - 0.05 ** (1 / 445))
    assert "none observed in 445 requests" in c.note
    one = {**clean, "failed": 1, "error_rate": 1 / 445}
    (d,) = [r for r in judge_step(STEP, one, crit, {}, C) if r.name == "error_rate_max"]
    assert d.result == "fail" and d.requests_needed is None


def test_point_estimates_when_confidence_is_zero() -> None:
    c = judge_step(STEP, _transfers(445, 0), Criteria(transfer_success_min=0.999), {}, 0.0)[0]
    assert c.result == "pass" and c.confidence == 0 and "point estimate" in c.method
    assert c.interval == (1.0, 1.0) and c.requests_needed is None


def test_run_verdict_and_exit_codes() -> None:
    undecided = _judge_success(445, 0)
    failed = _judge_success(2990, 10)
    passed = _judge_success(3000, 0)
    assert run_verdict(True, [passed]) == "GO"
    assert run_verdict(True, [passed, undecided]) == "INCONCLUSIVE"
    assert run_verdict(True, [undecided, failed]) == "NO-GO"
    assert run_verdict(False, [passed]) == "NO-GO"
    assert EXIT_CODES == {"GO": 0, "NO-GO": 1, "INCONCLUSIVE": 3}
    # How long the undecided step must run: 2,995 transfers at the 445 / 12 s it managed.
    summary = {**_transfers(445, 0), "elapsed_s": 12.0}
    (line,) = undecided_steps([undecided], [(STEP, summary)])
    assert line.startswith(f"{STEP.id} undecided: run it for at least 81 s")
    assert "transfer_success_min: 2,995 transfers" in line


def test_difference_bounds_pair_each_low_with_the_others_high() -> None:
    d = ci.difference_bounds(ci.Bounds(1.0, 3.0), ci.Bounds(0.5, 2.0))
    assert (d.low, d.high) == (-1.0, 2.5)
    # a side without a bound leaves the difference unbounded on that side
    open_high = ci.difference_bounds(ci.Bounds(1.0, None), ci.Bounds(0.5, 2.0))
    assert (open_high.low, open_high.high) == (-1.0, None)
    assert ci.difference_bounds(ci.Bounds(1.0, 3.0), ci.Bounds(None, 2.0)).high is None


def test_a_goal_is_met_missed_or_undecided_by_its_whole_interval() -> None:
    assert ci.goal_verdict(0.2, 0.9, 1.0) == "MET"
    assert ci.goal_verdict(1.1, 1.5, 1.0) == "MISSED"
    assert ci.goal_verdict(0.8, 1.2, 1.0) == "UNDECIDED"
    # an interval open on the side that would decide it decides nothing
    assert ci.goal_verdict(-1.0, None, 3.0) == "UNDECIDED"
    assert ci.goal_verdict(None, 5.0, 3.0) == "UNDECIDED"
