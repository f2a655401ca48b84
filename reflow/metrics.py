"""Run metrics defined once, for the real runs (reflow/recipes/run_log.py) and the cluster simulator
(reflow/sim/metrics.py): the idle ratio and the order-statistic quantile their summaries report.

Pure arithmetic, no Ray and no torch, so the simulator and the CLI can import it without a device.
"""

from __future__ import annotations

from collections.abc import Sequence


def idle_ratio(busy_s: float, wall_s: float) -> float:
    """Idle share of wall-clock. Work that went on while an evaluation paused the clock can make busy
    time exceed it by a little: clamped to [0, 1]."""
    return min(1.0, max(0.0, 1 - busy_s / max(wall_s, 1e-9)))


def quantile(values: Sequence[float], q: float) -> float:
    """The q-quantile as the order statistic at index floor(q * n) (0.0 for no values): no
    interpolation, so a reported p99 is a value that was observed."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
