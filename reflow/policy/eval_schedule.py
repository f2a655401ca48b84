"""When a training loop takes a held-out evaluation point: every `every_s` seconds of training
wall-clock (`eval.every_s`), not every N steps.

Comparing modes by time to a target needs evaluation points on the same clock for every mode: on a
step schedule a mode that takes more steps per second is also evaluated more often, and so crosses
a noisy target sooner by chance alone. Points fall on the grid every_s, 2 every_s, ...: a loop checks
`due(wall_s)` after each step; a step that passes several grid points (a slow step, a resumed run)
takes one point, not a burst, and the next one is due at the next grid point after it.

A plain object: the training seconds come in, a yes/no goes out; no clock of its own, no I/O.
"""

from __future__ import annotations

import math


class EvalSchedule:
    def __init__(self, every_s: float, after_s: float = 0.0) -> None:
        """`every_s` > 0: the grid's spacing; `after_s`: training seconds of the last point taken
        (0 at the start of a run; a resumed run passes its last evaluation's), so the first one is
        due at the first grid point after it."""
        if not every_s > 0 or math.isinf(every_s):
            raise ValueError(f"every_s must be a positive number of seconds, got {every_s}")
        if after_s < 0:
            raise ValueError(f"after_s must be >= 0, got {after_s}")
        self.every_s = every_s
        self.next_s = self._grid_after(after_s)

    def _grid_after(self, wall_s: float) -> float:
        return (math.floor(wall_s / self.every_s + 1e-9) + 1) * self.every_s

    def due(self, wall_s: float) -> bool:
        """Whether a point is due at training second `wall_s`; if so, it counts as taken."""
        if wall_s + 1e-9 < self.next_s:
            return False
        self.next_s = self._grid_after(wall_s)
        return True
