"""The tail scheduler on Ray: the loop's gate (`TailGate`) and what it looks and acts through
(`TailRuntime`).

`TailGate`: before the loop starts groups it asks `TailPolicy` about the batch being collected (the
groups with reward spread waiting count as done) and turns its actions into how many groups may start
(`OverProvision`: up to B + delta; `CarryOver`, B done: none) and where (`TailLook.worker`: the least
loaded engine whose load, in sequences, is under its limit or two groups, whichever is more);
admission control bounds staleness on top.
With a `TailRuntime` the policy sees every episode in flight and each engine's limit, curve and
prefill rate, and the gate's `RayActuator` applies `Migrate` (its event comes once measured),
`FreeSlot` for the next batch (its groups may start on the freed engine) and `SetConcurrency`;
without one they are logged as not applied. Every decision that changes is a metrics event.

`TailRuntime` looks at the rollout workers and acts on them:

- `poll`: every `POLL_S` at most, each rollout worker's `progress()` (its episodes with their turns,
  context tokens and seconds, the engine each generates on now, its concurrency limit and measured
  curve, its prefill rate, the migrations it measured): a snapshot. Groups started since and not yet
  seen are placeholders until the next (one entry per episode, on their worker, priced at the whole
  context budget: a prefix not known yet is not worth moving); groups seen before and no longer listed
  are finishing (every episode closed, the report on its way): counted as started, running nowhere.
- `observe`: the policy's episodes and engines from the snapshot, with the migrations applied since,
  and each engine's load in sequences: the episodes running on it (its own not yet closed, those
  migrated to it, placeholders for groups started since the snapshot; a group's closed episodes hold
  no place): the loop starts a group on an engine whose load is under its limit or two groups
  (`TailLook.worker`).
- `migrate`: asks the episode's worker to move its generation (`RolloutWorker.migrate`: abort on the
  source, resubmit the exact token prefix on the target); the event comes when the worker has
  measured it (re-prefilled tokens, handoff and first-token seconds, outcome), with the policy's
  reason and its predicted re-prefill seconds beside it.
- `free`: a `FreeSlot` for the next batch marks the engine released (the policy leaves it alone; the
  loop may start the next batch's groups on it) until a new batch starts; one for the trainer is the
  elastic pool's business (it decides role changes at version boundaries): not applied here.
- `set_concurrency`: `RolloutWorker.set_concurrency`; the limit the worker applied counts at once.

Engines are named by slot index (`engine_name`), so names survive the elastic pool's re-numbering of
rollout positions; an episode on an engine that left is counted on its own worker's (its route falls
back there).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray

from reflow.config import RunConfig
from reflow.policy.actuator import GATE_ACTIONS, apply_tail, tail_event
from reflow.policy.tail import QUANTILE_WINDOW, EngineState, InFlightEpisode, TailPolicy
from reflow.policy.tail import observe as observe_tail
from reflow.policy.tail_actions import FreeSlot, Migrate, SetConcurrency, TailAction, decision_key
from reflow.runtime.actuator import RayActuator
from reflow.runtime.worker_tail import engine_name

POLL_S = 0.25
"""Seconds between two looks at the workers' progress (the loop also wakes this often in a tail)."""
PROGRESS_TIMEOUT_S = 30.0
"""A worker that does not answer `progress()` in this long is left out of that snapshot."""
ASKED_ONCE = ("migrate", "set_concurrency")
"""Decisions the gate applies once: the same one at the next look (applied or refused) is not asked
again."""


@dataclass
class GroupInFlight:
    """A group the loop started: on which rollout worker (position in `cluster.rollout`), since when."""

    worker: int
    group_id: str
    started: float


@dataclass
class Snapshot:
    at: float
    episodes: list[dict[str, Any]] = field(default_factory=list)
    limits: dict[str, int] = field(default_factory=dict)
    curves: dict[str, tuple[tuple[int, float], ...]] = field(default_factory=dict)
    prefill_tokens_per_s: float = 0.0


def is_placeholder(episode: str) -> bool:
    """Whether an episode id is a placeholder for one not reported yet (`TailRuntime.observe`)."""
    return "#" in episode


class TailRuntime:
    """See the module docstring. `group_size`: episodes per group; `limit`: a worker's concurrency
    limit (sequences) until its first report; `unknown_tokens`: a placeholder's context tokens."""

    def __init__(
        self, cluster: Any, group_size: int, limit: int, unknown_tokens: int = 4096, poll_s: float = POLL_S
    ) -> None:
        self.cluster, self.group_size, self.limit, self.poll_s = cluster, group_size, limit, poll_s
        self.unknown_tokens = unknown_tokens
        self.snapshot: Snapshot | None = None
        self.seen: set[str] = set()  # groups whose episodes a snapshot listed
        self.finishing = 0
        """Groups in flight at the last `observe` whose episodes all closed (reports on the way)."""
        self.moved: dict[str, str] = {}  # episode -> engine it moved to since the snapshot
        self.owner: dict[str, str] = {}  # episode -> the engine of the worker that runs it
        # episode -> its moves applied and not yet measured, in order: (decision, predicted seconds);
        # an episode may move again before its first move is measured (reported superseded), so each
        # move keeps its own decision, matched to its measurement by target
        self.decided: dict[str, list[tuple[Migrate, float | None]]] = {}
        self.limits: dict[str, int] = {}
        self.released: set[str] = set()

    def engine_ids(self) -> list[str]:
        """Engine names by rollout position."""
        return [engine_name(s.index) for s in self.cluster.rollout_slots]

    # -- looking -----------------------------------------------------------------------------------------

    def poll(self, now: float, force: bool = False) -> list[dict[str, Any]]:
        """A new snapshot when `POLL_S` passed (or `force`); the events of migrations measured since."""
        if not force and self.snapshot is not None and now - self.snapshot.at < self.poll_s:
            return []
        snap, events = Snapshot(now), []
        refs = [w.progress.remote() for w in self.cluster.rollout]
        rates = []
        for ref in refs:
            try:
                report = ray.get(ref, timeout=PROGRESS_TIMEOUT_S)
            except Exception:  # a worker gone (a role change) or stuck: left out of this snapshot
                continue
            name = report["engine"]
            snap.limits[name] = int(report["limit"])
            snap.curves[name] = tuple((int(c), float(t)) for c, t in report["curve"])
            snap.episodes += report["episodes"]
            if report["prefill_tokens_per_s"] > 0:
                rates.append(float(report["prefill_tokens_per_s"]))
            events += [self._measured(m) for m in report["migrations"]]
        snap.prefill_tokens_per_s = min(rates) if rates else 0.0  # the slowest: a move that pays there pays
        self.snapshot, self.moved, self.limits = snap, {}, {}
        self.seen |= {ep["group"] for ep in snap.episodes}
        self.owner = {ep["id"]: ep["owner"] for ep in snap.episodes}
        return events

    def observe(
        self, in_flight: Sequence[GroupInFlight], now: float
    ) -> tuple[tuple[InFlightEpisode, ...], list[int], list[int]]:
        """(the episodes in flight, each rollout position's load: the sequences running on its
        engine, its limit) from the snapshot; `in_flight`: the loop's `GroupInFlight`s."""
        ids = self.engine_ids()
        snap = self.snapshot or Snapshot(now)
        live = {g.group_id for g in in_flight}
        episodes: list[InFlightEpisode] = []
        for ep in snap.episodes:
            if ep["group"] not in live:
                continue
            engine = self.moved.get(ep["id"], ep["engine"])
            if engine not in ids:  # that engine left: the episode is back on its own worker's
                engine = ep["owner"]
            if engine not in ids:
                continue
            age = ep["seconds"] + max(0.0, now - snap.at)
            episodes.append(
                InFlightEpisode(
                    ep["id"], ep["group"], engine, ep["turns"], ep["tokens"], age, ep.get("version", -1)
                )
            )
        listed = {ep["group"] for ep in snap.episodes}
        self.finishing = sum(g.group_id in self.seen and g.group_id not in listed for g in in_flight)
        for g in in_flight:  # started since the snapshot: placeholders until the next one
            if g.group_id not in self.seen:
                age, tokens = now - g.started, self.unknown_tokens
                episodes += [
                    InFlightEpisode(f"{g.group_id}#{i}", g.group_id, ids[g.worker], 0, tokens, age)
                    for i in range(self.group_size)
                ]
        self.seen &= live  # only groups still in flight need remembering
        running = Counter(ep.engine for ep in episodes)  # a group's closed episodes hold no place
        return tuple(episodes), [running[e] for e in ids], [self.engine_limit(e) for e in ids]

    def engine_limit(self, engine: str) -> int:
        snap = self.snapshot
        return self.limits.get(engine) or (snap.limits.get(engine) if snap else None) or self.limit

    def curve(self, engine: str) -> tuple[tuple[int, float], ...]:
        return self.snapshot.curves.get(engine, ()) if self.snapshot else ()

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.snapshot.prefill_tokens_per_s if self.snapshot else 0.0

    # -- applying ----------------------------------------------------------------------------------------

    def migrate(self, action: Migrate) -> dict[str, Any]:
        """Apply one `Migrate` (its event comes measured when applied), or say why not."""
        ids = self.engine_ids()
        owner = self.owner.get(action.episode)
        if owner not in ids or action.target not in ids:
            why = "its worker has not reported it yet" if owner is None else "its worker or the target left"
            return {"applied": False, "error": f"episode {action.episode}: {why}"}
        worker, target = (
            self.cluster.rollout[ids.index(owner)],
            self.cluster.rollout[ids.index(action.target)],
        )
        try:
            result = ray.get(worker.migrate.remote(action.episode, target, action.target))
        except Exception as e:  # the owner is gone: its episodes are its group's (drained or lost there)
            return {"applied": False, "error": f"{type(e).__name__}: {e}"}
        if not result["applied"]:
            return {"applied": False, "error": result["error"]}
        self.moved[action.episode] = action.target
        rate = self.prefill_tokens_per_s
        predicted = action.tokens / rate if rate > 0 else None
        self.decided.setdefault(action.episode, []).append((action, predicted))
        return {"applied": True}

    def free(self, action: FreeSlot) -> bool:
        """Apply one `FreeSlot`: True when the engine now serves the next batch."""
        if action.use != "next_batch" or action.engine not in self.engine_ids():
            return False
        self.released.add(action.engine)
        return True

    def new_batch(self) -> None:
        """A new batch is being started: the engines freed for it are ordinary again."""
        self.released.clear()

    def set_concurrency(self, action: SetConcurrency) -> dict[str, Any]:
        ids = self.engine_ids()
        if action.engine not in ids:
            return {"applied": False, "error": f"engine {action.engine} left"}
        was = self.engine_limit(action.engine)
        try:
            now = int(
                ray.get(
                    self.cluster.rollout[ids.index(action.engine)].set_concurrency.remote(action.concurrency)
                )
            )
        except Exception as e:
            return {"applied": False, "error": f"{type(e).__name__}: {e}"}
        self.limits[action.engine] = now
        return {"applied": True, "limit_was": was, "limit": now}

    def close(self, now: float) -> list[dict[str, Any]]:
        """The run is over: the migrations measured since the last poll, then those never measured."""
        events: list[dict[str, Any]] = []
        with contextlib.suppress(Exception):  # workers already gone: what was measured is lost with them
            events = self.poll(now, force=True)
        for moves in self.decided.values():
            for action, predicted in moves:
                events.append(self._event(action, predicted, {"outcome": "unmeasured (the run ended first)"}))
        self.decided.clear()
        return events

    def _measured(self, report: dict[str, Any]) -> dict[str, Any]:
        moves = self.decided.get(report["episode"], [])
        for i, (action, predicted) in enumerate(moves):
            if action.target == report["target"]:
                del moves[i]
                if not moves:
                    del self.decided[report["episode"]]
                return self._event(action, predicted, report)
        why = "the target failed: the episode went back to its own engine"
        if not report["outcome"].startswith("ok"):
            why = f"migration {report['outcome']}"
        return {"what": "migrate", "why": why, "applied": True, **report}

    @staticmethod
    def _event(action: Migrate, predicted_s: float | None, measured: dict[str, Any]) -> dict[str, Any]:
        return {
            "what": "migrate",
            "why": action.reason,
            "applied": True,
            "episode": action.episode,
            "source": action.source,
            "target": action.target,
            "tokens": action.tokens,
            "predicted_s": predicted_s,
            **{k: v for k, v in measured.items() if k not in ("episode", "source", "target")},
        }


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
        if self.runtime is not None:  # the workers' progress: episodes, engine limits and curves
            rt = self.runtime
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
        applied through the actuator, and the events of the decisions that changed."""
        look, rt, keys = TailLook(room=0), self.runtime, set()
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
        if rt is not None and rt.released and look.room == 0:  # the next batch starts on freed engines
            names = rt.engine_ids()
            look.room, look.beyond_b = next_room, 0
            look.only = {names.index(e) for e in rt.released if e in names}
        return look

    def close(self, now: float) -> list[dict[str, Any]]:
        """The run is over: the migrations measured but not yet logged."""
        return self.runtime.close(now) if self.runtime is not None else []
