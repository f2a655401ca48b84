"""The tail scheduler on Ray: what the loop's gate (`reflow.runtime.tail_gate.TailGate`) looks and acts
through (`TailRuntime`).

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
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import ray

from reflow.policy.tail import InFlightEpisode
from reflow.policy.tail_actions import FreeSlot, Migrate, SetConcurrency
from reflow.runtime.worker_tail import engine_name

POLL_S = 0.25
"""Seconds between two looks at the workers' progress (the loop also wakes this often in a tail)."""
PROGRESS_TIMEOUT_S = 30.0
"""A worker that does not answer `progress()` in this long is left out of that snapshot."""


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

    def restart(self) -> None:
        """The gate looks through this runtime again after looks without it (one rollout engine for a
        while): nothing it knew then holds. Freed engines are ordinary again, the groups seen before are
        forgotten (one in flight and not in the next snapshot counts by placeholders, not as
        finishing), and the next look polls afresh. Migrations measured meanwhile come with that poll."""
        self.released.clear()
        self.seen.clear()
        self.snapshot = None

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
