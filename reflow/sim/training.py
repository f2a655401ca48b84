"""The trainer side of the simulation: train steps, weight syncs and the engines' resume after a sync,
and the sync loop's collection rounds.

What it owns: when a step starts (a batch plan of `trigger` mini-batches per sync period, asked of the
runtime's `plan_batch` / `consume`, replay share from `ReplayShare`), what it costs (`train_s`), the
sync (partial rollout pauses the engines; without it they drain first), and the rollout side's pause
after a partial-rollout sync: an engine that had requests interrupted pays `sync.resume_s` plus the
re-prefill of their contexts (prefix caches do not survive new weights), one that had none pays
nothing; colocated engines wake up after every sync (`sync.colocated_wake_s`). `SyncRounds` is the
runtime's sync-loop collection (reflow/recipes `collect_groups`): a round of B groups, then rounds for
those that came back without reward spread.

`SimTrainer` is a component the `reflow.sim.simulation.Simulation` holds (`sim.trainer`): it owns the
trainer's state (the weights' version, the step under way, the sync) and calls the simulation's
methods for what the rollout side owns (pausing and waking engines, starting groups).
"""

from __future__ import annotations

from typing import Any, Protocol

from reflow.policy.dual_cycle import CycleConfig, ReplayShare
from reflow.policy.task_selection import round_size
from reflow.replay.planning import consume, plan_batch
from reflow.sim.config import ModeConfig, Scenario
from reflow.sim.costs import DecodeModel, sync_s, train_s
from reflow.sim.engines import Engine
from reflow.sim.lending import SimLending
from reflow.sim.metrics import Recorder
from reflow.sim.oversample import OverProvision
from reflow.sim.store import SimStore


class SyncRounds:
    """One sync step's collection in rounds: start `left()` groups, report each as it ends, and train
    when `train_size()` says how many (0: no group had spread; the step is not taken)."""

    def __init__(self, want: int, extra_rounds: int) -> None:
        self.want, self.extra = want, extra_rounds
        self.reset()

    def reset(self) -> None:
        self.round, self.quota, self.started, self.running = 0, self.want, 0, 0
        self.spread = self.generated = 0

    def left(self) -> int:
        return max(0, self.quota - self.started)

    def start(self) -> None:
        self.started += 1
        self.running += 1

    def done(self, has_spread: bool) -> None:
        self.running -= 1
        self.generated += 1
        self.spread += has_spread
        if self.running == 0 and self.left() == 0 and self.train_size() is None:
            self.round += 1  # the round is over and short of groups with spread: another round
            self.quota += round_size(self.want, self.want - self.spread, self.spread, self.generated)

    def train_size(self) -> int | None:
        """How many groups the step trains on once its rounds are over; None while collecting."""
        if self.running or self.left():
            return None
        if self.spread >= self.want or self.round >= self.extra:
            return min(self.want, self.spread)
        return None


class RolloutSide(Protocol):
    """What the trainer uses of the simulation that holds it (`reflow.sim.simulation.Simulation`): the
    clock and its events, the shared store and recorder, and the rollout side's few entry points."""

    s: Scenario
    m: ModeConfig
    dm: DecodeModel
    colocated: bool
    rounds: SyncRounds | None
    over: OverProvision | None
    lending: SimLending | None
    store: SimStore
    rec: Recorder
    now: float
    requests_out: int

    def push(self, at: float, kind: str, obj: Any = None, token: int = 0) -> None: ...
    def fill(self) -> None: ...
    def dispatch(self) -> None: ...
    def pause_engines(self) -> list[Engine]: ...
    def wake(self, e: Engine, pause: float, counted: bool) -> None: ...
    def at_version_boundary(self) -> None: ...
    def abort_round(self) -> None: ...


class SimTrainer:
    """The trainer side of a `Simulation` (see the module docstring): it owns the step, the sync and
    the weights' version; the simulation it belongs to owns the clock, the engines, the store and the
    recorder, and this class reaches them only through the simulation's methods and those objects."""

    def __init__(self, sim: RolloutSide, train_gpus: int) -> None:
        s, m = sim.s, sim.m
        self.sim, self.s, self.m = sim, s, m
        self.colocated = sim.colocated
        self.train_gpus = train_gpus
        self.B, self.trigger = s.batch.groups, m.trigger
        if self.B % self.trigger:
            raise ValueError(f"batch.groups {self.B} is not a multiple of mode.trigger {self.trigger}")
        # The tail policy's carry-over is a partial rollout: unfinished groups continue after the sync.
        self.partial = (m.partial_rollout or m.tail) and m.mode in ("async", "reflow")
        self.recompute = m.recompute_logprob if m.recompute_logprob is not None else m.mode != "async"
        if m.mode == "reflow" and m.recompute_logprob is None:
            self.recompute = False
        self.cycle = CycleConfig(**m.cycle) if m.mode == "reflow" else CycleConfig(max_reuse=1)
        self.share = ReplayShare(self.cycle)
        self.version = 0
        self.chunk = 0  # mini-batches trained in this sync period
        self.fresh_trained = 0
        self.trained_at = [0]  # fresh groups trained by the first v steps, per version v
        self.busy = False
        self.blocked = 0  # a sync or group re-form under way
        self.draining = False
        self.syncing = False
        self.paused_by_sync: list[Engine] = []
        self.wait_since: float | None = 0.0
        self.version_wait = self.version_train = 0.0
        self.phase: dict[str, float] = {}
        """The last version's trainer wait and train seconds (verl's `gen` and update columns)."""

    def reform(self, leaving_gpus: int) -> None:
        """A role change begins: the trainer group re-forms (no step until `reformed`); `leaving_gpus`
        leave it now (a slot moving to rollout)."""
        self.train_gpus -= leaving_gpus
        self.blocked += 1

    def reformed(self, joining_gpus: int) -> None:
        """The role change is done; `joining_gpus` joined (a slot moving to training)."""
        self.blocked -= 1
        self.train_gpus += joining_gpus

    def try_train(self) -> None:
        sim = self.sim
        if self.busy or self.blocked or self.draining or self.syncing:
            return
        want = self.B // self.trigger
        if sim.rounds is not None:
            size = sim.rounds.train_size()
            if size is None:
                return
            if size == 0:  # no group with spread in any round: no step, collect again
                sim.rec.no_signal()
                sim.rounds.reset()
                sim.fill()
                return
            want = size
        plan = plan_batch(
            sim.store,
            want=want,
            current_version=self.version,
            share=self.share.share,
            cfg=self.cycle,
            allow_replay=self.m.mode == "reflow",
        )
        if plan.size < want:
            return
        step = self.version * self.trigger + self.chunk
        if sim.lending is not None:  # the runtime's loop launches groups before it starts a step, and
            sim.fill()  # its lent engines hand episodes over to the room left (`SimLending.hand_over`)
        consume(sim.store, plan, step)
        if sim.over is not None:  # slime: the target is met, whatever still runs is aborted
            sim.abort_round()
        self.fresh_trained += len(plan.fresh)
        tokens = sum(g.meta["tokens"] for g in plan.groups)
        dt = train_s(
            tokens,
            self.train_gpus,
            self.s.gpu,
            self.s.model,
            self.s.train,
            self.recompute,
            colocated=self.colocated,
            fixed_share=1 / self.trigger,
        )
        if sim.lending is not None:  # lent engines yield (or run on past eta) beside a slower trainer
            # the window counts a step's sampled tokens, as the runtime's does
            sampled = sum(g.meta["generated"] for g in plan.groups)
            dt = sim.lending.step_starts(
                self.version, dt, sampled, plan.size * self.s.batch.samples_per_group
            )
        if self.wait_since is not None:
            self.version_wait += sim.now - self.wait_since
            self.wait_since = None
        sim.rec.trained(plan, self.version, self.s.batch.samples_per_group)
        self.busy = True
        self.version_train += dt
        sim.rec.trainer_busy(dt)
        sim.push(sim.now + dt, "trained", plan)
        sim.fill()

    def on_trained(self, plan, _token: int) -> None:
        self.busy = False
        self.wait_since = self.sim.now
        stale = plan.staleness(self.version)
        kl = self.m.kl_per_version * (sum(stale) / len(stale) if stale else 0.0)
        self.share.update(self.version, trainer_wait_s=self.version_wait, masked_frac=0.0, kl=kl)
        self.chunk += 1
        if self.chunk < self.trigger:
            self.try_train()
            return
        self.chunk = 0
        if self.partial or self.colocated or self.sim.requests_out == 0:
            self.start_sync()
        else:
            self.draining = True  # no new work; the sync starts when the last request ends

    def start_sync(self) -> None:
        sim = self.sim
        if self.wait_since is not None:  # a drain before the sync: the trainer waits for the last requests
            self.version_wait += sim.now - self.wait_since  # (verl one-step-off's wait_prev_gen)
            self.wait_since = None
        self.phase = {"wait_s": self.version_wait, "train_s": self.version_train}
        self.version_wait = self.version_train = 0.0
        self.draining, self.syncing = False, True
        dt = sync_s(self.s.model, self.s.sync, self.colocated)
        self.paused_by_sync = sim.pause_engines()
        sim.rec.sync(dt)  # the trainer waits for it, but it is not training (as the runs count it)
        sim.push(sim.now + dt, "synced")

    def on_synced(self, _obj, _token: int) -> None:
        sim = self.sim
        self.syncing = False
        self.version += 1
        self.trained_at.append(self.fresh_trained)
        for e in self.paused_by_sync:
            pause = self.resume_pause(e) if self.partial else 0.0
            if self.colocated:
                pause = self.s.sync.colocated_wake_s
            # partial rollout: its running requests continue with the new weights; the engine wakes
            # up after the trainer has moved on (a colocated wake-up is not a resume pause)
            sim.wake(e, pause, counted=not self.colocated)
        if sim.rounds is not None:
            sim.store.discard_fresh()  # spares of a finished sync step are never trained
            sim.rounds.reset()
        if sim.over is not None:
            sim.store.discard_fresh()  # slime keeps no finished group beyond the step's B
            sim.over.reset()
        sim.store.prune(self.version - self.cycle.tau_max, self.cycle.max_reuse)
        sim.at_version_boundary()
        self.wait_since = sim.now
        sim.dispatch()
        sim.fill()
        self.try_train()

    def resume_pause(self, e: Engine) -> float:
        """Seconds an engine stays paused after a partial-rollout sync: nothing without interrupted
        requests; else the fixed wake-up (`sync.resume_s`) and the re-prefill of their contexts."""
        if not e.alive or not e.running:
            return 0.0
        return self.s.sync.resume_s + e.context() * self.sim.dm.prefill_s_per_token
