"""Confidence bounds for acceptance criteria, and how large a sample would decide one.

Every bound here is one-sided at the confidence ``c`` asked for: a criterion passes when its
one-sided bound on the safe side clears the threshold, fails when the bound on the other side is
beyond it, and is indeterminate otherwise. The pair ``[low, high]`` is therefore a two-sided
interval at ``2c − 1`` (0.90 for c = 0.95), and each decision is a test at level ``1 − c``.

- proportions (success, error, degrade, silent-fallback, mismatch, overdue shares): exact
  binomial bounds (Clopper–Pearson) from the beta distribution;
- counts per exposure that may exceed one per unit (retries per transfer): exact Poisson
  bounds (Garwood) from the chi-square distribution;
- quantiles (p50, p99 of latencies): distribution-free bounds from order statistics — the
  k-th smallest of n values is above the q-quantile with probability P(Binomial(n, q) < k);
- means (across repeated runs): Student t bounds.

The distributions come from ``scipy.stats``; nothing here reads pdx data structures, so other
parts of pdx (the simulator's prediction error, for example) can use the same bounds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
from scipy import stats as sps

from pdx.link.stats import clopper_pearson

Kind = Literal["max", "min"]
Result = Literal["pass", "fail", "indeterminate", "not_measured"]

_MAX_SAMPLE = 10**9  # beyond this, "requests needed" is reported as unknown (None)


@dataclass(frozen=True)
class Bounds:
    """One-sided lower and upper bounds (``None`` = unbounded on that side)."""

    low: float | None
    high: float | None

    def as_pair(self) -> tuple[float | None, float | None]:
        """``(low, high)`` for reports."""
        return (self.low, self.high)


def proportion_bounds(k: float, n: float, confidence: float) -> Bounds:
    """Clopper–Pearson bounds on a proportion from ``k`` of ``n`` (``k`` may be fractional)."""
    return Bounds(*clopper_pearson(k, n, confidence))


def poisson_rate_bounds(k: float, exposure: float, confidence: float) -> Bounds:
    """Garwood bounds on events per unit of exposure (e.g. retries per transfer)."""
    if exposure <= 0:
        return Bounds(0.0, None)
    alpha = 1.0 - confidence
    low = 0.0 if k <= 0 else float(sps.chi2.ppf(alpha, 2 * k)) / 2
    high = float(sps.chi2.ppf(confidence, 2 * k + 2)) / 2
    return Bounds(low / exposure, high / exposure)


def quantile_order_indices(n: int, q: float, confidence: float) -> tuple[int | None, int | None]:
    """1-based ranks ``(l, u)`` of the order statistics bounding the q-quantile (None = none).

    ``u`` is the smallest rank with P(Binomial(n, q) ≤ u − 1) ≥ c, so the u-th smallest value is
    at or above the quantile with probability ≥ c; ``l`` is the largest rank with
    P(Binomial(n, q) ≥ l) ≥ c. For p99 an upper rank exists only from n = 299 at c = 0.95.
    """
    if n <= 0:
        return None, None
    ranks = np.arange(n)  # r = rank − 1
    cdf = sps.binom.cdf(ranks, n, q)  # P(B ≤ rank − 1)
    sf = sps.binom.sf(ranks, n, q)  # P(B > rank − 1) = P(B ≥ rank)
    up = np.nonzero(cdf >= confidence)[0]
    lo = np.nonzero(sf >= confidence)[0]
    return (int(lo[-1]) + 1 if lo.size else None), (int(up[0]) + 1 if up.size else None)


def quantile_bounds(values: Sequence[float], q: float, confidence: float) -> Bounds:
    """Distribution-free bounds on the q-quantile (0 < q < 1) of what ``values`` sample."""
    xs = np.sort(np.asarray(values, dtype=float))
    lo, up = quantile_order_indices(len(xs), q, confidence)
    return Bounds(
        float(xs[lo - 1]) if lo is not None else None,
        float(xs[up - 1]) if up is not None else None,
    )


def difference_bounds(a: Bounds, b: Bounds) -> Bounds:
    """Bounds on a − b from bounds on each (a's low − b's high, a's high − b's low): when each
    side's two bounds hold at c, these hold together at 1 − 2(1 − c) or better."""
    low = None if a.low is None or b.high is None else a.low - b.high
    high = None if a.high is None or b.low is None else a.high - b.low
    return Bounds(low, high)


def mean_bounds(values: Sequence[float], confidence: float) -> Bounds:
    """Student t bounds on the mean (None on both sides with fewer than two values)."""
    xs = np.asarray(values, dtype=float)
    if len(xs) < 2:
        return Bounds(None, None)
    half = (
        float(sps.t.ppf(confidence, len(xs) - 1)) * float(np.std(xs, ddof=1)) / math.sqrt(len(xs))
    )
    mean = float(np.mean(xs))
    return Bounds(mean - half, mean + half)


def decide(bounds: Bounds, threshold: float, kind: Kind) -> Result:
    """Pass when the whole interval clears the threshold, fail when it is wholly beyond."""
    low, high = bounds.low, bounds.high
    if kind == "max":
        if high is not None and high <= threshold:
            return "pass"
        if low is not None and low > threshold:
            return "fail"
    else:
        if low is not None and low >= threshold:
            return "pass"
        if high is not None and high < threshold:
            return "fail"
    return "indeterminate"


GOAL_VERDICTS = {"pass": "MET", "fail": "MISSED", "indeterminate": "UNDECIDED"}


def goal_verdict(low: float | None, high: float | None, goal: float) -> str:
    """A benchmark's goal "at most ``goal``" judged from an interval as :func:`decide` judges
    a criterion: MET (all of it at or under), MISSED (all of it over), else UNDECIDED."""
    return GOAL_VERDICTS[decide(Bounds(low, high), goal, "max")]


def _smallest(decided: Callable[[int], bool], start: int) -> int | None:
    """The smallest n ≥ start with ``decided(n)`` (monotone), or None beyond the search cap."""
    n = max(1, start)
    if decided(n):
        return n
    lo, hi = n, n * 2
    while not decided(hi):
        lo, hi = hi, hi * 2
        if hi > _MAX_SAMPLE:
            return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if decided(mid) else (mid, hi)
    return hi


def proportion_needed(
    k: int, n: int, threshold: float, kind: Kind, confidence: float
) -> int | None:
    """Sample size at which the observed proportion k/n would decide the criterion.

    The observed rate is kept as the sample grows (``k`` scales with it); None when the rate
    equals the threshold (no sample decides it) or the answer is beyond 10⁹.
    """
    if n <= 0:
        return None
    rate = k / n
    if math.isclose(rate, threshold, rel_tol=0, abs_tol=1e-15):
        return None

    def decided(m: int) -> bool:
        return decide(proportion_bounds(rate * m, m, confidence), threshold, kind) != (
            "indeterminate"
        )

    return _smallest(decided, n)


def poisson_needed(
    k: int, exposure: int, threshold: float, kind: Kind, confidence: float
) -> int | None:
    """Exposure (e.g. transfers) at which the observed event rate would decide the criterion."""
    if exposure <= 0:
        return None
    rate = k / exposure
    if math.isclose(rate, threshold, rel_tol=0, abs_tol=1e-15):
        return None

    def decided(m: int) -> bool:
        return decide(poisson_rate_bounds(rate * m, m, confidence), threshold, kind) != (
            "indeterminate"
        )

    return _smallest(decided, exposure)


def quantile_needed(
    values: Sequence[float], q: float, threshold: float, confidence: float
) -> int | None:
    """The smallest sample size from which the observed share of values ≤ threshold decides
    the q-quantile against ``threshold`` (a maximum) *for every larger sample*: pass once the
    upper bound is ≤ it, fail once the lower bound is above it. None when that share equals q.

    The decision is not monotone in the sample size (the count under the threshold is a
    rounded share of it), so the first deciding size is not the answer: sizes are scanned
    upward from the sample's own to well past the first deciding one (four times it, where the
    margin is twice what deciding needs and rounding can no longer undo it).
    """
    n = len(values)
    if n == 0:
        return None
    share = sum(1 for v in values if v <= threshold) / n
    if math.isclose(share, q, rel_tol=0, abs_tol=1e-12):
        return None
    first = _smallest(lambda m: bool(_quantile_decided(share, q, confidence, np.array([m]))[0]), n)
    if first is None:
        return None
    sizes = np.arange(n, max(4 * first, first + 1000) + 1)
    undecided = sizes[~_quantile_decided(share, q, confidence, sizes)]
    return int(undecided[-1]) + 1 if undecided.size else n


def _quantile_decided(share: float, q: float, confidence: float, sizes: np.ndarray) -> np.ndarray:
    """For each sample size m: whether m values, ``share`` of them ≤ the threshold, decide."""
    below = np.floor(share * sizes + 1e-9)  # values ≤ threshold in a sample of m
    if share > q:  # upper bound = rank u ≤ below  ⇔  P(B ≤ below − 1) ≥ c
        return np.asarray(sps.binom.cdf(below - 1, sizes, q) >= confidence)
    return np.asarray(sps.binom.sf(below, sizes, q) >= confidence)  # lower rank > below


def mean_needed(values: Sequence[float], threshold: float, confidence: float) -> int | None:
    """Values needed (same mean and spread) for the t bounds to clear or pass the threshold."""
    xs = np.asarray(values, dtype=float)
    if len(xs) < 2:
        return None
    mean, sd = float(np.mean(xs)), float(np.std(xs, ddof=1))
    gap = abs(mean - threshold)
    if gap == 0:
        return None
    if sd == 0:
        return len(xs)

    def decided(m: int) -> bool:
        return float(sps.t.ppf(confidence, max(m - 1, 1))) * sd / math.sqrt(m) < gap

    return _smallest(decided, len(xs))


def rate_bound_if_none_seen(n: int, confidence: float) -> float:
    """Upper bound on a rate when none of ``n`` showed it: 1 − (1 − c)^(1/n)."""
    return 1.0 - (1.0 - confidence) ** (1.0 / n) if n > 0 else 1.0


def none_seen_needed(rate_bound: float, confidence: float) -> int | None:
    """The smallest n whose "none of n" bounds the rate at or below ``rate_bound``.

    n = ⌈ln(1 − c) / ln(1 − bound)⌉ (299 for 1 % at 95 %); None for a bound of 0 (no n does).
    """
    if rate_bound <= 0:
        return None
    if rate_bound >= 1:
        return 1
    n = max(1, math.ceil(math.log(1.0 - confidence) / math.log1p(-rate_bound) - 1e-9))
    while rate_bound_if_none_seen(n, confidence) > rate_bound:  # guard the float rounding
        n += 1
    return n
