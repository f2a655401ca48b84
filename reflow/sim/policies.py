"""The seam between the simulator and the policy objects: the policies' observation and decision in
simulated time, and the simulator's `Actuator`.

Each policy step takes explicit inputs (the simulation's counters, its engines advanced to now), builds
the policy's observation with the policy's own `observe` (the arithmetic the Ray runtime's observations
go through too), calls the policy object (`reflow.policy.dual_cycle.AdmissionControl`,
`reflow.policy.elastic.ElasticPolicy`, `reflow.policy.tail.TailPolicy`) and applies its decision
through `SimActuator`, the `reflow.policy.actuator.Actuator` of simulated time. It returns the
decision as an event in the schema of the runtime's metrics (`kind`, `what`, `why`, the numbers),
which the simulation records. No decision logic lives here: only the translation of units (engines
are slots, samples are the work unit) and the application of the actions with their costs from the
cost model. `reflow.sim.simulation.Simulation` calls these at a version boundary and in the tail.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from reflow.policy.actuator import Actuator, apply_tail, tail_event
from reflow.policy.dual_cycle import AdmissionControl
from reflow.policy.elastic import (
    ElasticConfig,
    ElasticDecision,
    ElasticPolicy,
    Interval,
    RoleChangeCost,
    decision_event,
    observe,
)
from reflow.policy.lending import LendWindow
from reflow.policy.tail import EngineState, InFlightEpisode, TailConfig, TailObservation, TailPolicy
from reflow.policy.tail import observe as observe_tail
from reflow.policy.tail_actions import FreeSlot, Migrate, SetConcurrency
from reflow.sim.config import ModeConfig, Scenario
from reflow.sim.costs import DecodeModel, role_change_s
from reflow.sim.engines import Engine, Request
from reflow.sim.lending import SimLending
from reflow.sim.metrics import Recorder
from reflow.sim.store import SimStore
from reflow.sim.training import SimTrainer


def admission_for(m: ModeConfig, groups_per_step: int) -> tuple[AdmissionControl, int]:
    """The admission control for a mode, and the factor the policy version is scaled by when asking it.

    eta (AReaL): AdmissionControl(eta, B), asked at version v. verl's fractional staleness threshold s
    (at most (1 + s) * B samples per sync period) is the same bound in units of single groups:
    AdmissionControl(round((1 + s) * B) - 1, 1) asked at version v * B, whose capacity is
    v * B + round((1 + s) * B), i.e. (v + 1 + s) * B. sync is eta = 0, one_step_off eta = 1."""
    if m.mode == "sync":
        return AdmissionControl(0, groups_per_step), 1
    if m.mode == "one_step_off":
        return AdmissionControl(1 if m.eta is None else m.eta, groups_per_step), 1
    if m.staleness_threshold is not None:
        return AdmissionControl(round((1 + m.staleness_threshold) * groups_per_step) - 1, 1), groups_per_step
    return AdmissionControl(1 if m.eta is None else m.eta, groups_per_step), 1


# ---- elastic pool


def make_elastic(s: Scenario, m: ModeConfig) -> ElasticPolicy:
    """The elastic policy with the mode's `elastic_config` (the first change priced at the cost model's
    role change unless the config says otherwise)."""
    return ElasticPolicy(
        ElasticConfig(**{"initial_change_cost_s": role_change_s(s.sync), **m.elastic_config})
    )


class ElasticCounters(NamedTuple):
    """The simulation's cumulative counters at a version boundary; the policy's interval is the
    difference of two."""

    now: float
    rollout_busy_s: float
    rollout_alive_s: float
    samples_generated: float
    trainer_busy_s: float
    samples_trained: float
    replayed_groups: float
    groups_trained: float
    lent_busy_s: float = 0.0
    """Summed over the lent engines: their generating seconds (reflow/sim/lending.py)."""


@dataclass
class ElasticSlots:
    """What the observation needs at a boundary beyond the counters."""

    step: int
    version: int
    rollout_slots: int
    train_slots: int
    batch_size: float
    fresh_waiting: int
    in_flight: int
    lent_slots: int = 0
    """Train slots lending their engine now (l)."""
    lendable_slots: int = 0
    """Train slots holding an engine to lend (0: lending off)."""
    lend_window: LendWindow | None = None
    """The trainer's steps since the last change, alone and beside a lent engine (lending on)."""


class BoundaryView(Protocol):
    """What `elastic_inputs` reads of the simulation (`reflow.sim.simulation.Simulation`)."""

    s: Scenario
    now: float
    engines: list[Engine]
    trainer: SimTrainer
    lending: SimLending | None
    rec: Recorder
    store: SimStore
    B: int

    @property
    def version(self) -> int: ...


def elastic_inputs(sim: BoundaryView) -> tuple[ElasticCounters, ElasticSlots]:
    """The simulation's counters and slots at a version boundary, for `ElasticStep.at_boundary`."""
    rec = sim.rec
    busy, alive = rec.rollout_busy(sim.engines, sim.now)
    counters = ElasticCounters(
        sim.now,
        busy,
        alive,
        rec.samples_generated,
        rec.trainer_busy_s,
        rec.samples_trained,
        rec.replayed_groups,
        rec.groups_trained,
        sim.lending.busy_s() if sim.lending is not None else 0.0,
    )
    slots = ElasticSlots(
        step=len(rec.steps),
        version=sim.version,
        rollout_slots=sum(e.alive for e in sim.engines),
        train_slots=sim.trainer.train_gpus // sim.s.decode.tp,
        batch_size=float(sim.B * sim.s.batch.samples_per_group),
        fresh_waiting=sim.store.fresh_count(),
        in_flight=sim.store.in_flight(),
    )
    if sim.lending is not None:
        slots.lent_slots, slots.lendable_slots = sim.lending.lent_slots(), sim.lending.lendable()
        slots.lend_window = sim.lending.window
    return counters, slots


class ElasticStep:
    """The elastic policy with what it remembers between its calls: the last counters, the step of
    its last move and the role-change costs it has seen."""

    def __init__(self, policy: ElasticPolicy) -> None:
        self.policy = policy
        self.last: ElasticCounters | None = None
        self.changed_at = 0
        self.cost_to_rollout: RoleChangeCost | None = None
        self.cost_to_train: RoleChangeCost | None = None

    def at_boundary(
        self, counters: ElasticCounters, slots: ElasticSlots, actuator: Actuator
    ) -> dict[str, Any]:
        """The last interval observed as the runtime observes it (`reflow.policy.elastic.observe`),
        ElasticPolicy asked, its move applied through the actuator. Returns the decision's event."""
        last = self.last or (0.0,) * len(counters)
        self.last = counters
        d = [a - b for a, b in zip(counters, last, strict=True)]
        dt, d_busy, d_alive, d_gen, d_train_busy, d_trained, d_replay, d_groups, d_lent = d
        # the rollout slot-seconds offered are counted (engines came and went): no ordering check on
        # the differences, whose sums over engines may lose an ulp when one retires
        interval = Interval(
            dt, d_busy, d_gen, d_train_busy, d_trained, rollout_offered_s=d_alive, lent_busy_s=d_lent
        )
        obs = observe(
            interval,
            step=slots.step,
            version=slots.version,
            steps_since_change=slots.step - self.changed_at,
            rollout_slots=slots.rollout_slots,
            train_slots=slots.train_slots,
            batch_size=slots.batch_size,
            replay_share=min(0.95, d_replay / d_groups) if d_groups else 0.0,  # the measured share
            fresh_waiting=slots.fresh_waiting,
            in_flight=slots.in_flight,
            to_rollout_cost=self.cost_to_rollout,
            to_train_cost=self.cost_to_train,
            lent_slots=slots.lent_slots,
            lendable_slots=slots.lendable_slots,
            lend_window=slots.lend_window,
        )
        decision = self.policy.decide(obs)
        event = {"kind": "elastic", "t": counters.now, **decision_event(decision, obs)}
        if decision.moves and slots.lend_window is not None:  # a change: measured afresh from here
            slots.lend_window.reset()
        if decision.action in ("lend", "reclaim"):
            self.changed_at = slots.step  # the next change waits its dwell, as in the runtime
            return {**event, **actuator.lend(decision)}
        if not decision.moves:
            return event
        self.changed_at = slots.step
        cost = actuator.move_slot(decision)
        if decision.action == "to_train":
            self.cost_to_train = cost
        else:
            self.cost_to_rollout = cost
        return event


# ---- tail scheduler


SGLANG_TAIL = {"migrate": False, "set_concurrency": False}
"""TailConfig settings of what the Ray runtime applies on SGLang engines: over-provisioning and
carry-over only, as SGLang's health reports no token counters, so the runtime has no prefill rate to
price a migration and no (concurrency, tokens/s) curve to set a limit from (reflow.runtime.tail).
On TorchEngine it also migrates and frees engines, and sets limits where `tail.set_concurrency` says
(off by default); `--from-run` keeps a run's own settings."""


def make_tail(m: ModeConfig) -> TailPolicy:
    return TailPolicy(TailConfig(**m.tail_config))


class SimTailGate:
    """How many more groups the batch being collected may start, as the runtime's tail gate
    (`reflow.runtime.tail_gate.TailGate`) reads TailPolicy: the `start` of its OverProvision (at most
    B + delta groups done or in flight), 0 when it asks for none (B done: carry over). The
    observation is the runtime's: one entry per group in flight, no per-episode progress. The last
    answer is kept by what it depends on (fresh groups with spread, groups in flight, completed group
    durations seen), so the policy is asked once per change, as the runtime asks it once per wake-up
    of its loop."""

    def __init__(self, policy: TailPolicy, groups_per_batch: int) -> None:
        self.policy, self.B = policy, groups_per_batch
        self.key: tuple[int, int, int] | None = None
        self.room = 0

    def __call__(self, done: int, in_flight: list[str], group_seconds: list[float]) -> int:
        """`done`: fresh groups with spread, not trained; `in_flight`: the ids of the groups running."""
        key = (done, len(in_flight), len(group_seconds))
        if key == self.key:
            return self.room
        obs = observe_tail(
            self.B,
            done,
            [InFlightEpisode(gid, gid, "pool", 0, 0, 0.0) for gid in in_flight],
            [EngineState("pool", len(in_flight), max(1, len(in_flight)))],
            group_seconds=group_seconds,
        )
        self.room = next((a.start for a in self.policy.decide(obs) if a.kind == "over_provision"), 0)
        self.key = key
        return self.room


def acts_on_engines(tail: TailPolicy) -> bool:
    """Whether the tail policy may act on engines (`tail.migrate` / `tail.set_concurrency`); without
    either, over-provisioning (the gate) is all it does."""
    return tail.cfg.migrate or tail.cfg.set_concurrency


def observe_engines(
    now: float,
    engines: dict[str, Engine],
    dm: DecodeModel,
    groups_per_batch: int,
    fresh_waiting: int,
    group_seconds: list[float],
    episode_seconds: list[float],
    groups_queued: int,
    next_batch_room: int,
) -> tuple[TailObservation, dict[str, Request]]:
    """The running batch at the level of sequences, observed as the Ray runtime observes it
    (`reflow.policy.tail.observe`), from engines advanced to `now`; and the request of each episode
    id, for the actuator."""
    requests = {}
    episodes = []
    for eid, e in engines.items():
        for _, rid, req in e.running:
            requests[str(rid)] = req
            episodes.append(
                InFlightEpisode(
                    str(rid), req.group.gid, eid, req.turn, int(req.ctx + e.S - req.s0), now - req.started_at
                )
            )
    ctx_mean = sum(ep.tokens for ep in episodes) / len(episodes) if episodes else 1000.0
    states = []
    for eid, e in engines.items():
        curve = tuple((c, dm.tokens_per_s(c, c * ctx_mean)) for c in _powers(dm.max_running))
        states.append(EngineState(eid, e.b, e.max_running, curve))
    obs = observe_tail(
        groups_per_batch,
        fresh_waiting,
        episodes,
        states,
        group_seconds=group_seconds,
        episode_seconds=episode_seconds,
        # 0: no prefill rate known (a `--from-run` engine folds prefill into its measured rate), so no
        # migration is priced, as on a runtime engine whose health reports no prefill counters
        prefill_tokens_per_s=1.0 / dm.prefill_s_per_token if dm.prefill_s_per_token > 0 else 0.0,
        groups_queued=groups_queued,
        next_batch_room=next_batch_room,
    )
    return obs, requests


def tail_step(tail: TailPolicy, obs: TailObservation, actuator: Actuator) -> list[dict[str, Any]]:
    """Ask TailPolicy about the running batch and apply its engine-level actions through the actuator
    (consolidation, concurrency limits, as the Ray runtime's `reflow.runtime.tail` does);
    over-provisioning is the gate's (`SimTailGate`). Returns one event per action."""
    return [tail_event(action, apply_tail(action, actuator)) for action in tail.decide(obs)]


def _powers(limit: int) -> list[int]:
    out, c = [], 1
    while c < limit:
        out.append(c)
        c *= 2
    return [*out, limit]


class SimulatedCluster(Protocol):
    """What `SimActuator` applies decisions to (`reflow.sim.simulation.Simulation`): the clock and its
    events, the engines and the trainer, and the rollout side's entry points for taking work off an
    engine."""

    s: Scenario
    dm: DecodeModel
    now: float
    engines: list[Engine]
    trainer: SimTrainer
    lending: SimLending | None

    def push(self, at: float, kind: str, obj: Any = None, token: int = 0) -> None: ...
    def recount(self) -> None: ...
    def evacuate(self, engine: Engine) -> None: ...
    def retire(self, engine: Engine) -> None: ...
    def take_off(self, req: Request, engine: Engine) -> None: ...


class SimActuator:
    """The simulator's `reflow.policy.actuator.Actuator`: the policies' decisions applied to the
    simulation, priced by its cost model. `engines` and `requests` name what the last tail
    observation saw (engine id -> engine, episode id -> its request); `saw` sets them."""

    def __init__(self, cluster: SimulatedCluster) -> None:
        self.cluster = cluster
        self.engines: dict[str, Engine] = {}
        self.requests: dict[str, Request] = {}

    def saw(self, engines: dict[str, Engine], requests: dict[str, Request]) -> None:
        self.engines, self.requests = engines, requests

    def move_slot(self, decision: ElasticDecision) -> RoleChangeCost:
        """Towards training the engine with the fewest sequences running leaves (they are resubmitted
        elsewhere with their exact prefix); towards rollout a train slot leaves the trainer. Either
        way the trainer group re-forms, and the slot is back in its new role after the cost model's
        role change."""
        c = self.cluster
        tp, cost = c.s.decode.tp, role_change_s(c.s.sync)
        if decision.action == "to_train":
            victim = min((e for e in c.engines if e.alive), key=lambda e: (e.b, -e.eid))
            c.evacuate(victim)
            c.retire(victim)
            c.push(c.now + cost, "role_done", ("train", tp))
            c.trainer.reform(0)
        else:
            c.trainer.reform(tp)
            c.push(c.now + cost, "role_done", ("engine", tp))
        c.recount()
        return RoleChangeCost(actor_start_s=cost)

    def lend(self, decision: ElasticDecision) -> dict[str, Any]:
        """`decision.lent_slots` train slots lend their engine from now (reflow/sim/lending.py): a
        reclaimed engine takes no new group, its groups in flight run on while the trainer waits.
        Refused where the scenario lends nothing (no lendable slot: the policy does not ask)."""
        lending = self.cluster.lending
        if lending is None:
            return {"applied": False, "error": "the scenario lends no engine (mode.elastic_config.lend)"}
        lending.set_lending(decision.lent_slots)
        return {"applied": True}

    def migrate(self, action: Migrate) -> dict[str, Any]:
        """The sequence leaves its engine and lands on the target after re-prefilling its prefix."""
        c = self.cluster
        c.take_off(self.requests[action.episode], self.engines[action.source])
        at = c.now + action.tokens * c.dm.prefill_s_per_token
        c.push(at, "migrated", (self.requests[action.episode], self.engines[action.target]))
        return {"applied": True}

    def free_engine(self, action: FreeSlot) -> dict[str, Any]:
        """Nothing to do: the emptied engine takes the next groups admission allows."""
        return {"applied": True}

    def set_concurrency(self, action: SetConcurrency) -> dict[str, Any]:
        self.engines[action.engine].max_running = action.concurrency
        self.cluster.recount()
        return {"applied": True}
