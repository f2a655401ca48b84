"""The `async` and `reflow` modes: rollout workers and trainer ranks run at the same time.

- async: rollouts run ahead of the trainer by at most `replay.eta` policy versions (admission control:
  a group may start while accepted + in-flight groups < (eta + v + 1) * B); each group is trained on
  once; new weights reach the engines without stopping the trainer, and episodes in flight across an
  update keep per-token versions (the loss uses their behaviour log-probs).
- reflow: the same, plus the dual replay cycle: when fresh groups are short, recent groups (age <=
  tau_max, reuse < K) fill the batch up to the adaptive replay share, so the trainer does not idle; the
  share rises while the trainer waits and falls when importance weights degrade.

One driver loop: top up rollouts to what admission allows, start a train step when a batch can be
planned, then wait for whichever finishes first.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from typing import Any

import ray

from reflow.config import RunConfig
from reflow.recipes.run_log import RunLog
from reflow.recipes.train_parts import (
    Clock,
    RunState,
    checkpoint,
    evaluate,
    next_seeds,
    out_of_time,
    push_weights,
    step_record,
)
from reflow.replay.cycle import AdmissionControl, ReplayShare
from reflow.sched.pool import ResourcePool
from reflow.sched.replay_service import cycle_config
from reflow.sched.workers import GroupReport


class BusyClock:
    """Busy time of each rollout worker: from its first group in flight to its last one done."""

    def __init__(self, n: int) -> None:
        self.in_flight, self.since, self.busy = [0] * n, [0.0] * n, 0.0

    def start(self, worker: int) -> None:
        if self.in_flight[worker] == 0:
            self.since[worker] = time.monotonic()
        self.in_flight[worker] += 1

    def done(self, worker: int) -> None:
        self.in_flight[worker] -= 1
        if self.in_flight[worker] == 0:
            self.busy += time.monotonic() - self.since[worker]

    def total(self) -> float:
        now = time.monotonic()
        return self.busy + sum(now - s for s, n in zip(self.since, self.in_flight, strict=True) if n)


def decoupled_loop(pool: ResourcePool, config: RunConfig, log: RunLog, state: RunState, clock: Clock) -> None:
    B, reflow = config.rollout.groups_per_step, config.mode == "reflow"
    admission = AdmissionControl(config.replay.eta, B)
    share = ReplayShare(cycle_config(config)) if reflow else None
    per_worker = max(1, config.rollout.max_batch_size // config.rollout.group_size)
    rollouts: dict[Any, int] = {}  # object ref -> worker index
    workers = BusyClock(len(pool.rollout))
    busy_before = state.rollout_busy_s
    accepted = ray.get(pool.replay.accepted.remote())
    train: dict[str, Any] | None = None
    reports: list[GroupReport] = []
    waiting_since = time.monotonic()
    while state.step < config.train.steps and not out_of_time(config, state):
        while (w := _free_worker(workers, per_worker)) is not None and admission.may_start(
            state.version, accepted, len(rollouts)
        ):
            rollouts[_launch(pool, w, state)] = w
            workers.start(w)
        if train is None:
            train = _start_train(pool, config, state, share)
            if train is not None:
                train["wait_s"] = time.monotonic() - waiting_since
        if not rollouts and train is None:
            # Nothing running and no batch to plan: only after a resume whose store is ahead of the
            # restored checkpoint (groups consumed after it). Generate past the bound rather than stall.
            rollouts[_launch(pool, 0, state)] = 0
            workers.start(0)
        pending = [*rollouts, *([train["ref"]] if train else [])]
        ready, _ = ray.wait(pending, num_returns=1)
        for ref in ready:
            if train is not None and ref == train["ref"]:
                _finish_train(pool, config, log, state, clock, train, reports, share)
                reports, train, waiting_since = [], None, time.monotonic()
            else:
                worker = rollouts.pop(ref)
                workers.done(worker)
                new = ray.get(ref)
                reports += new
                accepted += sum(r.has_spread for r in new)
        state.rollout_busy_s = busy_before + workers.total()
    for ref in rollouts:  # the run is over: groups still in flight are not waited for
        with contextlib.suppress(Exception):
            ray.cancel(ref)


def _free_worker(workers: BusyClock, per_worker: int) -> int | None:
    """The least loaded rollout worker with room for another group (None: all full)."""
    load = workers.in_flight
    best = min(range(len(load)), key=load.__getitem__)
    return best if load[best] < per_worker else None


def _launch(pool: ResourcePool, worker: int, state: RunState) -> Any:
    group_id = uuid.uuid4().hex
    ray.get(pool.replay.begin_group.remote(group_id, state.version))
    return pool.rollout[worker].generate.remote(next_seeds(state, 1), [group_id])


def _start_train(
    pool: ResourcePool, config: RunConfig, state: RunState, share: ReplayShare | None
) -> dict[str, Any] | None:
    """Plan a batch (fresh first; replay fills in reflow mode) and start the step, or None to wait."""
    plan = ray.get(
        pool.replay.plan_and_consume.remote(
            config.rollout.groups_per_step,
            state.version,
            share.share if share else 0.0,
            share is not None,
            state.step + 1,
        )
    )
    if plan is None:
        return None
    refs = [t.train_step.remote(plan.group_ids, state.step + 1) for t in pool.trainers]
    return {"ref": refs[0], "all": refs, "plan": plan, "started": time.monotonic()}


def _finish_train(
    pool: ResourcePool,
    config: RunConfig,
    log: RunLog,
    state: RunState,
    clock: Clock,
    train: dict[str, Any],
    reports: list[GroupReport],
    share: ReplayShare | None,
) -> None:
    metrics = ray.get(train["all"])[0]
    train_s = time.monotonic() - train["started"]
    state.trainer_busy_s += train_s
    state.step, state.version = state.step + 1, state.version + 1
    sync_start = time.monotonic()
    push_weights(pool, state.version)  # not awaited: engines swap weights between decode steps
    plan = train["plan"]
    extra = {"train_s": train_s, "trainer_wait_s": train["wait_s"], "sync_s": time.monotonic() - sync_start}
    if share is not None:
        extra["replay_share"] = share.update(
            state.step,
            trainer_wait_s=train["wait_s"],
            masked_frac=metrics["masked_frac"],
            kl=metrics["kl_behav"],
        )
    clock.tick()
    record = step_record(
        state, len(pool.rollout), reports, len(plan.group_ids), metrics, plan.staleness, extra
    )
    log.step({**record, **plan.metrics})
    if state.step % config.train.checkpoint_every == 0 or state.step == config.train.steps:
        checkpoint(pool, config, state)
    if config.eval.every and state.step % config.eval.every == 0:
        evaluate(pool, config, log, state, clock)
