"""The workload's drift over a run: in long-CoT and agentic RL the responses and the turn counts grow
several-fold as the policy trains, so the rollout:train balance a run starts with is not the one it ends
with. The scenario's `workload.drift` section (reflow/sim/config.py `Drift`) says how.

What this module owns: the arithmetic of the parametric drift (`growth_factor`: the factor a growth has
reached at a policy version; `WorkloadDrift`: the response-length factor and the mean turn count at a
version) and the choice of a run's stored groups by version (`VersionedGroups`), so a measured run's
own growth replays. The sampler (reflow/sim/costs.py `LengthSampler`) asks them at the version a group
is started at (`Simulation.version`); without a drift section nothing here is asked, and the sampler
draws exactly what it drew before drift existed.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from reflow.sim.config import Drift, Scenario


class Versioned(Protocol):
    """A stored group as far as the choice by version goes (reflow/sim/costs.py `GroupShape`)."""

    @property
    def version(self) -> int: ...


def growth_factor(growth: float, version: int, over_steps: int, shape: str = "linear") -> float:
    """The factor a growth has reached at `version`: 1 at version 0, `growth` at `over_steps` and after.
    Linear: 1 + (growth - 1) x; exponential: growth ** x (the same relative growth every version);
    x = min(version, over_steps) / over_steps."""
    if growth == 1.0:
        return 1.0
    x = min(max(version, 0), over_steps) / over_steps
    if shape == "linear":
        return 1.0 + (growth - 1.0) * x
    if shape == "exponential":
        return growth**x
    raise ValueError(f"unknown drift shape {shape!r} (linear or exponential)")


@dataclass(frozen=True)
class WorkloadDrift:
    """A scenario's parametric drift, its horizon resolved (`over_steps`, default the run's steps)."""

    cfg: Drift
    over_steps: int

    @classmethod
    def of(cls, s: Scenario) -> WorkloadDrift | None:
        """The scenario's parametric drift; None when it has none (no growth differs from 1)."""
        d = s.workload.drift
        if not d.parametric:
            return None
        return cls(d, d.over_steps or s.run.steps)

    def response_factor(self, version: int) -> float:
        """The factor on the response-length median (or on a measured length drawn) at `version`."""
        return growth_factor(self.cfg.response_growth, version, self.over_steps, self.cfg.shape)

    def turns_mean(self, turns_mean: float, version: int) -> float:
        """The mean assistant turns at `version`: the extra turns (turns_mean - 1) times the turns
        factor; the sampler still cuts at max_turns."""
        f = growth_factor(self.cfg.turns_growth, version, self.over_steps, self.cfg.shape)
        # exact when the factor is 1: 1 + (t - 1) can differ from t in the last bit
        return turns_mean if f == 1.0 else 1.0 + (turns_mean - 1.0) * f


class VersionedGroups:
    """A run's stored groups by the policy version they were started at: `near(v)` gives the groups of
    the stored version nearest v (a tie goes to the older one; past the last stored version, the last)
    and of the `window` versions either side of it, so a simulated step samples what the run generated
    at that point of its training."""

    def __init__(self, groups: Sequence[Versioned], window: int = 0) -> None:
        if not groups:
            raise ValueError("no stored groups to sample by version")
        self.window = window
        self.by_version: dict[int, list[Versioned]] = {}
        for g in groups:
            self.by_version.setdefault(g.version, []).append(g)
        self.versions = sorted(self.by_version)
        self._pools: dict[int, tuple[Versioned, ...]] = {}

    def nearest(self, version: int) -> int:
        i = bisect.bisect_left(self.versions, version)
        if i == len(self.versions):
            return self.versions[-1]
        if i == 0 or self.versions[i] == version:
            return self.versions[i]
        below, above = self.versions[i - 1], self.versions[i]
        return below if version - below <= above - version else above

    def near(self, version: int) -> tuple[Versioned, ...]:
        pool = self._pools.get(version)
        if pool is None:
            center = self.nearest(version)
            pool = tuple(
                g for v in self.versions if abs(v - center) <= self.window for g in self.by_version[v]
            )
            self._pools[version] = pool
        return pool


def describe(s: Scenario) -> str | None:
    """One line on the scenario's drift for the printed tables; None without drift."""
    d = s.workload.drift
    if d.from_versions:
        window = f" (+-{d.version_window} versions)" if d.version_window else ""
        return f"workload drift: the stored groups of the nearest stored version{window}"
    if not d.parametric:
        return None
    growth = (("response length", d.response_growth), ("extra turns", d.turns_growth))
    parts = [f"{what} x{g:g}" for what, g in growth if g != 1.0]
    return f"workload drift: {' and '.join(parts)} over {d.over_steps or s.run.steps} versions ({d.shape})"


def drifts(s: Scenario) -> bool:
    """Whether the scenario's workload changes with the policy version."""
    return s.workload.drift.parametric or s.workload.drift.from_versions
