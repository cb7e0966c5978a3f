"""Statistics: known values and properties that must hold for any sample."""

from __future__ import annotations

import itertools
import math
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdx.link import stats

finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False)
positive = st.floats(min_value=0.0, max_value=1e4, allow_nan=False, allow_infinity=False)


def test_rfc3550_jitter_follows_the_recurrence_by_hand() -> None:
    # transits 10, 12, 11: D = 2 then 1 -> J = 2/16, then J += (1 - J)/16
    j1 = 2 / 16
    assert stats.rfc3550_jitter([10, 12, 11]) == pytest.approx(j1 + (1 - j1) / 16)


def test_rfc3550_jitter_converges_to_a_constant_alternation() -> None:
    # Alternating transits 0, 1, 0, 1... make |D| = 1 every time, so J -> 1.
    assert stats.rfc3550_jitter([i % 2 for i in range(2000)]) == pytest.approx(1.0, abs=1e-9)


@given(st.lists(finite, max_size=200))
def test_jitter_is_between_zero_and_the_largest_step(values: list[float]) -> None:
    j = stats.rfc3550_jitter(values)
    steps = [abs(b - a) for a, b in itertools.pairwise(values)]
    assert 0 <= j <= (max(steps) if steps else 0) + 1e-9


@given(finite, st.integers(min_value=0, max_value=100))
def test_jitter_of_a_constant_delay_is_zero(value: float, n: int) -> None:
    assert stats.rfc3550_jitter([value] * n) == 0


@given(st.lists(finite, min_size=1, max_size=300))
def test_summary_orders_its_percentiles(values: list[float]) -> None:
    s = stats.summarize(values)
    assert s.min <= s.p50 <= s.p90 <= s.p99 <= s.p999 <= s.max
    assert s.min - 1e-6 <= s.mean <= s.max + 1e-6
    assert s.count == len(values)


def test_percentile_interpolates_linearly() -> None:
    assert stats.percentile([1, 2, 3, 4], 50) == 2.5
    assert stats.percentile([0, 10], 99) == pytest.approx(9.9)
    with pytest.raises(ValueError):
        stats.percentile([], 50)


def test_ipdv_skips_pairs_broken_by_loss() -> None:
    # seq 2 lost: only pairs (0,1) and (3,4) count
    assert stats.ipdv([(0, 1.0), (1, 1.5), (3, 4.0), (4, 3.0)]) == [0.5, 1.0]


@given(st.integers(min_value=0, max_value=400), st.data())
def test_loss_runs_account_for_every_lost_probe(sent: int, data: st.DataObject) -> None:
    received = data.draw(st.sets(st.integers(min_value=0, max_value=max(0, sent - 1))))
    received = {r for r in received if r < sent}
    runs = stats.loss_runs(sent, received)
    assert runs.lost == sent - len(received)
    assert runs.bursts <= runs.lost
    assert runs.max_burst <= runs.lost
    assert (runs.bursts == 0) == (runs.lost == 0)
    assert runs.bursts * runs.max_burst >= runs.lost


def test_loss_runs_known_pattern() -> None:
    # lost: 1,2 | 5 | 7,8,9  (of 0..9)
    runs = stats.loss_runs(10, [0, 3, 4, 6])
    assert (runs.lost, runs.bursts, runs.max_burst) == (6, 3, 3)


def test_t_table_values_and_limits() -> None:
    assert stats.t_quantile_975(1) == 12.706
    assert stats.t_quantile_975(30) == 2.042
    assert 2.021 < stats.t_quantile_975(35) < 2.042
    assert stats.t_quantile_975(10**9) == pytest.approx(1.96, abs=1e-3)
    with pytest.raises(ValueError):
        stats.t_quantile_975(0)


@given(st.integers(min_value=1, max_value=5000))
def test_t_quantile_decreases_with_more_samples(df: int) -> None:
    assert stats.t_quantile_975(df + 1) <= stats.t_quantile_975(df)
    assert stats.t_quantile_975(df) > 1.959


def test_mean_ci_matches_the_textbook_formula() -> None:
    samples = [9.0, 10.0, 11.0, 10.0, 10.0]
    ci = stats.mean_ci95(samples)
    expected = 2.776 * statistics.stdev(samples) / math.sqrt(5)
    assert ci.mean == 10.0
    assert ci.half_width == pytest.approx(expected)
    assert ci.relative_pct == pytest.approx(100 * expected / 10)
    assert stats.mean_ci95([3.0]).relative_pct == math.inf


@settings(max_examples=50)
@given(st.lists(positive, min_size=2, max_size=100))
def test_mean_ci_contains_the_mean(samples: list[float]) -> None:
    ci = stats.mean_ci95(samples)
    assert ci.low <= ci.mean <= ci.high
    assert ci.half_width >= 0


@given(st.integers(min_value=1, max_value=10**6), st.data())
def test_wilson_interval_is_a_proper_interval(trials: int, data: st.DataObject) -> None:
    k = data.draw(st.integers(min_value=0, max_value=trials))
    lo, hi = stats.wilson_interval(k, trials)
    assert 0 <= lo <= k / trials <= hi <= 1


def test_wilson_interval_known_value() -> None:
    # 0 of 100 lost: the upper bound is z^2/(n+z^2) = 3.70 %
    lo, hi = stats.wilson_interval(0, 100)
    assert lo == 0 and hi == pytest.approx(0.0370, abs=2e-4)
    lo, hi = stats.wilson_interval(20, 1000)  # 2 %: about 1.30 % .. 3.07 %
    assert lo == pytest.approx(0.0130, abs=3e-4) and hi == pytest.approx(0.0307, abs=3e-4)


def test_goodput_window_drops_slow_start_and_a_byte_capped_tail() -> None:
    from pdx.link.phases import _window_samples

    bins = {i: 125_000 for i in range(10)}  # 0.1 s bins of 125 kB = 10 Mbit/s
    samples = _window_samples(bins, omit_s=0.2, duration_s=1.0, interval_s=0.1)
    assert samples == pytest.approx([0.01] * 8)
    capped = {i: 125_000 for i in range(5)} | {5: 1_000}  # byte cap hit inside bin 5
    assert _window_samples(capped, 0.2, 1.0, 0.1, capped=True) == pytest.approx([0.01] * 3)
