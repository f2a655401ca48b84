"""The decoupled loop's two adaptive parts in mode reflow: the elastic pool and the tail
scheduler, each a thin driver around its pure policy (`reflow.sched.elastic`, `reflow.sched.tail`).

- `ElasticDriver`: at a version boundary (no train step in flight) it turns the run's cumulative
  counters into an `Interval`, asks `ElasticRuntime.at_boundary` (which decides and applies a move) and
  returns its metrics event and the change. `moved_positions` says, from the rollout slots before and
  after, which rollout worker position left or joined, so the loop can re-index what it keys by
  position (busy clocks, groups in flight, weight pushes).
- `TailGate`: before the loop starts groups it asks `TailPolicy` about the batch being collected (B
  fresh groups; the groups with reward spread waiting count as done) and turns its actions into how
  many groups may start, and where (`TailLook.worker`: the least loaded engine with room under its
  concurrency limit, in sequences). `OverProvision` lets the loop keep up to B + delta groups started
  (delta from the tail's heaviness p90 / p50 of the group durations seen), `CarryOver` (B done) starts
  nothing more: the step takes the first B and the unfinished groups continue into the next step as
  they are. Admission control still bounds staleness on top. With a `TailRuntime` (the Ray loop) the
  policy sees every episode in flight (turns, context tokens, seconds, engine), each engine's limit
  and measured (concurrency, tokens/s) curve and the prefill rate, and the gate applies the rest:
  `Migrate` (the episode's worker aborts its request and resubmits the exact token prefix on the
  target engine; counted in `TailLook.migrations`, its event comes once measured), `FreeSlot` for the
  next batch (the loop may start the next batch's groups on the freed engine, as admission allows),
  `SetConcurrency` (the worker's new limit). Without one they are logged as not applied.

Every decision that changes is a metrics event (what, why, the numbers).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from reflow.config import RunConfig
from reflow.sched.elastic import ElasticPolicy, RoleChangeCost
from reflow.sched.elastic_runtime import ElasticRuntime, Interval, Totals
from reflow.sched.role_change import RoleChange
from reflow.sched.tail import (
    CarryOver,
    EngineState,
    FreeSlot,
    InFlightEpisode,
    Migrate,
    OverProvision,
    Quantiles,
    SetConcurrency,
    TailObservation,
    TailPolicy,
)
from reflow.sched.tail_runtime import TailRuntime

QUANTILE_WINDOW = 512
"""Group durations the tail gate's quantiles look back over (the recent ones: the policy drifts)."""


def observed_quantiles(seconds: Sequence[float]) -> Quantiles | None:
    """p50, p90, p99 of the recent positive durations (None with fewer than 2)."""
    return Quantiles.observed(seconds, QUANTILE_WINDOW)


def moved_positions(before: Sequence[int], after: Sequence[int]) -> tuple[int | None, int | None]:
    """The rollout worker positions a role change removed and added, from the rollout slots' indices
    (in slot order) before and after it: (position in `before` that left, position in `after` that
    joined), None where nothing left or joined."""
    gone = [p for p, s in enumerate(before) if s not in after]
    new = [p for p, s in enumerate(after) if s not in before]
    if len(gone) > 1 or len(new) > 1:
        raise ValueError(f"one role change moves one slot: rollout slots {list(before)} -> {list(after)}")
    return (gone[0] if gone else None), (new[0] if new else None)


@dataclass
class GroupInFlight:
    """A group the loop started: on which rollout worker (position in `pool.rollout`), since when."""

    worker: int
    group_id: str
    started: float


class ElasticDriver:
    """The loop's side of the elastic pool: counters in, `ElasticRuntime.at_boundary` out."""

    def __init__(self, pool: Any, config: RunConfig, state: Any, now_s: float) -> None:
        """`state`: the loop's `RunState` at the start, `now_s`: training seconds then."""
        self.group_size = config.rollout.group_size
        batch = config.rollout.groups_per_step * self.group_size
        policy = ElasticPolicy(config.elastic.policy_config())
        self.runtime = ElasticRuntime(
            pool, policy, batch_size=batch, drain_timeout_s=policy.cfg.drain_timeout_s
        )
        self.trained = 0.0  # episodes trained on (fresh and replayed; samples, the policy's unit)
        self.then = Totals(now_s, state.rollout_busy_s, 0.0, state.trainer_busy_s, 0.0)

    def stepped(self, groups: int) -> None:
        self.trained += groups * self.group_size

    def state_dict(self) -> dict[str, Any]:
        """What a resume restores (saved with checkpoints): the measured cost of each direction, the
        step of the last change (the dwell time) and the policy's last move. The slot layout is the
        pool's (`ResourcePool.roles`), restored when the pool starts."""
        rt, policy = self.runtime, self.runtime.policy
        return {
            "costs": {k: asdict(c) if c is not None else None for k, c in rt.costs.items()},
            "last_change_step": rt.last_change_step,
            "last_move_version": policy.last_move_version,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        rt = self.runtime
        rt.costs = {k: RoleChangeCost(**c) if c is not None else None for k, c in state["costs"].items()}
        rt.last_change_step = int(state["last_change_step"])
        rt.policy.last_move_version = state["last_move_version"]

    def at_boundary(
        self,
        state: Any,
        now_s: float,
        generated: float,
        *,
        replay_share: float,
        fresh_waiting: int,
        in_flight: Mapping[Any, GroupInFlight],
    ) -> tuple[dict[str, Any], RoleChange | None]:
        """Decide (and apply) at this boundary from the interval since the last one (`state`: the
        loop's `RunState`; `generated`: episodes arrived since the loop started)."""
        now = Totals(now_s, state.rollout_busy_s, generated, state.trainer_busy_s, self.trained)
        interval, self.then = Interval.between(self.then, now), now
        return self.runtime.at_boundary(
            interval,
            step=state.step,
            version=state.version,
            replay_share=replay_share,
            fresh_waiting=fresh_waiting,
            in_flight={ref: (g.worker, [g.group_id]) for ref, g in in_flight.items()},
        )


@dataclass
class TailLook:
    """What the tail gate allows now: how many groups may start, and where."""

    room: int | None
    """Groups the loop may still start (None: no limit, tail off)."""
    beyond_b: int = 0
    """Of `room`, how many would be started beyond B (over-provisioned)."""
    events: list[dict[str, Any]] = field(default_factory=list)
    """The decisions that changed since the last look, and migrations measured (metrics events)."""
    migrations: int = 0
    """Episodes migrated at this look."""
    loads: list[int] = field(default_factory=list)
    """Sequences on each rollout worker's engine (by position)."""
    limits: list[int] = field(default_factory=list)
    """Each engine's concurrency limit (sequences)."""
    group_size: int = 1
    only: set[int] | None = None
    """Positions the groups may start on (None: any): the engines freed for the next batch."""

    def allows(self) -> bool:
        return self.room is None or self.room > 0

    def worker(self) -> int | None:
        """The least loaded rollout worker with room for a group (an idle one always has), or None."""
        fits = [
            w
            for w, (load, limit) in enumerate(zip(self.loads, self.limits, strict=True))
            if (self.only is None or w in self.only) and (load == 0 or load + self.group_size <= limit)
        ]
        return min(fits, key=lambda w: (self.loads[w], w)) if fits else None

    def take(self, worker: int) -> bool:
        """One group starts on `worker`; whether it is one beyond B (over-provisioned)."""
        self.loads[worker] += self.group_size
        if self.room is None:
            return False
        over = self.room <= self.beyond_b
        self.room -= 1
        return over


class TailGate:
    """The tail scheduler in the loop (see the module docstring); `policy` None: the tail is off;
    `runtime` None: the tail's per-episode actions are logged, not applied (no Ray)."""

    def __init__(
        self,
        policy: TailPolicy | None,
        batch: int,
        per_worker: int,
        group_size: int = 1,
        runtime: TailRuntime | None = None,
    ) -> None:
        """`per_worker`: groups a rollout worker runs at once (until its limit is measured)."""
        self.policy, self.batch, self.per_worker = policy, batch, per_worker
        self.group_size, self.runtime = group_size, runtime
        self._last: set[Any] = set()  # the decisions of the last look (events only on change)
        self._quantiles: Quantiles | None = None
        self._episode_quantiles: Quantiles | None = None
        self.observed = 0
        """How many durations the quantiles were computed from."""

    def state_dict(self) -> dict[str, Any]:
        """What a resume restores (saved with checkpoints): each engine's concurrency limit, by engine
        name (slot index: the layout is restored too). The durations behind the quantiles are the
        loop's (`Arrivals`); the measured concurrency curves are measured again."""
        rt = self.runtime
        return {"limits": {e: rt.engine_limit(e) for e in rt.engine_ids()} if rt is not None else {}}

    def load_state_dict(self, state: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Apply the saved limits to the engines that have one; the events of the limits set."""
        events: list[dict[str, Any]] = []
        if self.runtime is None:
            return events
        for engine, limit in state.get("limits", {}).items():
            if engine in self.runtime.engine_ids():
                action = SetConcurrency(engine, int(limit), "restored from the checkpoint")
                events.append({"what": "set_concurrency", "why": action.reason, "engine": engine,
                               **self.runtime.set_concurrency(action)})  # fmt: skip
        return events

    def wake_s(self, in_flight: int) -> float | None:
        """How long the loop may wait for an event before the next look (None: until one comes)."""
        return self.runtime.poll_s if self.runtime is not None and in_flight else None

    def look(
        self,
        fresh_waiting: int,
        in_flight: Sequence[GroupInFlight],
        loads: Sequence[int],
        now: float,
        next_room: int = 0,
        versions: Sequence[int] = (),
    ) -> TailLook:
        """`fresh_waiting`: groups with reward spread stored and not yet trained; `loads`: groups in
        flight per rollout worker; `now`: the clock `GroupInFlight.started` was read from;
        `next_room`: groups admission control would let start now (the next batch's, on freed engines);
        `versions`: the weights each rollout worker's engine confirmed (migration targets)."""
        seqs = [n * self.group_size for n in loads]
        limits = [self.per_worker * self.group_size] * len(loads)
        if self.policy is None:
            return TailLook(None, loads=seqs, limits=limits, group_size=self.group_size)
        events: list[dict[str, Any]] = []
        prefill = 0.0
        if self.runtime is not None:  # the workers' progress: episodes, engine limits and curves
            rt = self.runtime
            events += rt.poll(now)
            episodes, seqs, limits = rt.observe(in_flight, now)
            names, prefill = rt.engine_ids(), rt.prefill_tokens_per_s
            engines = tuple(
                EngineState(
                    e,
                    sum(ep.engine == e for ep in episodes),
                    limits[w],
                    rt.curve(e),
                    e in rt.released,
                    versions[w] if w < len(versions) else 0,
                )
                for w, e in enumerate(names)
            )
        else:  # one entry per group, no progress: over-provisioning and carry-over only
            engines = tuple(EngineState(f"w{w}", n, self.per_worker) for w, n in enumerate(loads))
            episodes = tuple(
                InFlightEpisode(g.group_id, g.group_id, f"w{g.worker}", 0, 0, max(0.0, now - g.started))
                for g in in_flight
            )
        obs = TailObservation(
            batch_target=self.batch,
            groups_done=fresh_waiting,
            episodes=episodes,
            engines=engines,
            group_seconds=self._quantiles,
            episode_seconds=self._episode_quantiles,
            prefill_tokens_per_s=prefill,
            next_batch_room=next_room,
        )
        look = self.apply(self.policy.decide(obs), fresh_waiting + len(in_flight), next_room)
        look.events[:0] = events
        look.loads, look.limits, look.group_size = seqs, limits, self.group_size
        return look

    def observe(self, group_seconds: Sequence[float], episode_seconds: Sequence[float] = ()) -> None:
        """Durations of the groups done so far (over-provisioning's tail heaviness) and of their
        episodes (the stragglers' remaining time)."""
        self._quantiles = observed_quantiles(group_seconds)
        self._episode_quantiles = observed_quantiles(episode_seconds)
        self.observed = len(group_seconds)

    def apply(self, actions: Sequence[Any], started: int, next_room: int = 0) -> TailLook:
        """The limit the actions set (`started`: groups of this batch done or in flight), applied
        through the runtime where there is one, and the events of the decisions that changed."""
        look, rt, keys = TailLook(room=0), self.runtime, set()
        if rt is not None and any(isinstance(a, (OverProvision, CarryOver)) for a in actions):
            rt.new_batch()  # a batch is being started or closed: no engine stays freed for the next
        for action in actions:
            if not isinstance(action, (OverProvision, CarryOver, Migrate, FreeSlot, SetConcurrency)):
                raise TypeError(f"unknown tail action {action!r}")
            key, applied = (action.kind, _identity(action)), True
            result: dict[str, Any] | None = {}
            if isinstance(action, OverProvision):
                look.room = action.start
                look.beyond_b = min(action.start, max(0, started + action.start - self.batch))
            elif isinstance(action, CarryOver):
                pass  # nothing more starts for this batch; the step takes the first B done
            elif rt is None and isinstance(action, (Migrate, FreeSlot, SetConcurrency)):
                applied = False  # no runtime to apply it (a test, the simulator's own loop)
            elif isinstance(action, Migrate):
                if key in self._last:
                    keys.add(key)
                    continue  # decided already and refused: not asked again
                result = rt.migrate(action)
                look.migrations += result is None
                applied = result is None
            elif isinstance(action, FreeSlot):
                applied = rt.free(action)
            elif isinstance(action, SetConcurrency):
                if key in self._last:
                    keys.add(key)
                    continue
                result = rt.set_concurrency(action)
                applied = result["applied"]
            keys.add(key)
            if key in self._last or (isinstance(action, Migrate) and applied):
                continue  # the same decision as last look; an applied migration's event comes measured
            fields = {k: v for k, v in vars(action).items() if k not in ("kind", "reason")}
            look.events.append(
                {"what": action.kind, "why": action.reason, "applied": applied, **fields, **(result or {})}
            )
        self._last = keys  # a decision that ended is an event again when it comes back
        if rt is not None and rt.released and look.room == 0:  # the next batch starts on freed engines
            names = rt.engine_ids()
            look.room, look.beyond_b = next_room, 0
            look.only = {names.index(e) for e in rt.released if e in names}
        return look

    def close(self, now: float) -> list[dict[str, Any]]:
        """The run is over: the migrations measured but not yet logged."""
        return self.runtime.close(now) if self.runtime is not None else []


def _identity(action: Any) -> Any:
    """What makes two looks' actions of one kind the same decision (an event only when it changes)."""
    if isinstance(action, OverProvision):
        return action.extra
    if isinstance(action, CarryOver):
        return True  # an event when B are first done, not one per group arriving after
    if isinstance(action, Migrate):
        return (action.episode, action.target)
    if isinstance(action, FreeSlot):
        return (action.engine, action.use)
    return (action.engine, action.concurrency)  # SetConcurrency
