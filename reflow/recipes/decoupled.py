"""The `async` and `reflow` modes: rollout workers and trainer ranks run at the same time.

- async: rollouts run ahead of the trainer by at most `replay.eta` policy versions (admission control,
  `AdmissionControl`: a group may start while the groups not yet trained plus those in flight stay
  below (eta + 1) * B, counted from the weights the engines confirmed); each group is trained on
  once; new weights reach the engines without stopping the trainer (`WeightPusher`: every push
  tracked, in order per engine), and episodes in flight across an update keep per-token versions (the
  loss uses their behaviour log-probs).
- reflow: the same, plus the dual replay cycle: when fresh groups are short, recent groups (age <=
  tau_max, reuse < K) fill the batch up to the adaptive replay share, so the trainer does not idle; the
  share rises while the trainer waits and falls when importance weights degrade. Also on by default
  in reflow (`elastic.enabled` / `tail.enabled` switch them off for ablations; `reflow.runtime`): the
  elastic pool may move one slot between rollout and training at each version boundary, and the
  tail scheduler keeps B + delta groups of a batch started (delta from the tail's heaviness) and lets
  a step start on the first B done, the rest carrying over into the next step; in a batch's tail it
  migrates stragglers onto fewer engines, starts the next batch's groups on the engines freed, and
  (opt-in) keeps each engine's concurrency at the knee of its measured tokens/s curve. With
  `tail.batch_cap=false` admission's window, up to (eta + 1) x B groups not yet trained, alone bounds
  the starts (`TailGate`'s `overlap`).

One driver loop: top up rollouts to what admission allows, start a train step when a batch can be
planned, then wait for whichever finishes first (a group, the step, a weight push). With a time
budget (`train.seconds`) no step starts that would end past it (the mean step so far), and no
rollout that could not be trained in time.
"""

from __future__ import annotations

import contextlib
import functools
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray

from reflow.config import RunConfig
from reflow.policy.dual_cycle import AdmissionControl, ReplayShare
from reflow.recipes.checkpoints import after_step
from reflow.recipes.loop_counters import Arrivals, BusyClock, saved_durations
from reflow.recipes.run_log import RunLog, step_record
from reflow.recipes.run_state import Clock, RunState, next_seeds, out_of_time, steps_left, took_step
from reflow.recipes.weight_sync import WeightPusher
from reflow.runtime.cluster import Cluster
from reflow.runtime.elastic import ElasticDriver, moved_positions
from reflow.runtime.lending import LentEngines
from reflow.runtime.replay_service import PlannedBatch, cycle_config
from reflow.runtime.tail import GroupInFlight
from reflow.runtime.tail_gate import TailGate, decoupled_gate
from reflow.runtime.workers import GroupReport


@dataclass
class StepInFlight:
    """A train step running on the trainer ranks."""

    refs: list[Any]
    """One object ref per rank (every rank takes part); rank 0's returns the metrics."""
    plan: PlannedBatch
    wait_s: float
    """How long the trainer waited for this batch."""
    started: float

    @property
    def fresh(self) -> int:
        return int(self.plan.metrics["batch_fresh"])


def decoupled_loop(cluster: Cluster, config: RunConfig, log: RunLog, state: RunState, clock: Clock) -> None:
    B, budget = config.rollout.groups_per_step, config.train.seconds
    admission = AdmissionControl(config.replay.eta, B)
    share = ReplayShare(cycle_config(config)) if config.mode == "reflow" else None
    per_worker = max(1, config.rollout.max_batch_size // config.rollout.group_size)
    weights = WeightPusher(cluster, state.version)
    rollouts: dict[Any, GroupInFlight] = {}  # object ref of a group in flight -> its worker, since when
    workers = BusyClock(len(cluster.rollout))
    # lending: engines beside the trainer ranks take groups while no step runs (`LentEngines`)
    lent = (
        LentEngines(cluster, per_worker, config.replay.eta, state, group_size=config.rollout.group_size)
        if cluster.lent
        else None
    )
    elastic = (
        ElasticDriver(cluster, config, state, clock.now(), lent)
        if config.elastic.active(config.mode)
        else None
    )
    tail = decoupled_gate(cluster, config, per_worker)  # B + delta a batch (tail.batch_cap), or admission
    busy_before = state.rollout_busy_s
    uses = ray.get(cluster.replay.reuse_histogram.remote(spread=True))  # groups with spread, by uses
    got = Arrivals(accepted=sum(uses.values()))
    _log_events(log, state, "tail", _restore(state.scheduler, share, elastic, tail, got))

    def saved() -> dict[str, Any]:  # what a checkpoint keeps of the adaptive parts
        return _scheduler_state(cluster, share, elastic, tail, got)

    def in_flight() -> int:  # groups generating, on rollout workers and lent engines
        return len(rollouts) + (lent.in_flight if lent else 0)

    def admits(version: int) -> bool:  # admission lets a group start on an engine confirming `version`
        return admission.may_start(version, got.accepted, in_flight(), trained[version])

    trained = {state.version: got.accepted - uses.get(0, 0)}  # version -> fresh groups trained by then
    step: StepInFlight | None = None
    waiting_since = time.monotonic()
    while True:
        now, step_s = clock.now(), state.trainer_busy_s / state.step if state.step else 0.0
        can_step = steps_left(state, config.train.steps) and not out_of_time(budget, now, step_s)
        # fresh groups waiting; below 0 for a moment when a step took a group stored before its
        # report reached the loop (that group still counts as in flight)
        fresh = max(0, got.accepted - trained[state.version] - (step.fresh if step else 0))
        # tail: how many more groups the batch being collected may start (B + delta, none once B are
        # done; without the batch cap as admission allows) and where; in a batch's tail stragglers
        # migrate, engines are freed and (tail.set_concurrency) limits follow their measured knee
        confirmed = weights.rollout_confirmed  # = admission_version(w) for every rollout worker w
        room = admission.room(confirmed, got.accepted, in_flight(), trained[confirmed])
        served: list[int] = []  # sequences the rollout engines run for lent engines (handed over)
        if lent is not None:
            _log_events(log, state, "elastic", lent.refresh())
            served = _serve(lent, workers)
        gate = tail.look(
            fresh,
            list(rollouts.values()),
            workers.in_flight,
            time.monotonic(),
            room,
            weights.versions.confirmed,
            served,
        )
        _log_events(log, state, "tail", gate.events)
        state.tail_migrations += gate.migrations
        # collect: start groups while the tail gate and admission (from the engines' confirmed
        # weights) allow, and while a group started now can still be trained inside the budget
        while (
            can_step
            and gate.allows()
            and (w := gate.worker()) is not None
            and admits(confirmed)
            and not out_of_time(budget, now, got.mean_seconds + step_s)
        ):
            state.tail_over_provisioned += gate.take(w)
            ref, group = _launch(cluster, cluster.rollout[w], w, weights.versions.confirmed[w], state)
            rollouts[ref] = group
            workers.start(w)
        # train: start a step when a batch can be planned (lent engines yield first, handing what the
        # rollout engines have room for over to them); the groups still running carry over
        if step is None and can_step:
            yield_lent = (
                functools.partial(
                    _yield_lent, log, state, lent, gate.free_sequences(), list(weights.versions.confirmed)
                )
                if lent
                else None
            )
            step = _start_step(cluster, config, state, share, time.monotonic() - waiting_since, yield_lent)
            if step is not None and tail.policy is not None and rollouts:  # lent groups pause apart
                _carry_over(log, state, step, len(rollouts))
            if step is not None and lent is not None:  # the rollout workers run what was handed over
                _serve(lent, workers)
        if lent is not None and step is None:  # the trainer waits: its lent engines generate
            lent.resume()
            if can_step and not out_of_time(budget, now, got.mean_seconds + step_s):
                _lend(cluster, state, lent, weights, admits)
        if step is None and (not can_step or not (in_flight() or weights.refs)):
            break  # no step running, and none can start or get data
        lent_refs = list(lent.groups) if lent else []
        pending = [*rollouts, *lent_refs, *weights.refs, *([step.refs[0]] if step else [])]
        wake = [s for s in (tail.wake_s(len(rollouts)), lent.wake_s() if lent else None) if s is not None]
        ready, _ = ray.wait(pending, num_returns=1, timeout=min(wake, default=None))
        weights.collect(ready)  # sync weights: record confirmed versions, start due pushes
        for ref in ready:
            if step is not None and ref == step.refs[0]:
                if lent is not None:  # the trainer's step time ends here, not after its bookkeeping
                    lent.step_done()
                before = state.version
                _finish_step(cluster, config, log, state, clock, step, got.reports, share, weights, saved)
                trained[state.version] = trained[before] + step.fresh
                got.reports, waiting_since = [], time.monotonic()
                if elastic is not None:  # elastic pool: a slot may change role at this version boundary
                    elastic.stepped(len(step.plan.group_ids), state)
                    by_worker = (rollouts, workers, weights)  # what the loop keys by worker position
                    _elastic_boundary(elastic, cluster, log, state, clock, share, got, trained, by_worker)
                step = None
            elif ref in rollouts:
                workers.done(rollouts.pop(ref).worker)
                got.add(ray.get(ref))
            elif lent is not None and lent.done(ref):
                got.add(ray.get(ref), timed=False)  # its durations include steps it waited paused
        if len(got.seconds) != tail.observed:  # groups arrived: the tail's quantiles move
            tail.observe(got.seconds, got.episode_seconds)
        state.rollout_busy_s = busy_before + workers.total()
        if lent is not None:
            lent.count_into(state)
    # The run's final checkpoint (after the loop) keeps the state the run ended with: a run that ends
    # on its time budget may have written no periodic checkpoint since its last changes, or none.
    state.scheduler = saved()
    _log_events(log, state, "tail", tail.close(time.monotonic()))  # migrations measured since
    if lent is not None:  # and the lent engines' hand-overs'
        _log_events(log, state, "elastic", lent.refresh(force=True, ask=set(range(len(cluster.lent)))))
    for ref in [*rollouts, *(lent.groups if lent else ())]:  # the run is over: groups still in
        with contextlib.suppress(Exception):  # flight are not waited for
            ray.cancel(ref)
    weights.wait_all()  # the final evaluation and checkpoint see engines on the last weights


def _serve(lent: LentEngines, workers: BusyClock) -> list[int]:
    """The sequences each rollout worker's engine runs for lent engines (by position), counted in its
    busy time."""
    served = lent.served_loads()
    workers.serve(served)
    return served


def _lend(
    cluster: Cluster,
    state: RunState,
    lent: LentEngines,
    weights: WeightPusher,
    may_start: Callable[[int], bool],
) -> None:
    """The trainer waits: start groups on the lending engines with room, each from the weights its own
    engine confirmed, while admission allows (`may_start(version)`; not the tail gate's count, which is
    the rollout workers' share of a batch)."""
    while (e := lent.free()) is not None:
        version = weights.admission_version(len(cluster.rollout) + e)
        if not may_start(version):
            return
        ref, group = _launch(cluster, cluster.lent[e], e, version, state)
        lent.started(ref, e, version, group.group_id)


def _yield_lent(
    log: RunLog, state: RunState, lent: LentEngines, free: list[int], confirmed: list[int]
) -> None:
    """At a step's start the lent engines yield, handing what fits the rollout engines' `free`
    sequences (by position) over to those holding weights no older than theirs (`confirmed`)."""
    _log_events(log, state, "elastic", lent.pause(state.version, free, confirmed))


def _log_events(log: RunLog, state: RunState, kind: str, events: list[dict[str, Any]]) -> None:
    for event in events:
        log.write(kind, {"step": state.step, "version": state.version, **event})


def _carry_over(log: RunLog, state: RunState, step: StepInFlight, running: int) -> None:
    """A step started on the groups done: the `running` ones continue into the next step as they are."""
    state.tail_carried_over += running
    why = f"step {state.step + 1} starts on {len(step.plan.group_ids)} groups; {running} running carry over"
    _log_events(log, state, "tail", [{"what": "carry_over", "why": why, "applied": True, "carried": running}])


def _elastic_boundary(
    elastic: ElasticDriver,
    cluster: Cluster,
    log: RunLog,
    state: RunState,
    clock: Clock,
    share: ReplayShare | None,
    got: Arrivals,
    trained: dict[int, int],
    by_worker: tuple[dict[Any, GroupInFlight], BusyClock, WeightPusher],
) -> None:
    """Ask the elastic pool at this version boundary and apply its move: re-index what the loop keys by
    rollout worker position (groups in flight, busy clocks, weight pushes); the groups the drained
    worker finished arrive."""
    rollouts, workers, weights = by_worker
    before = [s.index for s in cluster.rollout_slots]
    state.count_rollout_slots(len(before), clock.now())  # the idle ratios' denominator, at the old count
    event, change = elastic.at_boundary(
        state,
        clock.now(),
        got.episodes,
        replay_share=share.share if share else 0.0,
        fresh_waiting=max(0, got.accepted - trained[state.version]),
        in_flight=rollouts,
    )
    _log_events(log, state, "elastic", [event])
    if change is None:
        return
    state.role_changes += 1
    state.role_change_s += change.cost.total_s
    gone, joined = moved_positions(before, [s.index for s in cluster.rollout_slots])
    if gone is not None:
        for ref in [r for r, g in rollouts.items() if g.worker == gone]:
            del rollouts[ref]  # drained: finished (in `change.drained`), failed or abandoned
        for g in rollouts.values():
            g.worker -= g.worker > gone
        workers.remove(gone)
        weights.remove(gone)
    if joined is not None:
        for g in rollouts.values():
            g.worker += g.worker >= joined
        workers.insert(joined)
        weights.add(joined, change.version)
    got.add(change.drained)


def _launch(
    cluster: Cluster, actor: Any, worker: int, version: int, state: RunState
) -> tuple[Any, GroupInFlight]:
    """Start one group on `actor` (at position `worker`), registered in flight with the version its
    engine confirmed."""
    group_id = uuid.uuid4().hex
    ray.get(cluster.replay.begin_group.remote(group_id, version))
    ref = actor.generate.remote(next_seeds(state, 1), [group_id])
    return ref, GroupInFlight(worker, group_id, time.monotonic())


def _start_step(
    cluster: Cluster,
    config: RunConfig,
    state: RunState,
    share: ReplayShare | None,
    wait_s: float,
    before: Callable[[], None] | None = None,
) -> StepInFlight | None:
    """Plan a batch (fresh first; replay fills in reflow mode) and start the step, or None to wait.
    `before`: called once the batch is planned, before the step starts (lent engines yield)."""
    plan = ray.get(
        cluster.replay.plan_and_consume.remote(
            config.rollout.groups_per_step,
            state.version,
            share.share if share else 0.0,
            share is not None,
            state.step + 1,
        )
    )
    if plan is None:
        return None
    if before is not None:
        before()
    return StepInFlight(
        cluster.start_train_step(plan.group_ids, state.step + 1), plan, wait_s, time.monotonic()
    )


def _finish_step(
    cluster: Cluster,
    config: RunConfig,
    log: RunLog,
    state: RunState,
    clock: Clock,
    step: StepInFlight,
    reports: list[GroupReport],
    share: ReplayShare | None,
    weights: WeightPusher,
    scheduler: Callable[[], dict[str, Any]],
) -> None:
    """The step is trained: version up, its weights on their way to the engines, log, then evaluate and
    checkpoint as due (`after_step`; the checkpoint with the `scheduler` state)."""
    metrics = ray.get(step.refs)[0]
    train_s = time.monotonic() - step.started
    state.trainer_busy_s += train_s
    if not took_step(state, metrics):  # no sampled token: nothing trained, weights and version stay
        state.generated_tokens += sum(r.generated_tokens for r in reports)  # (step_record's otherwise)
        clock.tick()
        groups = len(step.plan.group_ids)
        log.write("no_signal", {"step": state.step, "groups": groups, "sampled_tokens": 0})
        return
    sync_start = time.monotonic()
    weights.publish(state.version)  # not awaited: engines swap weights between decode steps
    extra = {
        "train_s": train_s,
        "trainer_wait_s": step.wait_s,
        "sync_s": time.monotonic() - sync_start,
        "engine_version": weights.confirmed,
    }
    if share is not None:
        extra["replay_share"] = share.update(
            state.step,
            trainer_wait_s=step.wait_s,
            masked_frac=metrics["masked_frac"],
            kl=metrics["kl_behav"],
            ess=metrics["is_ess"],
        )
    clock.tick()
    plan = step.plan
    record = step_record(
        state, len(cluster.rollout), reports, len(plan.group_ids), metrics, plan.staleness, extra
    )
    log.step({**record, **plan.metrics})
    after_step(cluster, config, log, state, clock, scheduler)  # points are snapshots: rollout goes on


def _scheduler_state(
    cluster: Cluster,
    share: ReplayShare | None,
    elastic: ElasticDriver | None,
    tail: TailGate,
    got: Arrivals,
) -> dict[str, Any]:
    """The adaptive state a checkpoint saves (`RunState.scheduler`)."""
    return {
        "replay_share": share.state_dict() if share else None,
        "durations": saved_durations(got.seconds, got.episode_seconds),
        "tail": tail.state_dict(),
        "elastic": elastic.state_dict() if elastic else None,
        "roles": cluster.roles(),
    }


def _restore(
    saved: dict[str, Any],
    share: ReplayShare | None,
    elastic: ElasticDriver | None,
    tail: TailGate,
    got: Arrivals,
) -> list[dict[str, Any]]:
    """A resume: the saved adaptive state back into the loop's parts (the layout was restored when the
    cluster started, `checkpoints.resumed_config`); the tail's events of the limits set."""
    if not saved:
        return []
    if share is not None and saved.get("replay_share"):
        share.load_state_dict(saved["replay_share"])
    if elastic is not None and saved.get("elastic"):
        elastic.load_state_dict(saved["elastic"])
    durations = saved.get("durations", {})
    got.add_durations(durations.get("group_s", []), durations.get("episode_s", []))
    if got.seconds:
        tail.observe(got.seconds, got.episode_seconds)
    return tail.load_state_dict(saved.get("tail", {}))
