"""The mode benchmark's arithmetic over seeds, on small inputs with results worked out by hand:
t-intervals, paired differences, geometric-mean ratios on the log scale, time-to-target ratios that
count the seeds without one."""

import math

import pytest

from reflow.recipes.bench_stats import (
    Interval,
    geometric_interval,
    mean_interval,
    paired_difference,
    paired_ratio,
    t975,
    time_ratio,
)
from reflow.recipes.bench_table import pm, signed, time_ratio_cell, times


def test_t_quantiles_are_students_not_the_normals():
    assert t975(1) == 12.7062 and t975(2) == 4.3027 and t975(30) == 2.0423
    assert t975(31) == pytest.approx(2.0395, abs=1e-4)  # the expansion past the table
    assert t975(120) == pytest.approx(1.9799, abs=1e-4)
    with pytest.raises(ValueError):
        t975(0)


def test_mean_interval_is_mean_plus_minus_t_s_over_root_n():
    # 1, 2, 3: mean 2, s = 1, half-width 4.3027 / sqrt(3) = 2.48417
    i = mean_interval([1, 2, 3])
    assert (i.mean, i.n) == (2, 3)
    assert (i.low, i.high) == pytest.approx((2 - 2.48417, 2 + 2.48417), abs=1e-5)
    # None values are left out: 2 and 4, s = sqrt(2), half-width 12.7062 x sqrt(2) / sqrt(2)
    i = mean_interval([None, 2, 4])
    assert (i.mean, i.n) == (3, 2) and (i.low, i.high) == pytest.approx((3 - 12.7062, 3 + 12.7062))
    assert mean_interval([5.0]) == Interval(5.0, None, None, 1)  # one seed: no interval
    assert mean_interval([]) is None and mean_interval([None]) is None


def test_paired_difference_uses_the_seeds_both_rows_have():
    row = {0: 0.5, 1: 0.6, 2: 0.7, 4: None}
    base = {0: 0.4, 1: 0.4, 2: 0.6, 3: 0.9, 4: 0.1}
    # seeds 0-2: differences 0.1, 0.2, 0.1; mean 0.13333, s = 0.057735, half 4.3027 x s / sqrt(3) = 0.143423
    i = paired_difference(row, base)
    assert i.n == 3 and i.mean == pytest.approx(0.133333, abs=1e-6)
    assert (i.low, i.high) == pytest.approx((0.133333 - 0.143423, 0.133333 + 0.143423), abs=1e-6)
    assert signed(i) == "+0.133 [-0.010, +0.277]"
    assert paired_difference({0: 0.5}, {1: 0.5}) is None  # no common seed


def test_ratios_are_geometric_means_with_the_interval_on_the_log_scale():
    # 1, 4, 16: log mean log(4), s = log(4), half-width 4.3027 x log(4) / sqrt(3) = 3.443784
    i = geometric_interval([1, 4, 16])
    assert i.mean == pytest.approx(4.0) and i.n == 3
    assert (i.low, i.high) == pytest.approx((4 * math.exp(-3.443784), 4 * math.exp(3.443784)), rel=1e-5)
    assert i.low * i.high == pytest.approx(16.0)  # symmetric on the log scale around the mean
    # 2x and 0.5x average to 1x, not the arithmetic mean's 1.25x
    assert geometric_interval([2.0, 0.5]).mean == pytest.approx(1.0)
    assert times(Interval(1.4142, 1.0, 2.0, 2)) == "1.41x [1.00, 2.00]"
    # per-seed ratios row / base; a zero rate has no ratio
    assert paired_ratio({0: 250.0, 1: 1000.0, 2: 0.0}, {0: 500.0, 1: 500.0, 2: 500.0}).mean == pytest.approx(
        1.0
    )
    with pytest.raises(ValueError):
        geometric_interval([0.0])


def test_time_ratio_counts_each_seed_without_a_ratio_by_why():
    row = {0: 10.0, 1: None, 2: 20.0, 3: None, 4: 0.0, 5: 15.0, 6: 30.0}
    base = {0: 20.0, 1: 30.0, 2: 40.0, 3: None, 4: 10.0, 5: None, 7: 5.0}
    t = time_ratio(row, base)
    # seeds 0 and 2: sync's 20/10 and 40/20; seed 6 ran no sync and seed 7 no row: not paired
    assert t.ratio == Interval(2.0, 2.0, 2.0, 2)
    assert (t.row_missed, t.base_missed, t.neither, t.at_start) == (1, 1, 1, 1)
    assert time_ratio_cell(t) == (
        "2.00x [2.00, 2.00] (n=2, row never reached 1, sync never reached 1, neither reached 1, "
        "met at the start 1)"
    )
    assert time_ratio_cell(time_ratio({0: None}, {0: 10.0})) == "- (n=0, row never reached 1)"
    # with a budget, a side that never reached the target counts as the budget (named): seed 1 30/60,
    # seed 3 60/60, seed 5 60/15; the time-0 seed still has no ratio
    b = time_ratio(row, base, budget=60.0)
    assert b.ratio is not None and b.ratio.n == 5
    assert b.ratio.mean == pytest.approx((2.0 * 0.5 * 2.0 * 1.0 * 4.0) ** (1 / 5))
    assert (b.row_missed, b.base_missed, b.neither, b.at_start, b.budget) == (1, 1, 1, 1, 60.0)
    assert time_ratio_cell(b, "async").endswith(
        "(n=5, row never reached 1, async never reached 1, neither reached 1, met at the start 1, missed = 60 s)"
    )


def test_cells_show_the_mean_and_the_half_width():
    assert pm(mean_interval([10, 20])) == "15 ± 63.5"  # s = 7.07, 12.7062 x 7.07 / sqrt(2)
    assert pm(mean_interval([0.4])) == "0.4" and pm(None) == "-"
    assert signed(mean_interval([0.05])) == "+0.050"
