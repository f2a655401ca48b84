"""Lending on Ray: the decoupled loop's side of the engines lent beside the trainer ranks.

With `elastic.lend` the cluster places a rollout worker beside each trainer rank (`Cluster.lent`, on
the rank's slot, reserving nothing of its own). `LentEngines` is what the loop keeps of them:

- which of them lend now (`lending`, the elastic policy's l: `lend`/`reclaim` decisions set it;
  every lendable engine lends from the start, and the policy reclaims where lending does not pay);
- their groups in flight, started only while no train step runs, under the same admission control
  and time budget as the rollout workers' (the loop counts both); not under the tail gate, whose
  B + delta is the rollout workers' share of a batch: a lent engine starts mostly the next batch's
  groups, early. Admission's room is shared: a lent group paused through a step holds a place the
  rollout workers could have started a group in (measured on longtail-tiny: their idle share rose
  beside a lent engine);
- `pause` at a step's start: the engines' requests are aborted (their tokens kept) before the trainer
  computes, so the step has the slot within one decode step; an engine whose oldest group is past
  the staleness bound runs on instead (`reflow.policy.lending.lent_engine_yields`, asked at every
  step start, paused engines too); `resume` when the trainer waits for a batch again: the paused
  episodes resubmit their prefixes on the engine's weights of then (per-token versions, as any
  partial rollout);
- their generating seconds (`busy_s`: a group in flight and not paused), the elastic policy's lent
  busy time, and of those the seconds that ended in a stored group, outside train steps (`stored_s`),
  the train slot's generation time in its idle ratio: an engine running on beside a step shares the
  slot with the trainer, whose step time counts that time once already.

A reclaimed engine takes no new group; the groups it has run on while the trainer waits. Its weights
reach it through the loop's `WeightPusher` like any engine's (`Cluster.engines`): with one trainer
rank on CPU that is a copy through Ray's shared-memory object store, not an in-place share.
"""

from __future__ import annotations

import time
from typing import Any

import ray

from reflow.policy.lending import lent_engine_yields


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
        self, cluster: Any, per_engine: int, eta: int, state: Any = None, lending: int | None = None
    ) -> None:
        self.cluster, self.per_engine, self.eta = cluster, per_engine, eta
        n = len(cluster.lent)
        self.lending = n if lending is None else lending
        self.groups: dict[Any, tuple[int, int]] = {}  # object ref -> (lent engine, version started on)
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

    @property
    def in_flight(self) -> int:
        return len(self.groups)

    def loads(self) -> list[int]:
        counts = [0] * len(self.cluster.lent)
        for engine, _ in self.groups.values():
            counts[engine] += 1
        return counts

    def free(self) -> int | None:
        """A lending engine with room for one more group (the least loaded), or None. The loop asks
        only while no train step runs."""
        loads = self.loads()
        fits = [e for e in range(self.lending) if loads[e] < self.per_engine and e not in self.paused]
        return min(fits, key=lambda e: (loads[e], e)) if fits else None

    def started(self, ref: Any, engine: int, version: int) -> None:
        """A group started on lent engine `engine` with the weights `version` its engine confirmed."""
        self.groups[ref] = (engine, version)
        if engine not in self.paused:
            self._busy.start(engine)

    def done(self, ref: Any) -> bool:
        """Whether `ref` was a lent group (it is forgotten; the loop takes its report)."""
        if ref not in self.groups:
            return False
        engine, _ = self.groups.pop(ref)
        self._stored[engine] = self._busy.read(engine) - self._beside.read(engine)
        if engine not in self._busy_engines():
            self._stop_clock(engine)
        return True

    def _busy_engines(self) -> set[int]:
        return {e for e, _ in self.groups.values()}

    def pause(self, version: int) -> list[dict[str, Any]]:
        """A step training `version` + 1 starts: every lent engine with groups yields (returns once
        each has aborted its requests in flight), but one whose oldest group started more than `eta`
        versions ago, which runs on beside the step; asked at every step start, so an engine kept
        paused through back-to-back steps (a trainer that never waits) is resumed once its groups
        reach the bound. Returns the events of engines that run on."""
        oldest: dict[int, int] = {}
        for engine, started in self.groups.values():
            oldest[engine] = min(started, oldest.get(engine, started))
        yielding, running_on, events = [], [], []
        for engine in sorted(oldest):
            if lent_engine_yields(oldest[engine], version, self.eta):
                if engine not in self.paused:
                    yielding.append(engine)
                continue
            running_on.append(engine)
            self.ran_on += 1
            events.append({
                "what": "lent_runs_on",
                "why": f"its oldest group started on version {oldest[engine]}, more than eta={self.eta} "
                f"versions before {version}: it generates beside the step",
                "engine": engine,
            })  # fmt: skip
        self.yield_s = 0.0
        if yielding:
            t0 = time.monotonic()
            ray.get([self.cluster.lent[e].pause_episodes.remote() for e in yielding])
            self.yield_s = time.monotonic() - t0
            self.pauses += 1
        for engine in yielding:
            self._stop_clock(engine)
            self.paused.add(engine)
        self.beside_step = bool(running_on)
        self._resume([e for e in running_on if e in self.paused])
        for engine in running_on:  # it generates beside the step from now on
            if self._busy.running(engine):
                self._beside.start(engine)
        return events

    def step_done(self) -> None:
        """The train step is over: an engine running on generates beside no step from now on (its
        seconds count in `stored_s` again)."""
        for engine in range(len(self._stored)):
            self._beside.stop(engine)

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
