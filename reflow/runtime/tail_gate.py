"""The tail scheduler in the loop: the gate (`TailGate`) the sync and decoupled loops ask before they
start groups, and what it allows (`TailLook`).

`TailGate`: before the loop starts groups it asks `TailPolicy` about the batch being collected (the
groups with reward spread waiting count as done) and turns its actions into how many groups may start
(`OverProvision`: up to B + delta; `CarryOver`, B done: none) and where (`TailLook.worker`: the least
loaded engine whose load, in sequences, is under its limit or two groups, whichever is more);
admission control bounds staleness on top. In async and reflow with `tail.batch_cap=false`
(`overlap`) the room is at least admission's, whose window of (eta + 1) x B groups over-provisions a
batch already.
With a `TailRuntime` the policy sees every episode in flight and each engine's limit, curve and
prefill rate, and the gate's `RayActuator` applies `Migrate` (its event comes once measured),
`FreeSlot` for the next batch (its groups may start on the freed engine) and `SetConcurrency`;
without one they are logged as not applied. Every decision that changes is a metrics event.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from reflow.config import RunConfig
from reflow.policy.actuator import GATE_ACTIONS, apply_tail, tail_event
from reflow.policy.tail import QUANTILE_WINDOW, EngineState, InFlightEpisode, TailPolicy
from reflow.policy.tail import observe as observe_tail
from reflow.policy.tail_actions import SetConcurrency, TailAction, decision_key
from reflow.runtime.actuator import RayActuator
from reflow.runtime.tail import GroupInFlight, TailRuntime

ASKED_ONCE = ("migrate", "set_concurrency")
"""Decisions the gate applies once: the same one at the next look (applied or refused) is not asked
again."""


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

    def free_sequences(self) -> list[int]:
        """Each rollout worker's engine's limit less its load (sequences, by position; at least 0)."""
        return [max(0, limit - load) for load, limit in zip(self.loads, self.limits, strict=True)]

    def worker(self) -> int | None:
        """The least loaded rollout worker below its room, or None: its limit, but never under two
        groups. A group may take an engine past its limit: the engine queues the sequences over it
        (`LimitedEngine`), so the engine runs at its limit while a second group waits ready. Under a
        limit below two groups (a measured knee of 5-15 sequences, groups of 8) the loop otherwise
        ran one group at a time: the engine idled between groups (the report's round trip, the
        next group's start) and a group's stragglers ran alone."""
        fits = [
            w
            for w, (load, limit) in enumerate(zip(self.loads, self.limits, strict=True))
            if (self.only is None or w in self.only) and load < max(limit, 2 * self.group_size)
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


def tail_runtime(cluster: Any, config: RunConfig) -> TailRuntime | None:
    """What applies a run's per-episode tail actions (migrations, freed engines, concurrency limits),
    in any mode with tail handling; None when the tail is off. With `tail.migrate` and
    `tail.set_concurrency` both off it still frees the engines already empty for the next batch."""
    t, r = config.tail, config.rollout
    if not t.active(config.mode):
        return None
    return TailRuntime(cluster, r.group_size, r.max_batch_size, unknown_tokens=r.max_context_tokens)


def decoupled_gate(cluster: Any, config: RunConfig, per_worker: int) -> TailGate:
    """The decoupled loop's tail gate (async, reflow; no policy when the tail is off): a batch starts
    at most B + delta groups, or with `tail.batch_cap=false` its batches overlap, admission's window
    bounding the starts."""
    policy = TailPolicy(config.tail.policy_config()) if config.tail.active(config.mode) else None
    overlap = policy is not None and not policy.cfg.batch_cap
    r = config.rollout
    return TailGate(
        policy, r.groups_per_step, per_worker, r.group_size, tail_runtime(cluster, config), overlap
    )


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
        overlap: bool = False,
    ) -> None:
        """`per_worker`: groups a rollout worker runs at once (until its limit is measured); `overlap`:
        the loop's batches overlap, no batch cap (async, reflow with `tail.batch_cap=false`):
        admission's room is the floor of the gate's (see `apply`)."""
        self.policy, self.batch, self.per_worker = policy, batch, per_worker
        self.group_size, self.runtime, self.overlap = group_size, runtime, overlap
        self.actuator = RayActuator(runtime.cluster if runtime is not None else None, runtime)
        self._last: set[Any] = set()  # the decisions of the last look (events only on change)
        self._group_s: list[float] = []  # the recent durations behind the quantiles
        self._episode_s: list[float] = []
        self.observed = 0
        """How many group durations the gate has seen."""

    def state_dict(self) -> dict[str, Any]:
        """What a resume restores (saved with checkpoints): with `tail.set_concurrency`, each engine's
        concurrency limit, by engine name (slot index: the layout is restored too); without it none
        (each engine keeps the limit it starts with, `rollout.max_batch_size`, which a resume may
        have raised). The durations behind the quantiles are the loop's (`Arrivals`); the measured
        concurrency curves are measured again."""
        rt = self.runtime
        if rt is None or not self._sets_limits():
            return {"limits": {}}
        return {"limits": {e: rt.engine_limit(e) for e in rt.engine_ids()}}

    def _sets_limits(self) -> bool:
        return self.policy is not None and self.policy.cfg.set_concurrency

    def load_state_dict(self, state: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Apply the saved limits to the engines that have one; the events of the limits set. Only
        where this run sets limits (`tail.set_concurrency`): a limit saved by a run that did would
        otherwise hold for good, as nothing here moves it again."""
        events: list[dict[str, Any]] = []
        if self.runtime is None or not self._sets_limits():
            return events
        for engine, limit in state.get("limits", {}).items():
            if engine in self.runtime.engine_ids():
                action = SetConcurrency(engine, int(limit), "restored from the checkpoint")
                events.append({"what": "set_concurrency", "why": action.reason, "engine": engine,
                               **self.actuator.set_concurrency(action)})  # fmt: skip
        return events

    def acting(self) -> TailRuntime | None:
        """The runtime where it can act now, else None: a migration needs a second rollout engine, a
        limit `tail.set_concurrency`. A look through the runtime asks every rollout worker's actor for
        its episodes while its engine generates, and the loop wakes for it every `POLL_S`: on one
        engine with no limit to set (the CPU's two-slot layout) that cost a tenth of generation and no
        action could follow. Without it the gate reads group counts, as with no runtime: a group in
        flight counts whole in its engine's load until its report comes (the runtime counts only the
        sequences still running), so the engine looks fuller while a group's last episodes finish,
        and no engine is freed for the next batch. Asked at every look: the elastic pool may add a
        rollout engine (the runtime then starts afresh, `TailRuntime.restart`). The sync loop builds
        no runtime for one worker at all (its engine keeps its limit)."""
        rt = self.runtime
        if rt is None or (len(rt.cluster.rollout_slots) < 2 and not self._sets_limits()):
            return None
        return rt

    def wake_s(self, in_flight: int) -> float | None:
        """How long the loop may wait for an event before the next look (None: until one comes)."""
        rt = self.acting()
        return rt.poll_s if rt is not None and in_flight else None

    def look(
        self,
        fresh_waiting: int,
        in_flight: Sequence[GroupInFlight],
        loads: Sequence[int],
        now: float,
        next_room: int = 0,
        versions: Sequence[int] = (),
        served: Sequence[int] = (),
    ) -> TailLook:
        """`fresh_waiting`: groups with reward spread stored and not yet trained; `loads`: groups in
        flight per rollout worker; `now`: the clock `GroupInFlight.started` was read from;
        `next_room`: groups admission control would let start now (the next batch's, on freed engines);
        `versions`: the weights each rollout worker's engine confirmed (migration targets); `served`:
        sequences each rollout worker's engine runs for others (a lent engine's handed-over episodes,
        which the workers' own reports leave out), counted in its load and in the policy's view."""
        extra = [served[w] if w < len(served) else 0 for w in range(len(loads))]
        seqs = [n * self.group_size + x for n, x in zip(loads, extra, strict=True)]
        limits = [self.per_worker * self.group_size] * len(loads)
        if self.policy is None:
            return TailLook(None, loads=seqs, limits=limits, group_size=self.group_size)
        events: list[dict[str, Any]] = []
        prefill, finishing = 0.0, 0
        rt = self.acting()  # per-episode actions only where one can follow
        if rt is not None and self.actuator.tail is not rt:  # acting again: nothing from before holds
            rt.restart()
        self.actuator.tail = rt
        if rt is not None:  # the workers' progress: episodes, engine limits and curves
            events += rt.poll(now)
            episodes, seqs, limits = rt.observe(in_flight, now)
            seqs = [n + x for n, x in zip(seqs, extra, strict=True)]
            names, prefill, finishing = rt.engine_ids(), rt.prefill_tokens_per_s, rt.finishing
            engines = tuple(
                EngineState(
                    e,
                    sum(ep.engine == e for ep in episodes) + extra[w],
                    limits[w],
                    rt.curve(e),
                    e in rt.released,
                    versions[w] if w < len(versions) else 0,
                )
                for w, e in enumerate(names)
            )
        else:  # one entry per group, no progress: over-provisioning and carry-over only
            engines = tuple(  # in groups: served episodes as the groups they fill, rounded up
                EngineState(f"w{w}", n + -(-extra[w] // self.group_size), self.per_worker)
                for w, n in enumerate(loads)
            )
            episodes = tuple(
                InFlightEpisode(g.group_id, g.group_id, f"w{g.worker}", 0, 0, max(0.0, now - g.started))
                for g in in_flight
            )
        obs = observe_tail(
            self.batch,
            fresh_waiting,
            episodes,
            engines,
            group_seconds=self._group_s,
            episode_seconds=self._episode_s,
            prefill_tokens_per_s=prefill,
            next_batch_room=next_room,
            groups_finishing=finishing,
        )
        look = self.apply(self.policy.decide(obs), fresh_waiting + len(in_flight), next_room)
        look.events[:0] = events
        look.loads, look.limits, look.group_size = seqs, limits, self.group_size
        return look

    def observe(self, group_seconds: Sequence[float], episode_seconds: Sequence[float] = ()) -> None:
        """Durations of the groups done so far (over-provisioning's tail heaviness) and of their
        episodes (the stragglers' remaining time): the recent ones are what the quantiles read."""
        self._group_s = list(group_seconds[-QUANTILE_WINDOW:])
        self._episode_s = list(episode_seconds[-QUANTILE_WINDOW:])
        self.observed = len(group_seconds)

    def apply(self, actions: Sequence[TailAction], started: int, next_room: int = 0) -> TailLook:
        """The limit the actions set (`started`: groups of this batch done or in flight), the rest
        applied through the actuator, and the events of the decisions that changed. With `overlap`
        (async, reflow without the batch cap) the room is at least `next_room`, admission's, on any
        engine: its window of (eta + 1) x B groups not yet trained over-provisions the batch being
        collected (the first B done are trained, the rest carry over; those started while B were done
        or in flight count as over-provisioned). Not in a look that migrated episodes (the loads it
        read are before them) or while engines are freed for the next batch (they take its groups, as
        with the cap). The cap of B + delta, none once
        B are done, holds back groups admission allows, to give the batch the trainer needs next the
        engines."""
        look, rt, keys = TailLook(room=0), self.actuator.tail, set()
        if rt is not None and any(a.kind in GATE_ACTIONS for a in actions):
            rt.new_batch()  # a batch is being started or closed: no engine stays freed for the next
        for action in actions:
            key = decision_key(action)
            keys.add(key)
            if key in self._last and action.kind in ASKED_ONCE:
                continue  # decided already, applied or refused: not asked again
            outcome = apply_tail(action, self.actuator)
            if action.kind == "over_provision":
                look.room = action.start
                look.beyond_b = min(action.start, max(0, started + action.start - self.batch))
            migrated = action.kind == "migrate" and outcome["applied"]
            look.migrations += migrated
            if key in self._last or migrated:
                continue  # the same decision as last look; an applied migration's event comes measured
            look.events.append(tail_event(action, outcome))
        self._last = keys  # a decision that ended is an event again when it comes back
        widen = self.overlap and next_room > look.room
        if widen and not look.migrations and not (rt is not None and rt.released):
            # the next batch's groups start as admission allows, on any engine under its limit; not in
            # a look that migrated (its loads were read before) or freed engines (they take them)
            look.room, look.beyond_b = next_room, min(next_room, max(0, started + next_room - self.batch))
            return look
        if rt is not None and rt.released and look.room == 0:  # the next batch starts on freed engines
            names = rt.engine_ids()
            look.room, look.beyond_b = next_room, 0
            look.only = {names.index(e) for e in rt.released if e in names}
        return look

    def close(self, now: float) -> list[dict[str, Any]]:
        """The run is over: the migrations measured but not yet logged."""
        return self.runtime.close(now) if self.runtime is not None else []
