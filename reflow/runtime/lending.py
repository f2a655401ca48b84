"""Lending on Ray: the decoupled loop's side of the engines lent beside the trainer ranks.

With `elastic.lend` the cluster places a rollout worker beside each trainer rank (`Cluster.lent`, on
the rank's slot, reserving nothing of its own). `LentEngines` is what the loop keeps of them:

- which of them lend now (`lending`, the elastic policy's l: `lend`/`reclaim` decisions set it;
  every lendable engine lends from the start, and the policy reclaims where lending does not pay);
- their groups in flight, started only while no train step runs, under the same admission control
  and time budget as the rollout workers' (the loop counts both); not under the tail gate, whose
  B + delta is the rollout workers' share of a batch: a lent engine starts mostly the next batch's
  groups, early. Admission's room is shared: a lent group paused through a step would hold a place
  the rollout workers could have started a group in (measured on longtail-tiny: their idle share
  rose beside a lent engine), hence the hand-over below;
- `pause` at a step's start: first, as many of the lent engines' episodes as the rollout engines have
  free sequences for (their limit less their load, what was handed over before counted in it) move
  there for good, as a migration, and generate through the step (`reflow.policy.lending.
  hand_over_plan`; an engine still paused from the last step hands over too); then the engines'
  requests are aborted (their tokens kept) before the trainer computes, so the step has the slot
  within one decode step. Only rollout engines whose confirmed weights are no older than the lent
  engine's are offered its episodes, and an episode with tokens of newer weights than its target's
  stays (`Routes.hand_over`): tokens go back a version only after a fallback home (the target
  left), so a group's staleness stays what admission counted from the lent engine. Each yield's
  report (every engine with groups reports first), and between yields `refresh` (every `refresh_s`:
  the loop wakes that often while anything is handed over), rebuild the books of what runs where: a group with no episode left on its lent
  engine keeps no busy clock running there and never makes it run on; its episodes on a rollout
  engine carry that engine's versions (per-token), count in that engine's load, in the tail policy's
  view of it (`TailGate.look`'s `served`), in its busy time and in which worker a move to training
  drains, until they end; one that falls back home (its target left) counts on its lent engine
  again. Not done: an engine past the bound hands nothing over before running on. An engine whose
  oldest group on it is past the staleness bound runs on instead (`reflow.policy.lending.
  lent_engine_yields`, asked at every step start, paused engines too); `resume` when the trainer
  waits for a batch again: the paused episodes resubmit their prefixes on the engine's weights of
  then (per-token versions, as any partial rollout);
- their generating seconds (`busy_s`: a group in flight and not paused), the elastic policy's lent
  busy time, and of those the seconds that ended in a stored group, outside train steps (`stored_s`),
  the train slot's generation time in its idle ratio: an engine running on beside a step shares the
  slot with the trainer, whose step time counts that time once already.

A reclaimed engine takes no new group; the groups it has run on while the trainer waits. Its weights
reach it through the loop's `WeightPusher` like any engine's (`Cluster.engines`): with one trainer
rank on CPU that is a copy through Ray's shared-memory object store, not an in-place share.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import ray

from reflow.policy.lending import hand_over_plan, lent_engine_yields
from reflow.runtime.tail import POLL_S, PROGRESS_TIMEOUT_S
from reflow.runtime.worker_tail import engine_name

REPORT_TIMEOUT_S = PROGRESS_TIMEOUT_S
"""A lent engine that does not report in this long (its actor shares the trainer's cores, which a
step may hold) keeps its books until its next report."""


class _Clocks:
    """One stopwatch per engine: seconds accumulated while running, a running one read up to now."""

    def __init__(self, n: int) -> None:
        self.total = [0.0] * n
        self.since: list[float | None] = [None] * n  # running since (None: stopped)

    def running(self, i: int) -> bool:
        return self.since[i] is not None

    def start(self, i: int) -> None:
        """Start `i` (one already running keeps its start)."""
        if self.since[i] is None:
            self.since[i] = time.monotonic()

    def stop(self, i: int) -> None:
        since = self.since[i]
        if since is not None:
            self.total[i] += time.monotonic() - since
            self.since[i] = None

    def read(self, i: int) -> float:
        since = self.since[i]
        return self.total[i] + (time.monotonic() - since if since is not None else 0.0)


class LentEngines:
    """See the module docstring. `per_engine`: groups a lent engine runs at once; `eta`: the staleness
    bound (versions) past which a lent group runs on through a step; `state`: the loop's `RunState`,
    whose counters (`lent_busy_s`, `lent_yields`, restored on a resume) these continue."""

    def __init__(
        self,
        cluster: Any,
        per_engine: int,
        eta: int,
        state: Any = None,
        lending: int | None = None,
        group_size: int = 1,
        refresh_s: float = POLL_S,
    ) -> None:
        self.cluster, self.per_engine, self.eta, self.group_size = cluster, per_engine, eta, group_size
        n = len(cluster.lent)
        self.lending = n if lending is None else lending
        self.groups: dict[Any, tuple[int, int]] = {}  # object ref -> (lent engine, version started on)
        self.ids: dict[Any, str] = {}  # object ref -> group id (what a hand-over reports by)
        self.served: dict[Any, dict[int, int]] = {}  # ref -> rollout slot index -> episodes handed over
        self.away: set[Any] = set()  # groups with no episode left on their lent engine
        self.home: dict[Any, int] = {}  # ref -> its episodes on its lent engine at the last report
        self.paused: set[int] = set()
        self._busy = _Clocks(n)  # generating seconds in this session (stopped: idle or paused)
        self._stored = [0.0] * n  # of those, the ones up to the engine's last group stored, beside no step
        self._beside = _Clocks(n)  # of those, the ones generated while a train step ran (running on)
        self._before = (state.lent_busy_s, state.lent_stored_s) if state is not None else (0.0, 0.0)
        self.pauses = state.lent_yields if state is not None else 0
        """Step starts at which at least one lent engine yielded (the run's, a resumed one's too)."""
        self.ran_on = 0
        """Run-ons: a lent engine running on past the staleness bound at a step start (one per engine
        and step)."""
        self.beside_step = False
        """Whether a lent engine generates beside the step started last (ran on past the bound)."""
        self.yield_s = 0.0
        """Seconds the engines took to yield before the step started last (0: none yielded)."""
        self.refresh_s = refresh_s
        self._refreshed = -math.inf
        self._handing: set[int] = set()  # engines with episodes handed over at their last report
        self._running_on: set[int] = set()  # engines running on beside the step now
        self.handed_over = state.lent_handed_over if state is not None else 0
        """Episodes the yields moved to rollout engines (the run's, a resumed one's too)."""

    @property
    def in_flight(self) -> int:
        return len(self.groups)

    def loads(self) -> list[int]:
        """Groups with episodes on each lent engine (not those handed over whole)."""
        counts = [0] * len(self.cluster.lent)
        for ref, (engine, _) in self.groups.items():
            counts[engine] += ref not in self.away
        return counts

    def free(self) -> int | None:
        """A lending engine with room for one more group (the least loaded), or None. The loop asks
        only while no train step runs."""
        loads = self.loads()
        fits = [e for e in range(self.lending) if loads[e] < self.per_engine and e not in self.paused]
        return min(fits, key=lambda e: (loads[e], e)) if fits else None

    def started(self, ref: Any, engine: int, version: int, group_id: str = "") -> None:
        """A group started on lent engine `engine` with the weights `version` its engine confirmed."""
        self.groups[ref] = (engine, version)
        self.ids[ref] = group_id
        if engine not in self.paused:
            self._busy.start(engine)

    def done(self, ref: Any) -> bool:
        """Whether `ref` was a lent group (it is forgotten; the loop takes its report)."""
        if ref not in self.groups:
            return False
        engine, _ = self.groups.pop(ref)
        self.ids.pop(ref, None)
        self.served.pop(ref, None)
        self.away.discard(ref)
        self.home.pop(ref, None)
        self._stored[engine] = self._busy.read(engine) - self._beside.read(engine)
        if engine not in self._busy_engines():
            self._stop_clock(engine)
        return True

    def _busy_engines(self) -> set[int]:
        """Engines with a group of which some episode is still on them."""
        return {e for ref, (e, _) in self.groups.items() if ref not in self.away}

    def served_loads(self) -> list[int]:
        """Episodes handed over and still in flight, by rollout worker position (`cluster.rollout`), what
        the rollout engines' loads leave out (they count their own episodes)."""
        per_slot: dict[int, int] = {}
        for moved in self.served.values():
            for slot, n in moved.items():
                per_slot[slot] = per_slot.get(slot, 0) + n
        return [per_slot.get(s.index, 0) for s in self.cluster.rollout_slots]

    def _rollout_names(self) -> dict[str, int]:
        """Each rollout engine's name (what reports and hand-overs name it by) -> its slot index, in
        rollout worker order."""
        return {engine_name(s.index): s.index for s in self.cluster.rollout_slots}

    def count_into(self, state: Any) -> None:
        """Write the run's lending counters into the loop's `RunState` (what checkpoints and the summary
        keep)."""
        state.lent_busy_s, state.lent_stored_s = self.busy_s(), self.stored_s()
        state.lent_yields, state.lent_handed_over = self.pauses, self.handed_over

    def pause(
        self, version: int, free: Sequence[int] = (), confirmed: Sequence[int] = ()
    ) -> list[dict[str, Any]]:
        """A step training `version` + 1 starts: every lent engine with groups yields (returns once
        each has aborted its requests in flight, after handing over what the rollout engines' `free`
        sequences, by position, take: those whose weights are no older than its own, by `confirmed`,
        each engine's confirmed version in `Cluster.engines`' order; empty: not compared), but one whose oldest group on it started more than `eta`
        versions ago, which runs on beside the step; asked at every step start, so an engine kept
        paused through back-to-back steps (a trainer that never waits) is resumed once its groups
        reach the bound. Returns the events of engines that run on or hand episodes over. `yield_s`:
        the seconds all this took (the reports asked first, the yields), lending's cost before the
        step."""
        t0 = time.monotonic()
        # what runs where now, on every engine with groups: a fallback home counts for run-on, and
        # the plan's demand is what each engine holds now
        events = self.refresh(force=True, ask={e for e, _ in self.groups.values()})
        oldest: dict[int, int | None] = {}  # None: every group of it is on rollout engines
        for ref, (engine, started) in self.groups.items():
            mine = oldest.setdefault(engine, None)
            if ref not in self.away:
                oldest[engine] = started if mine is None else min(mine, started)
        yielding, still, running_on = [], [], []
        for engine in sorted(oldest):
            if lent_engine_yields(oldest[engine], version, self.eta):
                (still if engine in self.paused else yielding).append(engine)
                continue
            running_on.append(engine)
            self.ran_on += 1
            events.append({
                "what": "lent_runs_on",
                "why": f"its oldest group started on version {oldest[engine]}, more than eta={self.eta} "
                f"versions before {version}: it generates beside the step",
                "engine": engine,
            })  # fmt: skip
        if yielding or (still and any(f > 0 for f in free)):  # paused still: what fits is handed over
            events += self._yield(yielding, still, free, confirmed)
            self.pauses += bool(yielding)
        self.yield_s = time.monotonic() - t0
        for engine in yielding:
            self._stop_clock(engine)
            self.paused.add(engine)
        self.beside_step, self._running_on = bool(running_on), set(running_on)
        self._resume([e for e in running_on if e in self.paused])
        for engine in running_on:  # it generates beside the step from now on
            if self._busy.running(engine):
                self._beside.start(engine)
        return events

    def _yield(
        self, engines: list[int], still: list[int], free: Sequence[int], confirmed: Sequence[int]
    ) -> list[dict[str, Any]]:
        """Pause `engines` (all at once), each handing over first what `hand_over_plan` gives it; of
        the engines `still` paused from the last step, only those it gives episodes to are called.
        Each call's report rebuilds the books of its engine's groups (what runs where)."""
        asked = [*engines, *still]
        n = len(self.cluster.rollout)
        plan = hand_over_plan(
            [self._at_home(e) for e in asked],
            free,
            [confirmed[n + e] for e in asked] if confirmed else (),
            confirmed[:n],
        )
        names = self._rollout_names()
        slots = list(names.values())
        calls = []
        for e, (w, k) in zip(asked, plan, strict=True):
            if k or e in engines:
                version = confirmed[w] if confirmed else None
                target = (self.cluster.rollout[w], engine_name(slots[w]), k, version) if k else ()
                calls.append((e, self.cluster.lent[e].yield_episodes.remote(*target)))
        events = []
        for (e, _), out in zip(calls, ray.get([ref for _, ref in calls]), strict=True):
            events += self._book(e, out, names)
        return events

    def refresh(self, force: bool = False, ask: set[int] | None = None) -> list[dict[str, Any]]:
        """Between yields, at most every `refresh_s` (or now, `force`): the engines with episodes
        handed over (and those in `ask`) report what runs where again (`RolloutWorker.lent_report`),
        so the served loads drop as those episodes end and a group that fell back home counts on its
        engine again. An engine that does not answer in `REPORT_TIMEOUT_S` keeps its books until the
        next report. Returns the migrations measured since (events)."""
        now = time.monotonic()
        if not force and now - self._refreshed < self.refresh_s:
            return []
        self._refreshed = now
        holding = {self.groups[ref][0] for ref in self.served.keys() | self.away if ref in self.groups}
        engines = sorted(holding | self._handing | (ask or set()))
        if not engines:
            return []
        names = self._rollout_names()
        calls = {self.cluster.lent[e].lent_report.remote(): e for e in engines}
        ready, _ = ray.wait(list(calls), num_returns=len(calls), timeout=REPORT_TIMEOUT_S)
        events = []
        for ref in ready:
            events += self._book(calls[ref], ray.get(ref), names)
        busy = self._busy_engines()
        for e in engines:  # a group home again generates there, unless its engine is paused
            if e not in busy:
                self._stop_clock(e)
            elif e not in self.paused:
                self._busy.start(e)
                if e in self._running_on:  # beside the step: its seconds are the step's too
                    self._beside.start(e)
        return events

    def wake_s(self) -> float | None:
        """How long the loop may wait before the next `refresh` (None: nothing handed over)."""
        return self.refresh_s if self.served or self.away or self._handing else None

    def _at_home(self, engine: int) -> int:
        """Episodes on `engine` as its last report had them (a group not reported yet: all of it)."""
        return sum(
            self.home.get(ref, self.group_size)
            for ref, (e, _) in self.groups.items()
            if e == engine and ref not in self.away
        )

    def _book(self, engine: int, out: dict[str, Any], names: dict[str, int]) -> list[dict[str, Any]]:
        """A report from `engine` (a yield's or `refresh`'s): per group, the episodes at home and those
        handed over still running on rollout engines (by slot). A group with none at home is away
        (nothing of it runs on its engine: handed over, or done and its report not in yet), one at
        home again (a fallback) is not; a group in no report yet (its episodes not opened) counts
        whole at home. The migrations it measured since its last report, events."""
        for ref, gid in self.ids.items():
            if self.groups[ref][0] != engine:
                continue
            if gid not in out["home"] and gid not in out["away"] and ref not in self.home:
                continue  # started, no episode open yet: all of it is (about to be) here
            self.home[ref] = out["home"].get(gid, 0)
            running = {names[n]: k for n, k in out["away"].get(gid, {}).items() if n in names}
            if running:
                self.served[ref] = running
            else:
                self.served.pop(ref, None)
            if self.home[ref]:
                self.away.discard(ref)
            else:
                self.away.add(ref)
        moved = sum(out.get("moved", {}).values())
        self.handed_over += moved
        if moved or out["away"]:  # asked again until a report shows nothing of it elsewhere
            self._handing.add(engine)
        else:
            self._handing.discard(engine)
        events = []
        if moved:
            events.append({
                "what": "lent_hand_over",
                "why": f"rollout engines had free sequences at the step's start: {moved} episodes go on "
                "there instead of pausing",
                "engine": engine,
                "episodes": moved,
                "groups": dict(out["moved"]),  # group id -> its episodes moved
            })  # fmt: skip
        for m in out.get("migrations", []):  # hand-overs measured since its last report
            events.append({"what": "lent_migration_measured", "engine": engine, **m})
        return events

    def step_done(self) -> None:
        """The train step is over: an engine running on generates beside no step from now on (its
        seconds count in `stored_s` again)."""
        for engine in range(len(self._stored)):
            self._beside.stop(engine)
        self._running_on = set()

    def resume(self) -> None:
        """The trainer waits: the paused engines' episodes resubmit, on the weights the engines have."""
        self.step_done()
        self._resume(sorted(self.paused))

    def _resume(self, engines: list[int]) -> None:
        if not engines:
            return
        ray.get([self.cluster.lent[e].resume_episodes.remote() for e in engines])
        self.paused.difference_update(engines)
        busy = self._busy_engines()
        for engine in engines:
            if engine in busy:
                self._busy.start(engine)

    def busy_s(self) -> float:
        """Generating seconds so far in the run (a resumed one's too), summed over the lent engines."""
        return self._before[0] + sum(self._busy.read(e) for e in range(len(self._stored)))

    def stored_s(self) -> float:
        """Of `busy_s`, the seconds up to each engine's last group stored (a resumed run's too), less
        those it generated beside a train step (running on: the trainer's step time holds them): what
        an engine generated after its last stored group, for groups cancelled at the run's end,
        produced nothing. With several groups on an engine at once, a group still running when
        another is stored counts up to then."""
        return self._before[1] + sum(self._stored)

    def _stop_clock(self, engine: int) -> None:
        self._beside.stop(engine)
        self._busy.stop(engine)

    def state_dict(self) -> dict[str, Any]:
        return {"lending": self.lending}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.lending = min(int(state.get("lending", self.lending)), len(self.cluster.lent))
