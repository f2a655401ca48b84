"""The discrete-event core of the cluster simulator: rollout engines, the trainer and weight sync on an
event heap, in simulated seconds, driven by the project's own policy objects.

What it owns: time, engines (continuous batching as processor sharing: every running sequence gains
one token per iteration, an iteration costs `DecodeModel.iter_s(b, context)`), requests (one per
sample and turn, with tool calls between turns) and which groups start when. The trainer, the weight
sync and the engines' resume are its mixin `reflow.sim.training.TrainingSide`. What it does not own: which groups may start (`AdmissionControl`), which groups a
step trains (`plan_batch` / `consume`), how much replay (`ReplayShare`), the rollout:train split
(`ElasticPolicy`) and the tail actions (`TailPolicy`): those are the runtime's objects, imported
here and called through reflow/sim/policies.py, so a change to a policy changes the simulation.

The modes are one machine with four settings (reflow/sim/config.py `ModeConfig`): sync is colocated
with eta = 0; one_step_off is eta = 1 with drain-before-sync; async is eta (or verl's fractional
staleness threshold) with or without partial rollout; reflow is async plus the dual replay cycle.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque

from reflow.policy.dual_cycle import AdmissionControl, CycleConfig, ReplayShare
from reflow.replay.planning import accepted_groups, consume, plan_batch
from reflow.sim import policies
from reflow.sim.config import ModeConfig, Scenario
from reflow.sim.costs import LengthSampler, decode_model, load_lengths
from reflow.sim.measured import load_groups
from reflow.sim.metrics import Recorder
from reflow.sim.rollout import Engine, GroupState, Request
from reflow.sim.store import SimStore
from reflow.sim.training import SyncRounds, TrainingSide

__all__ = [
    "AdmissionControl",
    "CycleConfig",
    "ReplayShare",
    "Simulation",
    "consume",
    "plan_batch",
    "simulate",
]


class Simulation(TrainingSide):
    def __init__(self, s: Scenario, mode: ModeConfig | None = None) -> None:
        self.s, self.m = s, mode or s.mode
        m = self.m
        self.colocated = m.mode == "sync"
        self.dm = decode_model(s.gpu, s.model, s.decode, colocated=self.colocated)
        lengths = load_lengths(s.workload.lengths_from) if s.workload.lengths_from else None
        groups = load_groups(s.workload.groups_from) if s.workload.groups_from else None
        self.sampler = LengthSampler(s.workload, s.run.seed, lengths, groups)
        self.B = s.batch.groups
        rollout_gpus = s.gpus if self.colocated else (m.rollout_gpus or s.gpus // 2)
        self.train_gpus = s.gpus if self.colocated else s.gpus - rollout_gpus
        self.engines = [Engine(i, self.dm) for i in range(rollout_gpus // s.decode.tp)]
        self.trigger = m.trigger
        if self.B % self.trigger:
            raise ValueError(f"batch.groups {self.B} is not a multiple of mode.trigger {self.trigger}")
        # The tail policy's carry-over is a partial rollout: unfinished groups continue after the sync.
        self.partial = (m.partial_rollout or m.tail) and m.mode in ("async", "reflow")
        self.recompute = m.recompute_logprob if m.recompute_logprob is not None else m.mode != "async"
        if m.mode == "reflow" and m.recompute_logprob is None:
            self.recompute = False
        self.admission, self.version_scale = policies.admission_for(m, self.B)
        use_rounds = self.colocated and m.resample_rounds is not None
        self.rounds = SyncRounds(self.B, m.resample_rounds or 0) if use_rounds else None
        self.paused_by_sync: list[Engine] = []
        self.cycle = CycleConfig(**m.cycle) if m.mode == "reflow" else CycleConfig(max_reuse=1)
        self.share = ReplayShare(self.cycle)
        self.store = SimStore()
        self.rec = Recorder(len(self.engines))
        self.elastic = policies.make_elastic(s, m) if m.elastic else None
        self.tail = policies.make_tail(m) if m.tail else None
        self.tail_gate = policies.TailGateCache()
        self.actuator = policies.SimActuator(self)  # what applies the policies' decisions
        # what policies.elastic_step measures between its calls, and the role-change costs it has seen
        self.elastic_snap: tuple[float, ...] | None = None
        self.elastic_changed_at = 0
        self.cost_to_rollout = self.cost_to_train = None
        self.events: list[tuple[float, int, str, object, int]] = []
        self.seq = itertools.count()
        self.now = 0.0
        self.version = 0
        self.chunk = 0
        self.queue: deque[Request] = deque()
        self.fresh_trained = 0
        self.trained_at = [0]  # fresh groups trained by the first v steps, per version v
        self.groups = itertools.count()
        self.trainer_busy = False
        self.trainer_blocked = 0  # a sync or group re-form under way
        self.draining = False
        self.syncing = False
        self.wait_since: float | None = 0.0
        self.version_wait = self.version_train = 0.0
        self.phase: dict[str, float] = {}
        """The last version's trainer wait and train seconds (verl's `gen` and update columns)."""
        self.requests_out = 0  # requests on engines, queued or in a tool call
        self.prefilling = 0  # requests in prefill or a tool call, not yet queued
        self.open: list[tuple[int, int, Engine]] = []  # engines by load, lazily updated
        self.blocked = False  # the queue's head fits on no engine now
        self.pressured = False  # engines run a full cache with requests waiting (`update_pressure`)
        self.capacity = self.n_running = 0
        self.recount()

    # ---- the event loop

    def push(self, at: float, kind: str, obj: object = None, token: int = 0) -> None:
        heapq.heappush(self.events, (at, next(self.seq), kind, obj, token))

    def run(self) -> dict:
        self.fill()
        self.try_train()
        while self.version < self.s.run.steps:
            if not self.events:
                raise RuntimeError(f"simulation stalled at t={self.now:.1f} s, version {self.version}")
            at, _, kind, obj, token = heapq.heappop(self.events)
            self.now = at
            getattr(self, f"on_{kind}")(obj, token)
        for e in self.engines:
            e.advance(self.now)
        return self.rec.summary(self, self.now)

    def reschedule(self, e: Engine) -> None:
        e.token += 1
        at = e.next_event()
        if at is not None:
            self.push(at, "engine", e, e.token)

    # ---- rollout

    def admission_room(self) -> int:
        if self.draining or self.syncing:
            return 0
        if self.rounds is not None:  # the sync loop's rounds instead of admission control
            return self.rounds.left()
        cap = self.m.groups_per_engine
        if cap is not None and not self.colocated:
            alive = sum(e.alive for e in self.engines)
            if self.store.in_flight() >= cap * alive:
                return 0
        # As the runtime's driver asks it (reflow/recipes/decoupled.py): at the engines' version, with
        # the fresh groups the first `version` steps trained (fewer than version * B when replay filled).
        accepted = accepted_groups(self.store)
        trained = self.trained_at[self.version]
        room = self.admission.room(
            self.version * self.version_scale, accepted, self.store.in_flight(), trained
        )
        if self.tail is not None and room > 0:  # the runtime's tail gate: at most B + delta a batch
            room = min(room, policies.tail_room(self))
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
        n = self.s.batch.samples_per_group
        while self.free_slots() > 0 and self.admission_room() > 0:
            gid = f"g{next(self.groups)}"
            shapes, zero = self.sampler.draw(n)
            g = GroupState(gid, self.version, n, self.now, zero=zero)
            self.store.begin_group(gid, self.version)
            if self.rounds is not None:
                self.rounds.start()
            for shape in shapes:
                req = Request(g, shape, ctx=shape.prompt, left=shape.turns[0], started_at=self.now)
                g.tokens += shape.prompt + sum(shape.turns) + shape.obs_tokens * (len(shape.turns) - 1)
                g.generated += sum(shape.turns)
                self.requests_out += 1
                self.prefilling += 1
                self.push(self.now + shape.prompt * self.dm.prefill_s_per_token, "ready", req)
        self.dispatch()

    def on_ready(self, req: Request, _token: int) -> None:
        self.prefilling -= 1
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
        while self.queue and not self.syncing:
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
        while self.queue and not self.syncing and e.has_room(self.queue[0]):
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
            self.n_running -= 1
            self.rec.generated(req.left)
            self.finish_turn(req)
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
            self.prefilling += 1
            delay = shape.tool_s[req.turn - 1] + shape.obs_tokens * self.dm.prefill_s_per_token
            self.rec.tool(shape.tool_s[req.turn - 1])
            self.push(self.now + delay, "ready", req)
            return
        self.requests_out -= 1
        self.rec.episode(self.now - req.started_at)
        g = req.group
        g.partial |= len(req.versions) > 1
        g.pending -= 1
        if g.pending == 0:
            self.group_done(g)
        if self.draining and self.requests_out == 0:
            self.start_sync()

    def group_done(self, g: GroupState) -> None:
        zero = g.zero if g.zero is not None else self.sampler.rng.random() < self.s.workload.zero_spread_prob
        meta = {"tokens": g.tokens, "generated": g.generated, "partial": g.partial}
        self.store.add(g.gid, g.version, 0.0 if zero else 1.0, meta)
        self.rec.group(self.now - g.started_at, self.s.batch.samples_per_group)
        if self.rounds is not None:
            self.rounds.done(not zero)
        if self.tail is not None:
            policies.tail_step(self)
        self.try_train()

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

    # ---- role changes (applied by policies.SimActuator.move_slot)

    def on_role_done(self, obj, _token: int) -> None:
        kind, n = obj
        self.trainer_blocked -= 1
        if kind == "engine":
            e = Engine(len(self.engines), self.dm)
            e.t = self.now
            self.engines.append(e)
            self.rec.created(e, self.now)
            self.recount()
        else:
            self.train_gpus += n
        self.dispatch()
        self.fill()
        self.try_train()


def simulate(s: Scenario, mode: ModeConfig | None = None) -> dict:
    """Run one scenario (in `mode`, a ModeConfig, or the scenario's own) and return its summary."""
    return Simulation(s, mode).run()
