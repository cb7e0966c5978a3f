"""Statistics for link probes: percentiles, RFC 3550 jitter, IPDV, loss bursts, intervals.

Hand-written where the formula is the specification (RFC 3550 jitter, loss runs) or where
the usual library is not a dependency (scipy): the Student t quantile comes from a small
table and the binomial interval is Wilson's closed form.
"""

from __future__ import annotations

import bisect
import itertools
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

# Two-sided 95 % Student t quantiles (t_{0.975, df}); between rows we interpolate in 1/df,
# which is how printed tables are meant to be read.
_T975: tuple[tuple[int, float], ...] = (
    (1, 12.706),
    (2, 4.303),
    (3, 3.182),
    (4, 2.776),
    (5, 2.571),
    (6, 2.447),
    (7, 2.365),
    (8, 2.306),
    (9, 2.262),
    (10, 2.228),
    (11, 2.201),
    (12, 2.179),
    (13, 2.160),
    (14, 2.145),
    (15, 2.131),
    (16, 2.120),
    (17, 2.110),
    (18, 2.101),
    (19, 2.093),
    (20, 2.086),
    (21, 2.080),
    (22, 2.074),
    (23, 2.069),
    (24, 2.064),
    (25, 2.060),
    (26, 2.056),
    (27, 2.052),
    (28, 2.048),
    (29, 2.045),
    (30, 2.042),
    (40, 2.021),
    (60, 2.000),
    (120, 1.980),
)
_Z975 = 1.959964


@dataclass(frozen=True)
class Summary:
    """Distribution summary of a sample (same unit as the input)."""

    count: int
    min: float
    mean: float
    stddev: float
    p50: float
    p90: float
    p99: float
    p999: float
    max: float


@dataclass(frozen=True)
class MeanInterval:
    """Mean of interval samples with its two-sided 95 % confidence interval."""

    mean: float
    half_width: float
    count: int

    @property
    def low(self) -> float:
        """Lower end of the interval."""
        return self.mean - self.half_width

    @property
    def high(self) -> float:
        """Upper end of the interval."""
        return self.mean + self.half_width

    @property
    def relative_pct(self) -> float:
        """Half-width as a percentage of the mean (inf when the mean is 0 or unknown)."""
        if self.count < 2 or self.mean <= 0:
            return math.inf
        return 100.0 * self.half_width / self.mean


@dataclass(frozen=True)
class LossRuns:
    """Lost probes grouped into bursts of consecutive sequence numbers."""

    lost: int
    bursts: int
    max_burst: int


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (``q`` in 0..100), as numpy's default method."""
    if not values:
        raise ValueError("percentile of an empty sample")
    return float(np.percentile(np.asarray(values, dtype=float), q))


def summarize(values: Sequence[float]) -> Summary:
    """Min, mean, sample stddev and the percentiles users ask for (p50..p99.9, max)."""
    if not values:
        raise ValueError("summary of an empty sample")
    arr = np.asarray(values, dtype=float)
    p50, p90, p99, p999 = (float(x) for x in np.percentile(arr, [50, 90, 99, 99.9]))
    stddev = float(arr.std(ddof=1)) if arr.size > 1 else 0.0
    return Summary(
        count=int(arr.size),
        min=float(arr.min()),
        mean=float(arr.mean()),
        stddev=stddev,
        p50=p50,
        p90=p90,
        p99=p99,
        p999=p999,
        max=float(arr.max()),
    )


def rfc3550_jitter(transit: Iterable[float]) -> float:
    """Smoothed interarrival jitter of RFC 3550 section 6.4.1: ``J += (|D| - J) / 16``.

    ``transit`` is the per-packet transit time (here the round-trip time) in arrival order;
    ``D`` is the difference between consecutive transits.
    """
    jitter = 0.0
    previous: float | None = None
    for value in transit:
        if previous is not None:
            jitter += (abs(value - previous) - jitter) / 16.0
        previous = value
    return jitter


def ipdv(delays_by_seq: Sequence[tuple[int, float]]) -> list[float]:
    """Absolute delay variation between probes with consecutive sequence numbers (RFC 5481).

    Pairs where either probe was lost are skipped, so loss never shows up as variation.
    """
    ordered = sorted(delays_by_seq)
    out: list[float] = []
    for (seq_a, d_a), (seq_b, d_b) in itertools.pairwise(ordered):
        if seq_b == seq_a + 1:
            out.append(abs(d_b - d_a))
    return out


def loss_runs(sent: int, received: Iterable[int]) -> LossRuns:
    """Count lost sequence numbers in ``0..sent-1`` and group them into bursts."""
    got = {s for s in received if 0 <= s < sent}
    lost = bursts = longest = run = 0
    for seq in range(sent):
        if seq in got:
            run = 0
            continue
        lost += 1
        if run == 0:
            bursts += 1
        run += 1
        longest = max(longest, run)
    return LossRuns(lost=lost, bursts=bursts, max_burst=longest)


def t_quantile_975(df: int) -> float:
    """Two-sided 95 % Student t critical value for ``df`` degrees of freedom."""
    if df < 1:
        raise ValueError("degrees of freedom must be >= 1")
    dfs = [row[0] for row in _T975]
    if df >= dfs[-1]:
        # Between 120 and infinity, interpolate linearly in 1/df towards the normal quantile.
        last_df, last_t = _T975[-1]
        return _Z975 + (last_t - _Z975) * (last_df / df)
    i = bisect.bisect_left(dfs, df)
    if dfs[i] == df:
        return _T975[i][1]
    (lo_df, lo_t), (hi_df, hi_t) = _T975[i - 1], _T975[i]
    frac = (1 / df - 1 / hi_df) / (1 / lo_df - 1 / hi_df)
    return hi_t + (lo_t - hi_t) * frac


def mean_ci95(samples: Sequence[float]) -> MeanInterval:
    """Mean and 95 % confidence half-width from Student t (``inf`` with fewer than 2 samples)."""
    n = len(samples)
    if n == 0:
        return MeanInterval(mean=math.nan, half_width=math.inf, count=0)
    mean = statistics.fmean(samples)
    if n < 2:
        return MeanInterval(mean=mean, half_width=math.inf, count=1)
    sd = statistics.stdev(samples)
    return MeanInterval(mean=mean, half_width=t_quantile_975(n - 1) * sd / math.sqrt(n), count=n)


def wilson_interval(successes: int, trials: int) -> tuple[float, float]:
    """Wilson 95 % score interval for a binomial proportion (e.g. lost/sent)."""
    if trials <= 0:
        return (0.0, 1.0)
    if not 0 <= successes <= trials:
        raise ValueError("successes must be within 0..trials")
    z2 = _Z975 * _Z975
    p = successes / trials
    denom = 1 + z2 / trials
    centre = (p + z2 / (2 * trials)) / denom
    spread = _Z975 * math.sqrt(p * (1 - p) / trials + z2 / (4 * trials * trials)) / denom
    # Clamp rounding so the interval always contains the observed proportion.
    return (max(0.0, min(p, centre - spread)), min(1.0, max(p, centre + spread)))


def clopper_pearson(k: float, n: float, confidence: float) -> tuple[float, float]:
    """One-sided Clopper–Pearson (exact binomial) bounds on a proportion from ``k`` of ``n``.

    ``(0, 1)`` when there is no sample; ``k`` may be fractional (a scaled share).
    """
    from scipy import stats as sps

    if n <= 0:
        return 0.0, 1.0
    alpha = 1.0 - confidence
    low = 0.0 if k <= 0 else float(sps.beta.ppf(alpha, k, n - k + 1))
    high = 1.0 if k >= n else float(sps.beta.ppf(confidence, k + 1, n - k))
    return low, high
