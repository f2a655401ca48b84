"""The mode benchmark's arithmetic over seeds (`reflow bench modes`): a mean with its 95% interval
(t-distribution), paired-by-seed differences against a baseline row, and ratios as the geometric mean
of per-seed ratios with the interval taken on the log scale. Pure arithmetic, no numpy or scipy.

A benchmark has few seeds (3-10), so the interval uses Student's t with n - 1 degrees of freedom, not
the normal 1.96; one seed gives a mean and no interval.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

T975 = (
    12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281,
    2.2010, 2.1788, 2.1604, 2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860,
    2.0796, 2.0739, 2.0687, 2.0639, 2.0595, 2.0555, 2.0518, 2.0484, 2.0452, 2.0423,
)  # fmt: skip
"""The 0.975 quantile of Student's t with 1..30 degrees of freedom (a two-sided 95% interval)."""
_Z975 = 1.959963984540054


def t975(df: int) -> float:
    """The 0.975 quantile of Student's t with `df` degrees of freedom: the table up to 30, then the
    Cornish-Fisher expansion around the normal quantile (within 1e-5 of the exact value from 30 on)."""
    if df < 1:
        raise ValueError(f"t quantile needs df >= 1, got {df}")
    if df <= len(T975):
        return T975[df - 1]
    z = _Z975
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    return z + g1 / df + g2 / df**2 + g3 / df**3


@dataclass(frozen=True)
class Interval:
    """A mean over `n` seeds and its 95% interval (low and high None with one seed)."""

    mean: float
    low: float | None
    high: float | None
    n: int


def mean_interval(values: Iterable[float | None]) -> Interval | None:
    """The mean of the values given (None ones left out) and mean ± t(n-1) s / sqrt(n); None when no
    value is given."""
    xs = [float(v) for v in values if v is not None]
    if not xs:
        return None
    mean = statistics.fmean(xs)
    if len(xs) == 1:
        return Interval(mean, None, None, 1)
    half = t975(len(xs) - 1) * statistics.stdev(xs) / math.sqrt(len(xs))
    return Interval(mean, mean - half, mean + half, len(xs))


def geometric_interval(ratios: Iterable[float]) -> Interval | None:
    """The geometric mean of positive ratios and its 95% interval, both computed on log(ratio) and
    mapped back (an interval that is symmetric for 2x and 0.5x)."""
    logs = []
    for r in ratios:
        if not r > 0:
            raise ValueError(f"a ratio must be positive, got {r}")
        logs.append(math.log(r))
    i = mean_interval(logs)
    if i is None:
        return None
    back = [None if x is None else math.exp(x) for x in (i.low, i.high)]
    return Interval(math.exp(i.mean), back[0], back[1], i.n)


def paired(row: Mapping[int, float | None], base: Mapping[int, float | None]) -> list[tuple[float, float]]:
    """(row's value, base's value) per seed that both have a value for, in seed order."""
    out = []
    for seed in sorted(row):
        r, b = row[seed], base.get(seed)
        if r is not None and b is not None:
            out.append((r, b))
    return out


def paired_difference(row: Mapping[int, float | None], base: Mapping[int, float | None]) -> Interval | None:
    """Mean of the per-seed differences row - base with its 95% interval (seeds both have)."""
    return mean_interval(r - b for r, b in paired(row, base))


def paired_ratio(row: Mapping[int, float | None], base: Mapping[int, float | None]) -> Interval | None:
    """Geometric mean of the per-seed ratios row / base with its interval on the log scale; seeds with
    a value of 0 on either side have no ratio and are left out."""
    return geometric_interval(r / b for r, b in paired(row, base) if r > 0 and b > 0)


@dataclass(frozen=True)
class TimeRatio:
    """How much sooner a row reached a target than the base row, seed by seed."""

    ratio: Interval | None
    """base's time / the row's (> 1: the row was sooner), over the seeds in the ratio: those where both
    reached the target, and with a `budget` also those where one or neither never did."""
    row_missed: int
    """Seeds where the base reached the target and the row never did within the budget."""
    base_missed: int
    """Seeds where the row reached it and the base never did."""
    neither: int
    """Seeds where neither did."""
    at_start: int
    """Seeds where one side met the target at its first evaluation (time 0): no ratio."""
    budget: float | None = None
    """Set: a run that never reached the target counts as this many seconds (and is flagged by the
    counts above); None: such seeds are left out of the ratio."""


def time_ratio(
    row: Mapping[int, float | None], base: Mapping[int, float | None], budget: float | None = None
) -> TimeRatio:
    """Per seed that both rows ran, base time / row time to a target (None: never reached). The seeds
    where a side never reached it are counted by why, never dropped silently; with a `budget` they
    also enter the ratio with that side's time taken as the budget. The budget is a lower bound of a
    missing side's time: it flatters a row that missed (base / budget, the true ratio is lower) and
    understates a row whose base missed; the counts say how many seeds each holds."""
    ratios, row_missed, base_missed, neither, at_start = [], 0, 0, 0, 0
    for seed in sorted(s for s in row if s in base):
        r, b = row[seed], base[seed]
        if (r is not None and r <= 0) or (b is not None and b <= 0):
            at_start += 1
            continue
        if r is None and b is None:
            neither += 1
        elif r is None:
            row_missed += 1
        elif b is None:
            base_missed += 1
        if budget is not None:
            ratios.append((budget if b is None else b) / (budget if r is None else r))
        elif r is not None and b is not None:
            ratios.append(b / r)
    return TimeRatio(geometric_interval(ratios), row_missed, base_missed, neither, at_start, budget)
