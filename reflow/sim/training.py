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

`TrainingSide` is a mixin of `reflow.sim.engine.Simulation`: it reads and writes the same state.
"""

from __future__ import annotations

from reflow.policy.task_selection import round_size
from reflow.replay.planning import consume, plan_batch
from reflow.sim import policies
from reflow.sim.costs import sync_s, train_s
from reflow.sim.rollout import Engine


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


class TrainingSide:
    """Train steps, syncs and resumes of a `Simulation` (see the module docstring)."""

    def try_train(self) -> None:
        if self.trainer_busy or self.trainer_blocked or self.draining or self.syncing:
            return
        want = self.B // self.trigger
        if self.rounds is not None:
            size = self.rounds.train_size()
            if size is None:
                return
            if size == 0:  # no group with spread in any round: no step, collect again
                self.rec.no_signal()
                self.rounds.reset()
                self.fill()
                return
            want = size
        plan = plan_batch(
            self.store,
            want=want,
            current_version=self.version,
            share=self.share.share,
            cfg=self.cycle,
            allow_replay=self.m.mode == "reflow",
        )
        if plan.size < want:
            return
        step = self.version * self.trigger + self.chunk
        consume(self.store, plan, step)
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
        if self.wait_since is not None:
            self.version_wait += self.now - self.wait_since
            self.wait_since = None
        self.rec.trained(plan, self.version, self.s.batch.samples_per_group)
        self.trainer_busy = True
        self.version_train += dt
        self.rec.trainer_busy(dt)
        self.push(self.now + dt, "trained", plan)
        self.fill()

    def on_trained(self, plan, _token: int) -> None:
        self.trainer_busy = False
        self.wait_since = self.now
        stale = plan.staleness(self.version)
        kl = self.m.kl_per_version * (sum(stale) / len(stale) if stale else 0.0)
        self.share.update(self.version, trainer_wait_s=self.version_wait, masked_frac=0.0, kl=kl)
        self.chunk += 1
        if self.chunk < self.trigger:
            self.try_train()
            return
        self.chunk = 0
        if self.partial or self.colocated or self.requests_out == 0:
            self.start_sync()
        else:
            self.draining = True  # no new work; the sync starts when the last request ends

    def start_sync(self) -> None:
        if self.wait_since is not None:  # a drain before the sync: the trainer waits for the last requests
            self.version_wait += self.now - self.wait_since  # (verl one-step-off's wait_prev_gen)
            self.wait_since = None
        self.phase = {"wait_s": self.version_wait, "train_s": self.version_train}
        self.version_wait = self.version_train = 0.0
        self.draining, self.syncing = False, True
        dt = sync_s(self.s.model, self.s.sync, self.colocated)
        self.paused_by_sync = list(self.engines)
        for e in self.paused_by_sync:
            e.advance(self.now)
            e.paused += 1
            e.token += 1
        self.rec.sync(dt)  # the trainer waits for it, but it is not training (as the runs count it)
        self.push(self.now + dt, "synced")

    def on_synced(self, _obj, _token: int) -> None:
        self.syncing = False
        self.version += 1
        self.trained_at.append(self.fresh_trained)
        for e in self.paused_by_sync:
            pause = self.resume_pause(e) if self.partial else 0.0
            if self.colocated:
                pause = self.s.sync.colocated_wake_s
            for _, _, req in e.running:  # partial rollout: these continue with the new weights
                req.versions.add(self.version)
            if pause > 0:  # the engine wakes up after the trainer has moved on
                if not self.colocated:
                    self.rec.resume(pause)
                self.push(self.now + pause, "resumed", e)
            else:
                self.on_resumed(e, 0)
        if self.rounds is not None:
            self.store.discard_fresh()  # spares of a finished sync step are never trained
            self.rounds.reset()
        self.store.prune(self.version - self.cycle.tau_max, self.cycle.max_reuse)
        self.rec.version(self)
        if self.elastic is not None:
            policies.elastic_step(self)
        if self.tail is not None:
            policies.tail_step(self)
        self.wait_since = self.now
        self.dispatch()
        self.fill()
        self.try_train()

    def resume_pause(self, e: Engine) -> float:
        """Seconds an engine stays paused after a partial-rollout sync: nothing without interrupted
        requests; else the fixed wake-up (`sync.resume_s`) and the re-prefill of their contexts."""
        if not e.alive or not e.running:
            return 0.0
        return self.s.sync.resume_s + e.context() * self.dm.prefill_s_per_token

    def on_resumed(self, e: Engine, _token: int) -> None:
        e.t = self.now
        e.paused -= 1
        self.reschedule(e)
        self.dispatch()
        self.fill()
