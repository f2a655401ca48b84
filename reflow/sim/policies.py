"""The seam between the simulator and the policy objects: one function per policy call, and the
simulator's `Actuator`.

Each function builds the policy's observation from simulated counters with the policy's own `observe`
(the arithmetic the Ray runtime's observations go through too), calls the policy object
(`reflow.policy.dual_cycle.AdmissionControl`, `reflow.policy.elastic.ElasticPolicy`,
`reflow.policy.tail.TailPolicy`) and applies its decision through `SimActuator`, the
`reflow.policy.actuator.Actuator` of simulated time, recording the decision as an event in the
schema of the runtime's metrics (`kind`, `what`, `why`, the numbers). No decision logic lives here:
only the translation of units (engines are slots, samples are the work unit) and the application of
the actions with their costs from the cost model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from reflow.policy.actuator import apply_tail, tail_event
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
from reflow.policy.tail import EngineState, InFlightEpisode, TailConfig, TailPolicy
from reflow.policy.tail import observe as observe_tail
from reflow.policy.tail_actions import FreeSlot, Migrate, SetConcurrency
from reflow.sim.config import ModeConfig, Scenario
from reflow.sim.costs import role_change_s

if TYPE_CHECKING:
    from reflow.sim.engine import Simulation
    from reflow.sim.rollout import Engine, Request


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


def elastic_step(sim: Simulation) -> None:
    """At a version boundary: the last interval's counters observed as the runtime observes them
    (`reflow.policy.elastic.observe`), ElasticPolicy asked, its move applied through the actuator."""
    rec, now = sim.rec, sim.now
    busy, alive = rec.rollout_busy(sim, now)
    snap = (
        now,
        busy,
        alive,
        rec.samples_generated,
        rec.trainer_busy_s,
        rec.samples_trained,
        rec.replayed_groups,
        rec.groups_trained,
    )
    last = sim.elastic_snap or (0.0,) * len(snap)
    sim.elastic_snap = snap
    d = [a - b for a, b in zip(snap, last, strict=True)]
    dt, d_busy, d_alive, d_gen, d_train_busy, d_trained, d_replay, d_groups = d
    # the rollout slot-seconds offered are counted (engines came and went): no ordering check on the
    # differences, whose sums over engines may lose an ulp when one retires
    interval = Interval(dt, d_busy, d_gen, d_train_busy, d_trained, rollout_offered_s=d_alive)
    obs = observe(
        interval,
        step=len(rec.steps),
        version=sim.version,
        steps_since_change=len(rec.steps) - sim.elastic_changed_at,
        rollout_slots=sum(e.alive for e in sim.engines),
        train_slots=sim.train_gpus // sim.s.decode.tp,
        batch_size=float(sim.B * sim.s.batch.samples_per_group),
        replay_share=min(0.95, d_replay / d_groups) if d_groups else 0.0,  # the measured share
        fresh_waiting=sim.store.fresh_count(),
        in_flight=sim.store.in_flight(),
        to_rollout_cost=sim.cost_to_rollout,
        to_train_cost=sim.cost_to_train,
    )
    decision = sim.elastic.decide(obs)
    rec.event({"kind": "elastic", "t": now, **decision_event(decision, obs)})
    if not decision.moves:
        return
    sim.elastic_changed_at = len(rec.steps)
    cost = sim.actuator.move_slot(decision)
    if decision.action == "to_train":
        sim.cost_to_train = cost
    else:
        sim.cost_to_rollout = cost


def _evacuate(sim: Simulation, engine) -> None:
    """Resubmit an engine's sequences with their exact token prefix (re-prefilled elsewhere)."""
    engine.advance(sim.now)
    for _, _, req in list(engine.running):
        sim.rec.generated(engine.remove(req))
        sim.n_running -= 1
        sim.prefilling += 1
        sim.push(sim.now + req.ctx * sim.dm.prefill_s_per_token, "ready", req)
    engine.token += 1


# ---- tail scheduler


SGLANG_TAIL = {"migrate": False, "set_concurrency": False}
"""TailConfig settings of what the Ray runtime applies on SGLang engines: over-provisioning and
carry-over only, as SGLang's health reports no token counters, so the runtime has no prefill rate to
price a migration and no (concurrency, tokens/s) curve to set a limit from (reflow.runtime.tail).
On TorchEngine it applies all four actions, and `--from-run` keeps a run's own settings."""


def make_tail(m: ModeConfig) -> TailPolicy:
    return TailPolicy(TailConfig(**m.tail_config))


class TailGateCache:
    """The tail gate's last answer, by what it depends on (fresh groups with spread, groups in flight,
    completed group durations seen), so the policy is asked once per change, as the runtime asks it
    once per wake-up of its loop."""

    def __init__(self) -> None:
        self.key: tuple[int, int, int] | None = None
        self.room = 0


def tail_room(sim: Simulation) -> int:
    """How many more groups the batch being collected may start, as the runtime's tail gate
    (`reflow.runtime.tail.TailGate`) reads TailPolicy: the `start` of its OverProvision (at most
    B + delta groups done or in flight), 0 when it asks for none (B done: carry over). The
    observation is the runtime's: one entry per group in flight, no per-episode progress."""
    cache = sim.tail_gate
    in_flight = sim.store.in_flight_groups()
    done = sim.store.reuse_histogram(spread=True).get(0, 0)  # fresh groups with spread, not trained
    key = (done, len(in_flight), len(sim.rec.group_seconds))
    if key == cache.key:
        return cache.room
    obs = observe_tail(
        sim.B,
        done,
        [InFlightEpisode(gid, gid, "pool", 0, 0, 0.0) for gid in in_flight],
        [EngineState("pool", len(in_flight), max(1, len(in_flight)))],
        group_seconds=sim.rec.group_seconds,
    )
    room = next((a.start for a in sim.tail.decide(obs) if a.kind == "over_provision"), 0)
    cache.key, cache.room = key, room
    return room


def tail_step(sim: Simulation) -> None:
    """Ask TailPolicy about the running batch at the level of sequences and apply its engine-level
    actions through the actuator (consolidation, concurrency limits, as the Ray runtime's
    `reflow.runtime.tail` does; `tail.migrate` / `tail.set_concurrency` switch them off);
    over-provisioning is the gate (`tail_room`)."""
    if not (sim.tail.cfg.migrate or sim.tail.cfg.set_concurrency):
        return
    if sim.store.in_flight() > max(8, sim.B // 4) and sim.rec.steps:
        return  # no tail yet: most of the batch is still running
    now, engines = sim.now, {f"e{e.eid}": e for e in sim.engines if e.alive}
    reqs = {}
    episodes = []
    for eid, e in engines.items():
        e.advance(now)
        for _, rid, req in e.running:
            reqs[str(rid)] = req
            episodes.append(
                InFlightEpisode(
                    str(rid), req.group.gid, eid, req.turn, int(req.ctx + e.S - req.s0), now - req.started_at
                )
            )
    ctx_mean = sum(ep.tokens for ep in episodes) / len(episodes) if episodes else 1000.0
    states = []
    for eid, e in engines.items():
        curve = tuple((c, sim.dm.tokens_per_s(c, c * ctx_mean)) for c in _powers(sim.dm.max_running))
        states.append(EngineState(eid, e.b, e.max_running, curve))
    obs = observe_tail(
        sim.B,
        sim.store.fresh_count(),
        episodes,
        states,
        group_seconds=sim.rec.group_seconds,
        episode_seconds=sim.rec.episode_seconds,
        # 0: no prefill rate known (a `--from-run` engine folds prefill into its measured rate), so no
        # migration is priced, as on a runtime engine whose health reports no prefill counters
        prefill_tokens_per_s=1.0 / sim.dm.prefill_s_per_token if sim.dm.prefill_s_per_token > 0 else 0.0,
        groups_queued=len({r.group.gid for r in sim.queue}),
        next_batch_room=sim.admission_room(),
    )
    sim.actuator.engines, sim.actuator.requests = engines, reqs
    for action in sim.tail.decide(obs):
        outcome = apply_tail(action, sim.actuator)
        sim.rec.event({"kind": "tail", "t": now, "version": sim.version, **tail_event(action, outcome)})
    sim.blocked = False
    sim.dispatch()
    sim.fill()


def _powers(limit: int) -> list[int]:
    out, c = [], 1
    while c < limit:
        out.append(c)
        c *= 2
    return [*out, limit]


class SimActuator:
    """The simulator's `reflow.policy.actuator.Actuator`: the policies' decisions applied to the
    simulation, priced by its cost model. `engines` and `requests` name what the last tail
    observation saw (engine id -> engine, episode id -> its request); `tail_step` sets them."""

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim
        self.engines: dict[str, Engine] = {}
        self.requests: dict[str, Request] = {}

    def move_slot(self, decision: ElasticDecision) -> RoleChangeCost:
        """Towards training the engine with the fewest sequences running leaves (they are resubmitted
        elsewhere with their exact prefix); towards rollout a train slot leaves the trainer. Either
        way the trainer group re-forms, and the slot is back in its new role after the cost model's
        role change."""
        sim, tp = self.sim, self.sim.s.decode.tp
        cost = role_change_s(sim.s.sync)
        if decision.action == "to_train":
            victim = min((e for e in sim.engines if e.alive), key=lambda e: (e.b, -e.eid))
            _evacuate(sim, victim)
            victim.alive = False
            sim.rec.retire(victim, sim.now)
            sim.recount()
            sim.push(sim.now + cost, "role_done", ("train", tp))
        else:
            sim.train_gpus -= tp
            sim.push(sim.now + cost, "role_done", ("engine", tp))
        sim.trainer_blocked += 1  # the trainer group re-forms in either direction
        sim.recount()
        return RoleChangeCost(actor_start_s=cost)

    def migrate(self, action: Migrate) -> dict[str, Any]:
        """The sequence leaves its engine and lands on the target after re-prefilling its prefix."""
        sim = self.sim
        req, src = self.requests[action.episode], self.engines[action.source]
        sim.rec.generated(src.remove(req))
        sim.n_running -= 1
        src.token += 1
        sim.reschedule(src)
        at = sim.now + action.tokens * sim.dm.prefill_s_per_token
        sim.push(at, "migrated", (req, self.engines[action.target]))
        return {"applied": True}

    def free_engine(self, action: FreeSlot) -> dict[str, Any]:
        """Nothing to do: the emptied engine takes the next groups admission allows."""
        return {"applied": True}

    def set_concurrency(self, action: SetConcurrency) -> dict[str, Any]:
        self.engines[action.engine].max_running = action.concurrency
        self.sim.recount()
        return {"applied": True}
