"""Lending in the simulator: the rollout engine beside each trainer GPU group, lent while the trainer
waits, as the runtime lends with `elastic.lend` (reflow/runtime/lending.py `LentEngines`; the pipeline
model and the yield rule are reflow/policy/lending.py's).

What it owns: the lent engines (one per trainer GPU group at the start, train GPUs / decode.tp, with
the rollout engines' DecodeCost and the colocated KV share, since the trainer's state holds the rest
of the GPU); how many of them lend now (the elastic policy's l, which `SimActuator.lend` sets; all
from the start, as in the runtime); their groups (a lent group runs every turn of every sample on
its engine, but the episodes it hands over); when they take groups (only while no train step runs,
under the same admission control as the rollout engines, not under the tail gate, whose B + delta is
the rollout engines' share); their yield at each step start (what fits the rollout engines handed
over, below; the rest paused with their tokens, resumed once the trainer waits again, on the weights
of then; an engine whose oldest group is more than eta versions old runs on beside the step instead:
`lent_engine_yields`); the trainer's slowdown in a step a lent engine runs on beside (its rate times
1 - `sync.lend_beside_slowdown`; a step its engines yield to runs at the trainer's own rate, as
`reflow bench lending` measured on CPU: 1.5% slower, against 35% beside); the assumed cost of
switching a GPU between them (`sync.lend_switch_s`, each way); and the counters a run reports (busy
and stored seconds, yields, run-ons, groups, episodes handed over) and the policy observes (busy
seconds; the trainer's steps since its last change, alone and beside a lent engine, with the yields'
switch seconds: `LendWindow`).

A slot that joins the trainer later (an elastic move) lends no engine: the runtime places its lent
engines beside the trainer ranks it starts with.

The hand-over at a yield is the runtime's (`hand_over`, by `reflow.policy.lending.hand_over_plan`):
after the rollout side has started what admission allows, a yielding (or still paused) lent engine's
episodes that fit the rollout engines' free sequences move there, whole groups first, and generate
through the step; the rest pause; they count in the rollout engines' group cap as the runtime counts
them in their worker's load. The free sequences are counted as the runtime's tail gate counts them
(`rollout_free`): on one rollout engine it does not poll, its groups whole; where it polls, the
sequences running. Where it differs from the runtime: with no tail and two rollout engines or more
the simulator counts running sequences (the runtime each worker's groups whole); the tail gate's
view of a batch leaves handed-over episodes out; an episode handed over in a tool call pays no
re-prefill of its prefix; one whose rollout engine leaves goes to the rollout queue, not back home;
the step pays `sync.lend_switch_s` for a yield, not the seconds the hand-over's calls take; a lent
engine's busy seconds are its decoding seconds (the runtime's are the wall seconds a group of it is
at home and it is not paused: tool calls and prefill included). Not modelled: a lent engine's
weights arriving late: the runtime's lent engine loads each version on its trainer's core beside the
next step, and admission counts its starts from the version it has confirmed
(`WeightPusher.admission_version`); here every engine has the new version at each sync and lent
groups start on it, so the simulator admits a lagging lent engine's groups more readily and tags
them one version fresher than the runtime would.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any, Protocol

from reflow.metrics import idle_ratio
from reflow.policy.elastic import ElasticConfig
from reflow.policy.lending import LendWindow, hand_over_plan, lent_engine_yields
from reflow.policy.tail import TailPolicy
from reflow.sim.config import ModeConfig, Scenario
from reflow.sim.costs import DecodeModel, decode_model
from reflow.sim.engines import Engine, GroupState, Request
from reflow.sim.metrics import Recorder
from reflow.sim.store import SimStore

LENT_EID = 1_000_000
"""Lent engines' ids start here (rollout engines count from 0): they never meet in one heap, but the
ids stay unique in events and traces."""


def engine_limit(e: Engine, limit: int | None) -> int:
    """A rollout engine's sequence limit: `limit` (the runtime's per-worker groups times the group
    size), None: its `max_running`; never above `max_running`."""
    return min(e.max_running, limit or e.max_running)


def free_sequences(engines: list[Engine], limit: int | None, waiting: int) -> list[int]:
    """Each rollout engine's free sequences: its limit (`engine_limit`) less what it runs, less the
    `waiting` requests that will take the first of them, from the engines with the most room (they
    admit there first)."""
    free = [max(0, engine_limit(e, limit) - e.b) for e in engines]
    for i in sorted(range(len(free)), key=lambda i: -free[i]):
        take = min(free[i], waiting)
        free[i] -= take
        waiting -= take
    return free


class TrainerState(Protocol):
    """What lending reads of the trainer (`reflow.sim.training.SimTrainer`)."""

    busy: bool
    syncing: bool
    draining: bool
    train_gpus: int


class LendingHost(Protocol):
    """What `SimLending` uses of the simulation that holds it (`reflow.sim.simulation.Simulation`)."""

    s: Scenario
    m: ModeConfig
    now: float
    seq: Iterator[int]
    rec: Recorder
    engines: list[Engine]
    dm: DecodeModel
    queue: deque[Request]
    prefilling: int
    store: SimStore
    tail: TailPolicy | None

    def on_migrated(self, obj: tuple[Request, Engine], _token: int) -> None: ...

    @property
    def version(self) -> int: ...
    @property
    def trainer(self) -> TrainerState: ...
    def push(self, at: float, kind: str, obj: Any = None, token: int = 0) -> None: ...
    def reschedule(self, e: Engine) -> None: ...
    def on_resumed(self, e: Engine, _token: int) -> None: ...
    def start_group(self, lent: Engine | None = None) -> GroupState: ...
    def admission_room(self, lent: bool = False) -> int: ...


class SimLending:
    """The lent engines of one simulation (see the module docstring)."""

    def __init__(self, sim: LendingHost, slots: int) -> None:
        s, m = sim.s, sim.m
        self.sim = sim
        self.beside_slowdown = s.sync.lend_beside_slowdown
        self.switch_s = s.sync.lend_switch_s
        self.eta = 1 if m.eta is None else m.eta
        dm = decode_model(s.gpu, s.model, s.decode, colocated=True)
        # groups a lent engine runs at once: the runtime's per rollout worker
        self.per_engine = m.groups_per_engine or max(1, dm.max_running // s.batch.samples_per_group)
        self.engines = [Engine(LENT_EID + i, dm, lent=True) for i in range(slots)]
        self.lending = slots
        self.queues: dict[Engine, deque[Request]] = {e: deque() for e in self.engines}
        self.groups: dict[str, GroupState] = {}
        self.yielded: set[Engine] = set()
        self.stored_at = dict.fromkeys(self.engines, 0.0)  # busy seconds when its last group was stored
        self.marks: list[tuple[float, float]] = []  # (busy, stored) seconds at each version boundary
        self.yields = self.ran_on = self.started = self.stored_groups = self.handed_over = 0
        # the trainer's steps since the policy's last change
        self.window = LendWindow(ElasticConfig(**m.elastic_config).lend_window_steps)
        self.poked = False

    @classmethod
    def of(cls, sim: LendingHost) -> SimLending | None:
        """The simulation's lending, None when its mode lends nothing."""
        return cls(sim, sim.trainer.train_gpus // sim.s.decode.tp) if sim.m.lends else None

    # ---- what the elastic policy observes and sets

    def lendable(self) -> int:
        """Train slots that hold an engine to lend (no more than the trainer has now)."""
        return min(len(self.engines), self.sim.trainer.train_gpus // self.sim.s.decode.tp)

    def lent_slots(self) -> int:
        return min(self.lending, self.lendable())

    def set_lending(self, slots: int) -> None:
        """The policy's lend / reclaim: a reclaimed engine takes no new group, its groups run on."""
        self.lending = slots
        self.poke()

    def busy_s(self) -> float:
        """Generating seconds so far, summed over the lent engines."""
        for e in self.engines:
            e.advance(self.sim.now)
        return sum(e.busy_s for e in self.engines)

    def stored_s(self) -> float:
        """Of `busy_s`, the seconds up to each engine's last group stored (the rest produced nothing yet)."""
        return sum(self.stored_at.values())

    # ---- taking groups while the trainer waits

    def trainer_waits(self) -> bool:
        tr = self.sim.trainer
        return not (tr.busy or tr.syncing or tr.draining)

    def poke(self) -> None:
        """Look for work once the current event is handled: by then the trainer has started the step
        it could (the runtime's loop asks for a step before it feeds its lent engines)."""
        if not self.poked:
            self.poked = True
            self.sim.push(self.sim.now, "lend")

    def on_lend(self, _obj: object, _token: int) -> None:
        self.poked = False
        if not self.trainer_waits():
            return
        self.resume(sorted(self.yielded, key=lambda e: e.eid))
        while (e := self.free()) is not None and self.sim.admission_room(lent=True) > 0:
            g = self.sim.start_group(lent=e)
            self.groups[g.gid] = g
            self.started += 1

    def loads(self) -> dict[Engine, int]:
        """Groups with a sample at home on each lent engine (not those handed over whole)."""
        counts = dict.fromkeys(self.engines, 0)
        for g in self.groups.values():
            if g.pending > g.episodes_away:
                counts[g.lent] += 1
        return counts

    def episodes_away(self) -> int:
        """Episodes handed over to the rollout engines and still running there."""
        return sum(g.episodes_away for g in self.groups.values())

    def free(self) -> Engine | None:
        """A lending engine with room for one more group (the least loaded), or None."""
        loads = self.loads()
        fits = [e for e in self.engines[: self.lent_slots()] if loads[e] < self.per_engine]
        return min(fits, key=lambda e: (loads[e], e.eid)) if fits else None

    def ready(self, req: Request) -> None:
        """A lent group's request is prefilled (or back from a tool call): its engine's queue."""
        e = req.group.lent
        assert e is not None
        q = self.queues[e]
        if req.turn or req.resumed:  # later turns first, as on the rollout engines
            q.appendleft(req)
        else:
            q.append(req)
        self.admit(e)

    def admit(self, e: Engine) -> None:
        """Admit what fits; a paused engine takes its requests too and decodes them once it resumes."""
        e.advance(self.sim.now)
        q = self.queues[e]
        while q and e.has_room(q[0]):
            req = q.popleft()
            req.versions.add(self.sim.version)
            e.admit(req, next(self.sim.seq))
        self.sim.reschedule(e)

    def stored(self, g: GroupState) -> None:
        e = g.lent
        assert e is not None
        del self.groups[g.gid]
        self.stored_groups += 1
        e.advance(self.sim.now)
        self.stored_at[e] = e.busy_s
        self.poke()

    # ---- a step starts, the trainer waits again

    def step_starts(self, version: int, seconds: float, tokens: float, samples: int) -> float:
        """A step training `version` + 1 on `tokens` and `samples` starts and would take `seconds` (it
        goes into the policy's window, alone or beside, with its yield's switch seconds): each lent
        engine with groups hands over what the rollout engines take (`hand_over`) and yields, but one
        whose oldest group with an episode at home started more than eta versions before `version`,
        which runs on beside the step (and is resumed for it if it was paused); an engine still paused
        from the last step hands over too. Returns the step's seconds beside its lent engines: slower
        by 1 - `sync.lend_beside_slowdown` when an engine runs on, plus one switch
        (`sync.lend_switch_s`, the engines offload in parallel) when one yields."""
        oldest: dict[Engine, int | None] = {}  # None: every group of it is on the rollout engines
        for g in self.groups.values():
            assert g.lent is not None
            mine = oldest.setdefault(g.lent, None)
            if g.pending > g.episodes_away:
                oldest[g.lent] = g.version if mine is None else min(mine, g.version)
        yielding, still, running_on = [], [], []
        for e in sorted(oldest, key=lambda e: e.eid):
            if lent_engine_yields(oldest[e], version, self.eta):
                (still if e in self.yielded else yielding).append(e)
                continue
            running_on.append(e)
            self.sim.rec.event(
                {
                    "kind": "elastic",
                    "t": self.sim.now,
                    "version": version,
                    "what": "lent_runs_on",
                    "why": f"its oldest group started on version {oldest[e]}, more than eta={self.eta} "
                    f"versions before {version}: it generates beside the step",
                    "engine": e.eid - LENT_EID,
                }
            )
        self.hand_over([*yielding, *still])
        for e in yielding:
            e.advance(self.sim.now)
            e.paused += 1
            e.token += 1  # its next turn end is void until it resumes
            self.yielded.add(e)
        self.yields += bool(yielding)
        self.ran_on += len(running_on)
        self.resume([e for e in running_on if e in self.yielded])
        if running_on:
            seconds /= 1.0 - self.beside_slowdown
        switch = self.switch_s if yielding else 0.0
        self.window.add(seconds, tokens, samples, beside=bool(running_on), yield_s=switch)
        return seconds + switch

    def at_home(self, e: Engine) -> list[Request]:
        """The episodes of `e`'s groups not handed over, as the runtime's worker hands them over: whole
        groups first, the smallest first (a group with nothing left at home frees its engine), each
        wherever it is (running, queued for the engine, in prefill or a tool call)."""
        groups = [g for g in self.groups.values() if g.lent is e and g.pending > g.episodes_away]
        homes = [[r for r in g.episodes if not r.handed] for g in groups]
        order = sorted(range(len(groups)), key=lambda i: (len(homes[i]), groups[i].gid))
        return [r for i in order for r in homes[i]]

    def on_handed(self, obj: tuple[Request, Engine], token: int) -> None:
        """A handed-over episode has re-prefilled its prefix: it lands on its target as a migration."""
        self.sim.prefilling -= 1
        self.sim.on_migrated(obj, token)

    def rollout_free(self, targets: list[Engine]) -> list[int]:
        """The rollout engines' free sequences as the runtime's tail gate counts them for a hand-over:
        where it polls its workers (two rollout engines or more, or `tail.set_concurrency`), each
        engine's limit less the sequences it runs and those waiting for it (`free_sequences`); on one
        engine that it does not poll, the limit less every rollout group in flight counted whole, less
        the episodes handed over before. (With no tail and two engines or more the runtime counts
        each worker's groups whole too; the simulator, which does not track a group's worker, counts
        sequences there.)"""
        sim, n = self.sim, self.sim.s.batch.samples_per_group
        per_worker = sim.m.groups_per_engine
        limit = per_worker * n if per_worker else None
        if len(targets) >= 2 or (sim.tail is not None and sim.tail.cfg.set_concurrency):
            return free_sequences(targets, limit, len(sim.queue) + sim.prefilling)
        groups = sim.store.in_flight() - len(self.groups)
        return [max(0, engine_limit(targets[0], limit) - groups * n - self.episodes_away())]

    def hand_over(self, engines: list[Engine]) -> None:
        """Before they pause: as many of the yielding (or still paused) engines' episodes as the rollout
        engines have free sequences for move there for good and generate through the step, as the
        runtime's yield does, by the same plan (`hand_over_plan`: the engine with the most episodes
        first, each to the rollout engine with the most room, none split over two). The trainer has
        let the rollout side start what admission allows before it took the batch (the runtime's loop
        launches before it starts a step). A running or queued episode keeps its tokens and
        re-prefills its prefix on its target (a migration; counted with the requests in prefill until
        it lands, `on_handed`); one in prefill or a tool call goes to the rollout engines' queue when
        its tool returns (its prefix's re-prefill is not charged). Every engine holds the same
        weights here, so the plan's version rule never binds."""
        sim = self.sim
        targets = [e for e in sim.engines if e.alive]
        if not targets or not engines:
            return
        home = {e: self.at_home(e) for e in engines}
        plan = hand_over_plan([len(home[e]) for e in engines], self.rollout_free(targets))
        for e, (w, k) in zip(engines, plan, strict=True):
            if k <= 0:
                continue
            e.advance(sim.now)
            for req in home[e][:k]:
                req.handed = True
                req.versions.add(sim.version)
                sim.prefilling += 1  # on its way to a rollout engine: counted until it is queued there
                if req.engine is e:
                    sim.rec.generated(e.remove(req))
                elif req in self.queues[e]:
                    self.queues[e].remove(req)
                else:  # in prefill or a tool call: its "ready" goes to the rollout side
                    continue
                sim.push(sim.now + req.ctx * sim.dm.prefill_s_per_token, "handed", (req, targets[w]))
            self.handed_over += k
            sim.reschedule(e)
            sim.rec.event(
                {
                    "kind": "elastic",
                    "t": sim.now,
                    "version": sim.version,
                    "what": "lent_hand_over",
                    "why": f"rollout engines had free sequences at the step's start: {k} episodes go on "
                    "there instead of pausing",
                    "engine": e.eid - LENT_EID,
                    "episodes": k,
                }
            )

    def resume(self, engines: list[Engine]) -> None:
        """Paused episodes continue on the engine's weights of now (per-token versions), after the
        switch back to the engine."""
        for e in engines:
            self.yielded.discard(e)
            for _, _, req in e.running:
                req.versions.add(self.sim.version)
            if self.switch_s > 0:
                self.sim.push(self.sim.now + self.switch_s, "resumed", e)
            else:
                self.sim.on_resumed(e, 0)

    # ---- what a run reports

    def mark(self) -> None:
        """A version boundary: the counters for the steady-state window of the summary."""
        self.marks.append((self.busy_s(), self.stored_s()))

    def summary(self, steps: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
        """The lending figures: whole-run counters, and the train slots' idle share over the summary's
        window counting lent generation that ended in stored groups (reflow/recipes/run_log.py's
        train_slot_idle_ratio; the lent seconds shared over the train slots)."""
        warm = min(warmup, len(steps) - 1)
        first = (steps[warm - 1]["wall_s"], steps[warm - 1]["_busy"][2], self.marks[warm - 1][1])
        t0, train0, stored0 = first if warm > 0 else (0.0, 0.0, 0.0)
        t1, train1, stored1 = steps[-1]["wall_s"], steps[-1]["_busy"][2], self.marks[-1][1]
        slots = max(1, len(self.engines))
        window = max(t1 - t0, 1e-9)
        return {
            "lent_busy_s": self.busy_s(),
            "lent_stored_s": self.stored_s(),
            "lent_yields": self.yields,
            "lent_handed_over": self.handed_over,
            "lent_ran_on": self.ran_on,
            "lent_groups": self.started,
            "lent_groups_stored": self.stored_groups,
            "lent_slots": self.lent_slots(),
            "train_slot_idle_ratio": idle_ratio(train1 - train0 + (stored1 - stored0) / slots, window),
        }
