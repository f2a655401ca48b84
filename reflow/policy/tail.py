"""The tail policy: what to do with a batch's episodes that are still running.

A plain object, observations in, decisions out; no Ray, no clock, no I/O. The Ray runtime
(`reflow.runtime.tail`) and the cluster simulator (`reflow.sim.policies`) build the same
`TailObservation` with `observe` (in-flight episodes with their progress, the engines' occupancy and
measured tokens/s curves, the quantiles of the durations seen so far) and apply the actions it returns
through their `reflow.policy.actuator.Actuator` (`apply_tail`). Each action carries a `reason` with the
numbers behind it: it becomes a metrics event.

The actions and their rules (B = groups per train step):

- `OverProvision`: start B + delta groups and train on the first B done. delta grows with the tail's
  heaviness h = p90 / p50 of completed group durations:
      delta = min(ceil(B * (1 - 1 / h)), floor(B * over_provision_max))
  (h = 1, no tail: delta = 0; h = 2: half a batch more; never more than the configured share), and
  0 until `min_samples` groups have been seen.
- `CarryOver`: once B groups are done, the unfinished ones continue into the next step as partial
  rollouts (token ids, log-probs and per-token versions kept) instead of being waited for.
- `Migrate` + `FreeSlot` (consolidation): when no group of the batch waits for an engine and the
  running episodes fit on fewer engines (by each engine's concurrency limit), the episodes of the
  least-loaded engines move to the others (resubmitting their exact token prefix) when
      re-prefill seconds = tokens to re-prefill / prefill tokens/s  <  saved / consolidate_margin
  where saved = the predicted remaining seconds of the longest episode on the source engine, the
  time that engine would otherwise stay held by its stragglers. An engine left with nothing is
  freed: for the next batch when the driver has room to start its groups, else for the trainer.
- `SetConcurrency`: per engine, the knee of its measured (concurrency, tokens/s) curve, the
  smallest c with tokens/s >= (1 - saturation_eps) * max; more sequences than that add latency,
  not throughput. A limit is lowered to the knee only when the curve saturates: some concurrency
  above the knee was measured. A curve still rising at its highest point says nothing about more
  sequences, and a limit set there could never measure them (the limit would only ratchet down).
  Opt-in (`set_concurrency: true`): only TorchEngine reports the counters a curve is drawn from, and
  there, on a CPU shared with the trainer and the envs (its intervals mix prefill, tool turns and the
  trainer's load), the knee read too low: 2-17 sequences in runs where the engine, held at 8, gave
  less than half the tokens/s it gave at its full batch of 64 (docs/results.md, "The tail
  scheduler's concurrency limit on the CPU engine").

`migrate: false` keeps every episode on its engine (only engines already empty are freed) and
`set_concurrency: false` (the default) leaves the limits alone: ablations of those two actions.

Predicted remaining time (`remaining_seconds`) is read off the completed-episode quantiles: an
episode running s seconds has at least until the next quantile it has not reached (p50, p90, p99)
to go; past p99 the tail is taken as Pareto, fitted to p90 and p99 (alpha = ln 10 / ln(p99/p90)),
whose median remaining life is s * (2 ** (1 / alpha) - 1). Low estimates on purpose: a migration
that pays off on a low estimate pays off.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from reflow.metrics import quantile
from reflow.policy.tail_actions import (
    CarryOver,
    FreeSlot,
    Migrate,
    OverProvision,
    SetConcurrency,
    TailAction,
)

QUANTILE_WINDOW = 512
"""Completed durations the quantiles look back over (the recent ones: the policy drifts)."""


def _doc(text: str) -> dict[str, str]:
    return {"doc": text}


@dataclass(frozen=True)
class TailConfig:
    """The tail policy's knobs; `reflow.config` builds its `tail:` section from these fields."""

    over_provision_max: float = field(
        default=0.5, metadata=_doc("extra groups started per batch, at most this share of B")
    )
    min_samples: int = field(
        default=8, metadata=_doc("completed groups needed before their quantiles are trusted")
    )
    consolidate_margin: float = field(
        default=1.5, metadata=_doc("migrate only when re-prefill seconds x this margin < seconds freed")
    )
    saturation_eps: float = field(
        default=0.05, metadata=_doc("concurrency knee: smallest c with tokens/s >= (1 - eps) x max")
    )
    carry_over: bool = field(
        default=True, metadata=_doc("continue unfinished groups into the next step once B are done")
    )
    migrate: bool = field(
        default=True,
        metadata=_doc(
            "consolidate stragglers: migrate episodes to fewer engines (resubmit their token prefix)"
        ),
    )
    set_concurrency: bool = field(
        default=False,
        metadata=_doc(
            "set each engine's concurrency limit at the knee of its measured (concurrency, tokens/s) "
            "curve (opt-in: on the CPU engine the knee reads too low)"
        ),
    )

    batch_cap: bool = field(
        default=True,
        metadata=_doc(
            "async/reflow: a batch starts at most B + delta groups and none once B are done (sync always "
            "does); false: admission's window of (eta + 1) x B alone bounds the starts (on calc-tiny no "
            "faster: docs/results.md)"
        ),
    )

    def __post_init__(self) -> None:
        if not 0.0 <= self.over_provision_max <= 1.0:
            raise ValueError(f"over_provision_max is a share of B in [0, 1], got {self.over_provision_max}")
        if self.min_samples < 1:
            raise ValueError(f"min_samples must be >= 1, got {self.min_samples}")
        if not (math.isfinite(self.consolidate_margin) and self.consolidate_margin >= 1.0):
            raise ValueError(
                f"consolidate_margin must be a finite number >= 1, got {self.consolidate_margin}"
            )
        if not 0.0 <= self.saturation_eps < 1.0:
            raise ValueError(f"saturation_eps must be in [0, 1), got {self.saturation_eps}")


@dataclass(frozen=True)
class Quantiles:
    """Quantiles of completed durations (seconds) and how many completions they summarize."""

    p50: float
    p90: float
    p99: float
    count: int

    @classmethod
    def observed(cls, seconds: Sequence[float], window: int = QUANTILE_WINDOW) -> Quantiles | None:
        """p50, p90, p99 of the last `window` positive durations (recent ones: the policy drifts),
        as order statistics (`reflow.metrics.quantile`); None with fewer than 2. What both drivers,
        the Ray loop and the simulator, feed the policy."""
        xs = [x for x in seconds[-window:] if x > 0]
        if len(xs) < 2:
            return None
        return cls(quantile(xs, 0.5), quantile(xs, 0.9), quantile(xs, 0.99), len(xs))

    def __post_init__(self) -> None:
        if not (0 < self.p50 <= self.p90 <= self.p99 and math.isfinite(self.p99)):
            raise ValueError(f"need finite 0 < p50 <= p90 <= p99, got {self.p50}, {self.p90}, {self.p99}")
        if self.count < 0:
            raise ValueError(f"count must be >= 0, got {self.count}")


@dataclass(frozen=True)
class InFlightEpisode:
    id: str
    group: str
    engine: str
    turns: int
    """Assistant turns done so far."""
    tokens: int
    """Context tokens so far (prompt + generated + tool output): what a migration re-prefills."""
    seconds: float
    """Seconds since the episode started."""
    version: int = -1
    """The newest policy version among its sampled tokens (-1: none yet)."""


@dataclass(frozen=True)
class EngineState:
    id: str
    running: int
    """Sequences running on the engine now."""
    max_running: int
    """Its concurrency limit now."""
    curve: tuple[tuple[int, float], ...] = ()
    """Measured (concurrency, tokens/s) points, any order; fewer than 2: no concurrency advice."""
    released: bool = False
    """Already handed to the next batch or the trainer: the policy leaves it alone."""
    version: int = 0
    """The policy version of the weights the engine confirmed."""

    def __post_init__(self) -> None:
        if self.running < 0 or self.max_running < 1:
            raise ValueError(f"engine {self.id}: need running >= 0 and max_running >= 1")


@dataclass(frozen=True)
class TailObservation:
    batch_target: int
    """B: groups a train step uses."""
    groups_done: int
    """Groups of this batch complete."""
    episodes: tuple[InFlightEpisode, ...]
    engines: tuple[EngineState, ...]
    group_seconds: Quantiles | None = None
    """Durations of completed groups (over-provisioning)."""
    episode_seconds: Quantiles | None = None
    """Durations of completed episodes (remaining-time prediction)."""
    prefill_tokens_per_s: float = 0.0
    """Measured prefill rate of a target engine; 0: unknown, no migration."""
    groups_queued: int = 0
    """Groups of this batch planned but waiting for an engine (while > 0 there is no tail yet)."""
    next_batch_room: int = 0
    """Groups of the next batch the driver may start now (admission control's room)."""
    groups_finishing: int = 0
    """Groups started whose episodes all ended, their results not yet counted done: started, running
    on no engine."""

    def __post_init__(self) -> None:
        if self.batch_target < 1:
            raise ValueError(f"batch_target must be >= 1, got {self.batch_target}")
        if min(self.groups_done, self.groups_queued, self.next_batch_room, self.groups_finishing) < 0:
            raise ValueError("groups_done, groups_queued, next_batch_room and groups_finishing must be >= 0")
        if not (math.isfinite(self.prefill_tokens_per_s) and self.prefill_tokens_per_s >= 0):
            raise ValueError(f"prefill_tokens_per_s must be finite and >= 0, got {self.prefill_tokens_per_s}")
        known = {e.id for e in self.engines}
        if len(known) != len(self.engines):
            raise ValueError("engine ids must be unique")
        stray = sorted({ep.engine for ep in self.episodes} - known)
        if stray:
            raise ValueError(f"episodes run on engines not observed: {stray}")

    @property
    def groups_in_flight(self) -> list[str]:
        return sorted({ep.group for ep in self.episodes})


def observe(
    batch_target: int,
    groups_done: int,
    episodes: Sequence[InFlightEpisode],
    engines: Sequence[EngineState],
    *,
    group_seconds: Sequence[float] = (),
    episode_seconds: Sequence[float] = (),
    prefill_tokens_per_s: float = 0.0,
    groups_queued: int = 0,
    next_batch_room: int = 0,
    groups_finishing: int = 0,
) -> TailObservation:
    """The policy's observation from a driver's counters: the durations of the groups and episodes
    completed so far become their recent quantiles (`Quantiles.observed`)."""
    return TailObservation(
        batch_target=batch_target,
        groups_done=groups_done,
        episodes=tuple(episodes),
        engines=tuple(engines),
        group_seconds=Quantiles.observed(group_seconds),
        episode_seconds=Quantiles.observed(episode_seconds),
        prefill_tokens_per_s=prefill_tokens_per_s,
        groups_queued=groups_queued,
        next_batch_room=next_batch_room,
        groups_finishing=groups_finishing,
    )


def concurrency_knee(curve: tuple[tuple[int, float], ...] | list[tuple[int, float]], eps: float) -> int:
    """The smallest concurrency whose tokens/s reaches (1 - eps) x the curve's maximum."""
    if not curve:
        raise ValueError("a concurrency curve needs at least one (concurrency, tokens/s) point")
    top = max(tps for _, tps in curve)
    return min(c for c, tps in curve if tps >= (1.0 - eps) * top)


def remaining_seconds(age_s: float, q: Quantiles) -> float:
    """A low estimate of how long an episode running `age_s` seconds has left (module docstring)."""
    for value in (q.p50, q.p90, q.p99):
        if age_s < value:
            return value - age_s
    if q.p99 == q.p90:
        return 0.0
    alpha = math.log(10.0) / math.log(q.p99 / q.p90)
    return age_s * (2.0 ** (1.0 / alpha) - 1.0)


class TailPolicy:
    """`decide(obs)` returns the tail actions for one look at the batch; it keeps no state."""

    def __init__(self, cfg: TailConfig | None = None) -> None:
        self.cfg = cfg or TailConfig()

    def extra_groups(self, batch_target: int, group_seconds: Quantiles | None) -> tuple[int, str]:
        """delta and why: min(ceil(B * (1 - 1/h)), floor(B * over_provision_max)), h = p90 / p50."""
        cfg, b = self.cfg, batch_target
        if group_seconds is None or group_seconds.count < cfg.min_samples:
            seen = 0 if group_seconds is None else group_seconds.count
            return 0, f"no over-provisioning yet: {seen} of {cfg.min_samples} groups seen"
        h = group_seconds.p90 / group_seconds.p50
        cap = math.floor(b * cfg.over_provision_max + 1e-9)
        delta = min(math.ceil(b * (1.0 - 1.0 / h) - 1e-9), cap)
        return delta, (
            f"group seconds p50 {group_seconds.p50:g} p90 {group_seconds.p90:g}: h = {h:.3g}, "
            f"delta = min(ceil({b} x (1 - 1/h)), floor({b} x {cfg.over_provision_max:g})) = {delta}"
        )

    def decide(self, obs: TailObservation) -> list[TailAction]:
        actions: list[TailAction] = []
        b = obs.batch_target
        in_flight = obs.groups_in_flight
        if obs.groups_done >= b:
            if self.cfg.carry_over and obs.episodes:
                actions.append(
                    CarryOver(
                        tuple(in_flight),
                        tuple(sorted(ep.id for ep in obs.episodes)),
                        f"{obs.groups_done} of {b} groups done: {len(in_flight)} unfinished groups "
                        f"({len(obs.episodes)} episodes) continue into the next step as partial rollouts",
                    )
                )
        else:
            delta, why = self.extra_groups(b, obs.group_seconds)
            started = obs.groups_done + len(in_flight) + obs.groups_queued + obs.groups_finishing
            if b + delta > started:
                actions.append(
                    OverProvision(b + delta - started, delta, f"{started} of {b} + {delta} started; {why}")
                )
            elif obs.groups_queued == 0:
                actions += self._consolidate(obs)
        actions += self._concurrency(obs)
        return actions

    def _concurrency(self, obs: TailObservation) -> list[TailAction]:
        out: list[TailAction] = []
        for eng in obs.engines:
            if not self.cfg.set_concurrency or eng.released or len(eng.curve) < 2:
                continue
            knee = concurrency_knee(eng.curve, self.cfg.saturation_eps)
            saturated = knee < max(c for c, _ in eng.curve)
            if knee > eng.max_running or (knee < eng.max_running and saturated):
                top = max(tps for _, tps in eng.curve)
                at = dict(eng.curve)[knee]
                out.append(
                    SetConcurrency(
                        eng.id,
                        knee,
                        f"engine {eng.id}: {at:g} tokens/s at concurrency {knee} is within "
                        f"{self.cfg.saturation_eps:.0%} of the curve's max {top:g}; limit was {eng.max_running}",
                    )
                )
        return out

    def _consolidate(self, obs: TailObservation) -> list[TailAction]:
        engines = [e for e in obs.engines if not e.released]
        use: Literal["next_batch", "trainer"] = "next_batch" if obs.next_batch_room > 0 else "trainer"
        out: list[TailAction] = []
        for eng in engines:
            if eng.running == 0:
                out.append(FreeSlot(eng.id, use, f"engine {eng.id} has nothing running and no group waits"))
        busy = sorted((e for e in engines if e.running > 0), key=lambda e: (-e.running, e.id))
        total = sum(e.running for e in busy)
        keep, room = 0, 0
        # the fewest most-loaded engines whose limits hold every running sequence (running may exceed
        # a limit just lowered by SetConcurrency: then every engine is kept)
        while room < total and keep < len(busy):
            room += busy[keep].max_running
            keep += 1
        if keep == len(busy) or not self.cfg.migrate:
            return out
        if obs.prefill_tokens_per_s <= 0 or obs.episode_seconds is None:
            return out  # no way to price a migration: leave the tail where it is
        free = {e.id: e.max_running - e.running for e in busy[:keep]}
        versions = {e.id: e.version for e in busy[:keep]}
        by_engine: dict[str, list[InFlightEpisode]] = {}
        for ep in obs.episodes:
            by_engine.setdefault(ep.engine, []).append(ep)
        for src in reversed(busy[keep:]):  # least loaded first
            eps = sorted(by_engine.get(src.id, []), key=lambda ep: ep.id)
            if len(eps) > sum(free.values()):
                continue
            tokens = sum(ep.tokens for ep in eps)
            prefill_s = tokens / obs.prefill_tokens_per_s
            saved_s = max(remaining_seconds(ep.seconds, obs.episode_seconds) for ep in eps)
            price = (
                f"re-prefill {tokens} tokens / {obs.prefill_tokens_per_s:g} tokens/s = {prefill_s:.3g} s "
                f"x margin {self.cfg.consolidate_margin:g} vs {saved_s:.3g} s the engine would stay held"
            )
            if not prefill_s * self.cfg.consolidate_margin < saved_s:
                continue
            for ep in eps:
                target = _target(ep, free, versions)
                free[target] -= 1
                out.append(
                    Migrate(
                        ep.id,
                        src.id,
                        target,
                        ep.tokens,
                        f"episode {ep.id} ({ep.turns} turns, {ep.tokens} tokens, {ep.seconds:g} s) "
                        f"{src.id} -> {target}: the tail of {total} sequences fits on {keep} engines; {price}",
                    )
                )
            out.append(FreeSlot(src.id, use, f"engine {src.id} emptied by consolidation; {price}"))
        return out


def _target(ep: InFlightEpisode, free: dict[str, int], versions: dict[str, int]) -> str:
    """Where a migrated episode goes: an engine with room whose weights are not older than the
    episode's newest token (its later tokens would be staler than its age says; when every engine
    with room is older, the newest of them), then the most room, then the id."""
    room = [k for k, n in free.items() if n > 0] or list(free)
    return max(room, key=lambda k: (min(versions[k], ep.version), free[k], k))
