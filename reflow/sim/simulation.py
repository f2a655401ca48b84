"""The discrete-event core of the cluster simulator: rollout engines, the trainer and weight sync on an
event heap, in simulated seconds, driven by the project's own policy objects.

What `Simulation` owns: time and the event heap, the rollout side (engines, continuous batching as
processor sharing: every running sequence gains one token per iteration, an iteration costs
`DecodeModel.iter_s(b, context)`; requests, one per sample and turn, with tool calls between turns;
which groups start when), and the store and recorder both sides share. What it holds: the trainer
side, `reflow.sim.training.SimTrainer` (`self.trainer`: train steps, the weight sync, the weights'
version), and the policies' drivers. What it does not own: which groups may start
(`AdmissionControl`), which groups a step trains (`plan_batch` / `consume`), how much replay
(`ReplayShare`), the rollout:train split (`ElasticPolicy`) and the tail actions (`TailPolicy`): those
are the runtime's objects, observed and asked through reflow/sim/policies.py, whose decisions
`SimActuator` applies here, so a change to a policy changes the simulation.

The modes are one machine with four settings (reflow/sim/config.py `ModeConfig`): sync is colocated
with eta = 0; one_step_off is eta = 1 with drain-before-sync; async is eta (or verl's fractional
staleness threshold) with or without partial rollout; reflow is async plus the dual replay cycle.
In sync, `mode.over_sampling_groups` replaces admission control by slime's over-provisioned rounds with
an abort at the target, the aborted groups dropped or carried (APRIL; reflow/sim/oversample.py).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable

from reflow.replay.planning import accepted_groups
from reflow.sim import policies
from reflow.sim.config import ModeConfig, Scenario
from reflow.sim.costs import LengthSampler, decode_model, load_lengths
from reflow.sim.drift import WorkloadDrift
from reflow.sim.engines import Engine, GroupState, Request
from reflow.sim.lending import SimLending
from reflow.sim.measured import load_groups
from reflow.sim.metrics import Recorder
from reflow.sim.oversample import OverProvision
from reflow.sim.store import SimStore
from reflow.sim.training import SimTrainer, SyncRounds


class Simulation:
    """One scenario in one mode: the event loop and the rollout side, holding the trainer side."""

    def __init__(self, s: Scenario, mode: ModeConfig | None = None) -> None:
        self.s, self.m = s, mode or s.mode
        m = self.m
        self.colocated = m.mode == "sync"
        self.dm = decode_model(s.gpu, s.model, s.decode, colocated=self.colocated)
        lengths = load_lengths(s.workload.lengths_from) if s.workload.lengths_from else None
        groups = load_groups(s.workload.groups_from) if s.workload.groups_from else None
        self.sampler = LengthSampler(s.workload, s.run.seed, lengths, groups, WorkloadDrift.of(s))
        self.B = s.batch.groups
        rollout_gpus = s.gpus if self.colocated else (m.rollout_gpus or s.gpus // 2)
        self.engines = [Engine(i, self.dm) for i in range(rollout_gpus // s.decode.tp)]
        self.store = SimStore()
        self.rec = Recorder(len(self.engines))
        use_rounds = self.colocated and m.resample_rounds is not None
        self.rounds = SyncRounds(self.B, m.resample_rounds or 0) if use_rounds else None
        over = m.over_sampling_groups
        self.over = OverProvision(self.B, over) if self.colocated and over is not None else None
        self.trainer = SimTrainer(self, s.gpus if self.colocated else s.gpus - rollout_gpus)
        self.admission, self.version_scale = policies.admission_for(m, self.B)
        self.elastic = policies.ElasticStep(policies.make_elastic(s, m)) if m.elastic else None
        tail = policies.make_tail(m) if m.tail else None
        self.tail = tail
        capped = tail is not None and (m.mode == "sync" or tail.cfg.batch_cap)  # `tail.batch_cap`
        self.tail_gate = policies.SimTailGate(tail, self.B) if capped else None
        self.lending = SimLending.of(self)  # engines lent beside the trainer ranks, or None
        self.actuator = policies.SimActuator(self)  # what applies the policies' decisions
        self.events: list[tuple[float, int, str, object, int]] = []
        self.seq = itertools.count()
        self.now = 0.0
        self.handlers: dict[str, Callable[[object, int], None]] = {
            "ready": self.on_ready,
            "engine": self.on_engine,
            "migrated": self.on_migrated,
            "role_done": self.on_role_done,
            "resumed": self.on_resumed,
            "trained": self.trainer.on_trained,
            "synced": self.trainer.on_synced,
        }
        if self.lending is not None:
            self.handlers["lend"] = self.lending.on_lend
            self.handlers["handed"] = self.lending.on_handed
        self.queue: deque[Request] = deque()
        self.groups = itertools.count()
        self.requests_out = 0  # requests on engines, queued or in a tool call
        self.prefilling = 0  # requests in prefill or a tool call, not yet queued
        self.open: list[tuple[int, int, Engine]] = []  # engines by load, lazily updated
        self.blocked = False  # the queue's head fits on no engine now
        self.pressured = False  # engines run a full cache with requests waiting (`update_pressure`)
        self.capacity = self.n_running = 0
        self.recount()

    @property
    def version(self) -> int:
        """The weights' version: the trainer's, which the engines hold since the last sync."""
        return self.trainer.version

    # ---- the event loop

    def push(self, at: float, kind: str, obj: object = None, token: int = 0) -> None:
        heapq.heappush(self.events, (at, next(self.seq), kind, obj, token))

    def run(self) -> dict:
        self.fill()
        self.trainer.try_train()
        while self.version < self.s.run.steps:
            if not self.events:
                raise RuntimeError(f"simulation stalled at t={self.now:.1f} s, version {self.version}")
            at, _, kind, obj, token = heapq.heappop(self.events)
            self.now = at
            self.handlers[kind](obj, token)
        for e in self.engines:
            e.advance(self.now)
        out = self.rec.summary(self.s, self.m.mode, self.store, self.now)
        if self.lending is not None:
            out.update(self.lending.summary(self.rec.steps, self.s.run.warmup_steps))
        if self.over is not None:
            out.update(self.over.summary(self.rec.steps, self.s.run.warmup_steps))
        return out

    def reschedule(self, e: Engine) -> None:
        e.token += 1
        at = e.next_event()
        if at is not None:
            self.push(at, "engine", e, e.token)

    # ---- rollout

    def admission_room(self, lent: bool = False) -> int:
        """Groups that may start now: on the rollout engines, or (`lent`) on lent engines, which have
        their own group limit and are not under the tail gate."""
        if self.trainer.draining or self.trainer.syncing:
            return 0
        if self.rounds is not None:  # the sync loop's rounds instead of admission control
            return self.rounds.left()
        if self.over is not None:  # slime's over-provisioned rounds (reflow/sim/oversample.py)
            return self.over.left()
        cap = self.m.groups_per_engine
        on_lent = len(self.lending.groups) if self.lending is not None else 0
        if cap is not None and not self.colocated and not lent:
            alive = sum(e.alive for e in self.engines)
            # episodes a lent engine handed over count in their rollout engine's load, as groups
            served = self.lending.episodes_away() / self.s.batch.samples_per_group if on_lent else 0.0
            if self.store.in_flight() - on_lent + served >= cap * alive:
                return 0
        # As the runtime's driver asks it (reflow/recipes/decoupled.py): at the engines' version, with
        # the fresh groups the first `version` steps trained (fewer than version * B when replay filled).
        accepted = accepted_groups(self.store)
        trained = self.trainer.trained_at[self.version]
        room = self.admission.room(
            self.version * self.version_scale, accepted, self.store.in_flight(), trained
        )
        if self.tail_gate is not None and room > 0 and not lent:  # at most B + delta a batch
            done = self.store.reuse_histogram(spread=True).get(0, 0)  # fresh groups with spread, not trained
            running = self.store.in_flight_groups()
            if on_lent:  # the gate sees the rollout engines' groups, as the runtime's does
                running = {g: v for g, v in running.items() if g not in self.lending.groups}
            room = min(room, self.tail_gate(done, running, self.rec.group_seconds))
        return room

    def recount(self) -> None:
        """After engines joined, left or changed their concurrency limit."""
        self.blocked = False
        self.capacity = sum(e.max_running for e in self.engines if e.alive)
        self.n_running = sum(e.b for e in self.engines if e.alive)
        for e in self.engines:
            self.offer(e)

    def free_slots(self) -> int:
        """Sequences the engines could still take, less those already waiting or in prefill."""
        return self.capacity - self.n_running - len(self.queue) - self.prefilling

    def fill(self) -> None:
        """Start groups while admission control has room and the engines could take more work."""
        while self.free_slots() > 0 and self.admission_room() > 0:
            if self.over is not None and self.over.carried:
                self.resume_group(self.over.carried.popleft())  # carried groups first
            else:
                self.start_group()
        self.dispatch()
        if self.lending is not None:  # and on lent engines, if the trainer waits
            self.lending.poke()

    def start_group(self, lent: Engine | None = None) -> GroupState:
        """One group starts: on the rollout engines, or on the `lent` engine for all its turns."""
        n = self.s.batch.samples_per_group
        gid = f"g{next(self.groups)}"
        shapes, zero = self.sampler.draw(n, self.version)  # the workload as of the start version
        self.rec.started(shapes, self.version)
        g = GroupState(
            gid, self.version, n, self.now, zero=zero, lent=lent, episodes=[] if lent is not None else None
        )
        self.store.begin_group(gid, self.version)
        if self.rounds is not None:
            self.rounds.start()
        if self.over is not None:
            self.over.start(g)
        for shape in shapes:
            req = Request(g, shape, ctx=shape.prompt, left=shape.turns[0], started_at=self.now)
            if g.episodes is not None:
                g.episodes.append(req)
            g.tokens += shape.prompt + sum(shape.turns) + shape.obs_tokens * (len(shape.turns) - 1)
            g.generated += sum(shape.turns)
            self.requests_out += 1
            self.prefilling += lent is None  # the rollout engines' count (`free_slots`)
            self.push(self.now + shape.prompt * self.dm.prefill_s_per_token, "ready", req)
        return g

    def on_ready(self, req: Request, _token: int) -> None:
        if req.lent_engine is not None:
            self.lending.ready(req)
            return
        self.prefilling -= 1
        if req.group.held is not None:  # aborted while in prefill or a tool call: held with its group
            req.segment = 0.0
            self.requests_out -= 1
            req.group.held.append(req)
            return
        # Later turns and resubmitted prefixes go first: their groups are the furthest along.
        if req.turn or req.resumed or not self.queue:
            self.queue.appendleft(req)
            self.blocked = False
        else:
            self.queue.append(req)
        self.dispatch()
        self.fill()

    def offer(self, e: Engine) -> None:
        """(Re)list an engine as open for admission; stale listings are skipped in `dispatch`."""
        if e.alive and e.b < e.max_running:
            heapq.heappush(self.open, (e.b, e.eid, e))

    def dispatch(self) -> None:
        """Admit queued requests, least-loaded engine first (as a load-balancing router does)."""
        if self.blocked:
            return
        touched = set()
        while self.queue and not self.trainer.syncing:
            req, chosen, skipped = self.queue[0], None, []
            while self.open:
                entry = heapq.heappop(self.open)
                b, _, e = entry
                if not e.alive or b != e.b or b >= e.max_running:
                    continue  # stale listing
                if e.has_room(req):
                    chosen = e
                    break
                skipped.append(entry)  # its KV is full for now
            for entry in skipped:
                heapq.heappush(self.open, entry)
            if chosen is None:
                self.blocked = True  # until an engine frees room or another request heads the queue
                break
            self.queue.popleft()
            chosen.advance(self.now)
            req.versions.add(self.version)
            chosen.admit(req, next(self.seq))
            self.n_running += 1
            self.offer(chosen)
            touched.add(chosen)
        for e in touched:
            self.reschedule(e)
        self.update_pressure()

    def update_pressure(self) -> None:
        """While requests wait because no engine's cache holds the next one, the engines with sequence
        slots free run a full cache, as vLLM does by preempting and recomputing sequences: they pay
        `decode.kv_pressure_slowdown` on their per-sequence term until the queue's head fits again."""
        on = self.blocked and bool(self.queue) and self.dm.kv_pressure != 1.0
        if on == self.pressured:
            return
        self.pressured = on
        for e in self.engines:
            factor = self.dm.kv_pressure if on and e.alive and e.b < e.max_running else 1.0
            if factor != e.pressure:
                e.advance(self.now)
                e.pressure = factor
                self.reschedule(e)

    def admit_into(self, e: Engine) -> None:
        while self.queue and not self.trainer.syncing and e.has_room(self.queue[0]):
            req = self.queue.popleft()
            req.versions.add(self.version)
            e.admit(req, next(self.seq))
            self.n_running += 1
        self.offer(e)
        if not self.queue:
            self.blocked = False
        self.update_pressure()

    def on_engine(self, e: Engine, token: int) -> None:
        if token != e.token:
            return
        e.advance(self.now)
        while e.running and e.running[0][0] <= e.S + 1e-6:
            _, _, req = heapq.heappop(e.running)
            e.base -= req.ctx - req.s0
            e.reserved -= req.ctx + req.left
            req.engine = None
            self.n_running -= not e.lent  # the rollout engines' count
            self.rec.generated(req.left)
            self.finish_turn(req)
        if e.lent:
            self.lending.admit(e)
        else:
            self.offer(e)
            if self.blocked:  # only this engine has more room than when the queue's head last fit nowhere
                self.admit_into(e)
            else:
                self.dispatch()
            self.reschedule(e)
        self.fill()

    def finish_turn(self, req: Request) -> None:
        shape = req.shape
        if req.turn + 1 < len(shape.turns):  # a tool call, then the next turn (prefill of its output)
            req.ctx += req.left + shape.obs_tokens
            req.turn += 1
            req.left = shape.turns[req.turn]
            self.prefilling += req.lent_engine is None
            delay = shape.tool_s[req.turn - 1] + shape.obs_tokens * self.dm.prefill_s_per_token
            self.rec.tool(shape.tool_s[req.turn - 1])
            self.push(self.now + delay, "ready", req)
            return
        self.requests_out -= 1
        self.rec.episode(self.now - req.started_at)
        g = req.group
        g.partial |= len(req.versions) > 1
        g.pending -= 1
        if g.episodes is not None:
            g.episodes.remove(req)
        if g.pending == 0:
            self.group_done(g)
        if self.trainer.draining and self.requests_out == 0:
            self.trainer.start_sync()

    def group_done(self, g: GroupState) -> None:
        zero = g.zero if g.zero is not None else self.sampler.rng.random() < self.s.workload.zero_spread_prob
        meta = {"tokens": g.tokens, "generated": g.generated, "partial": g.partial}
        self.store.add(g.gid, g.version, 0.0 if zero else 1.0, meta)
        self.rec.group(self.now - g.started_at, self.s.batch.samples_per_group)
        if g.lent is not None:
            self.lending.stored(g)
        if self.rounds is not None:
            self.rounds.done(not zero)
        if self.over is not None:
            self.over.done(g, not zero)
        if self.tail is not None:
            self.tail_step()
        self.trainer.try_train()

    def on_migrated(self, obj, _token: int) -> None:
        """A consolidated sequence lands on its target engine after re-prefilling its prefix."""
        req, target = obj
        if target.has_room(req):
            target.advance(self.now)
            target.admit(req, next(self.seq))
            self.n_running += 1
            self.reschedule(target)
        else:
            self.queue.appendleft(req)
            self.blocked = False
            self.dispatch()

    # ---- slime's over-provisioned rounds (reflow/sim/oversample.py): the abort and the resumption

    def abort_round(self) -> None:
        """The round's target is met (a step starts): every request still on an engine, queued, in
        prefill or in a tool call stops, its progress kept in the request. With `mode.abort_carry` the
        unfinished groups start first in the next round; else they are dropped."""
        groups = self.over.close()
        for g in groups:
            g.held = []
        for e in self.engines:
            if not e.running:
                continue
            e.advance(self.now)
            for _, _, req in list(e.running):
                req.segment = e.remove(req)
                self.rec.generated(req.segment)
                self.n_running -= 1
                self.requests_out -= 1
                req.group.held.append(req)
            e.token += 1
            self.offer(e)
        while self.queue:
            req = self.queue.popleft()
            req.segment = 0.0  # nothing generated since it was last (re)submitted
            self.requests_out -= 1
            req.group.held.append(req)
        self.blocked = False
        self.update_pressure()
        for g in groups:  # requests in prefill or a tool call join their group in `on_ready`
            if self.m.abort_carry:
                self.over.carried.append(g)
            else:
                self.store.end_group(g.gid)

    def resume_group(self, g: GroupState) -> None:
        """A carried group starts again: its unfinished requests are resubmitted with their partial
        responses (re-prefilled: the new weights invalidate the prefix cache), ahead of new work."""
        self.over.start(g)
        held, g.held = g.held or [], None
        for req in held:
            if req.ctx > req.shape.prompt:  # a partial response (slime: `sample.response` not empty)
                self.over.resumed(self.version, req.segment)
            req.resumed = True
            self.requests_out += 1
            self.prefilling += 1
            self.push(self.now + req.ctx * self.dm.prefill_s_per_token, "ready", req)

    # ---- the sync (the trainer's), as the engines see it

    def pause_engines(self) -> list[Engine]:
        """Every engine stops at the sync; the trainer wakes them (`wake`) once the weights are in."""
        paused = list(self.engines) + (self.lending.engines if self.lending is not None else [])
        for e in paused:
            e.advance(self.now)
            e.paused += 1
            e.token += 1
        return paused

    def wake(self, e: Engine, pause: float, counted: bool) -> None:
        """After a sync: the engine's running requests continue with the new weights (partial rollout),
        after `pause` seconds (`counted`: a resume pause the runs report)."""
        for _, _, req in e.running:
            req.versions.add(self.version)
        if pause > 0:
            if counted:
                self.rec.resume(pause)
            self.push(self.now + pause, "resumed", e)
        else:
            self.on_resumed(e, 0)

    def on_resumed(self, e: Engine, _token: int) -> None:
        e.t = self.now
        e.paused -= 1
        self.reschedule(e)
        self.dispatch()
        self.fill()

    # ---- the policies at a version boundary and in the tail

    def at_version_boundary(self) -> None:
        """A sync is done: the step's record, then the elastic and tail policies asked."""
        tr = self.trainer
        tp = self.s.decode.tp
        self.rec.version(self.now, self.version, self.engines, tp, tr.train_gpus, tr.share.share, tr.phase)
        if self.lending is not None:
            self.lending.mark()
        if self.elastic is not None:
            self.elastic_step()
        if self.tail is not None:
            self.tail_step()

    def elastic_step(self) -> None:
        counters, slots = policies.elastic_inputs(self)
        self.rec.event(self.elastic.at_boundary(counters, slots, self.actuator))

    def tail_step(self) -> None:
        """The tail policy's engine-level actions on the running batch (none until its tail)."""
        if not policies.acts_on_engines(self.tail):
            return
        if self.store.in_flight() > max(8, self.B // 4) and self.rec.steps:
            return  # no tail yet: most of the batch is still running
        engines = {f"e{e.eid}": e for e in self.engines if e.alive}
        for e in engines.values():
            e.advance(self.now)
        obs, requests = policies.observe_engines(
            self.now,
            engines,
            self.dm,
            self.B,
            self.store.fresh_count(),
            self.rec.group_seconds,
            self.rec.episode_seconds,
            groups_queued=len({r.group.gid for r in self.queue}),
            next_batch_room=self.admission_room(),
        )
        self.actuator.saw(engines, requests)
        for event in policies.tail_step(self.tail, obs, self.actuator):
            self.rec.event({"kind": "tail", "t": self.now, "version": self.version, **event})
        self.blocked = False
        self.dispatch()
        self.fill()

    # ---- what the actuator applies: work taken off engines, role changes

    def evacuate(self, engine: Engine) -> None:
        """Resubmit an engine's sequences with their exact token prefix (re-prefilled elsewhere)."""
        engine.advance(self.now)
        for _, _, req in list(engine.running):
            self.rec.generated(engine.remove(req))
            self.n_running -= 1
            self.prefilling += 1
            self.push(self.now + req.ctx * self.dm.prefill_s_per_token, "ready", req)
        engine.token += 1

    def retire(self, engine: Engine) -> None:
        """The engine leaves the rollout side (its slot goes to the trainer)."""
        engine.alive = False
        self.rec.retire(engine, self.now)
        self.recount()

    def take_off(self, req: Request, engine: Engine) -> None:
        """One sequence leaves its engine mid-turn (a migration), its progress kept in `req`."""
        self.rec.generated(engine.remove(req))
        self.n_running -= 1
        engine.token += 1
        self.reschedule(engine)

    def on_role_done(self, obj, _token: int) -> None:
        kind, n = obj
        if kind == "engine":
            self.trainer.reformed(0)
            e = Engine(len(self.engines), self.dm)
            e.t = self.now
            self.engines.append(e)
            self.rec.created(e, self.now)
            self.recount()
        else:
            self.trainer.reformed(n)
        self.dispatch()
        self.fill()
        self.trainer.try_train()


def simulate(s: Scenario, mode: ModeConfig | None = None) -> dict:
    """Run one scenario (in `mode`, a ModeConfig, or the scenario's own) and return its summary."""
    return Simulation(s, mode).run()
