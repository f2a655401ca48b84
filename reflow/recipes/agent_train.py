"""`reflow agent-train`: warm-start, then RL on Ray in one of three modes (`mode:` in the config).

    reflow agent-train --config configs/calc-tiny.yaml [train.lr=3e-4 ...] [--resume RUN]

- sync: generate a batch of groups with weights v (stored durably), train on it once, push weights v+1
  to the engines, repeat (`sync_loop` below).
- async, reflow: rollout and training overlap on separate slots (`reflow.recipes.decoupled`).

Everything the loops call is a plain function (`reflow.recipes`: run_state, checkpoints, evaluation,
run_log, weight_sync) or a method on a Ray handle (`reflow.runtime`).
"""

from __future__ import annotations

import time
from typing import Any

import ray
from rich.console import Console

from reflow.config import RunConfig, dump_config
from reflow.metrics import engine_use
from reflow.recipes.checkpoints import (
    after_step,
    checkpoint,
    leftover_groups,
    resumed_config,
    rewind_replay,
    start_lineage,
)
from reflow.recipes.evaluation import evaluate, evaluate_snapshots, measure_headroom
from reflow.recipes.initial_model import prepare_model
from reflow.recipes.run_log import RunLog, plot_run, run_summary, step_record, summary_table
from reflow.recipes.run_state import (
    Clock,
    RunState,
    next_seeds,
    observe_tasks,
    out_of_time,
    spread_round_size,
    steps_left,
    took_step,
)
from reflow.recipes.sinks import log_sinks
from reflow.recipes.sync_tail import SyncTail
from reflow.recipes.weight_sync import sync_weights
from reflow.runtime.cluster import Cluster, start_ray
from reflow.runtime.workers import GroupReport


def train(config: RunConfig, *, resume: bool = False, console: Console | None = None) -> dict[str, Any]:
    console = console or Console()
    run_dir = config.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_config(config))
    log = RunLog(run_dir, console, sinks=log_sinks(config))
    exit_code = 1  # until the summary is written: a W&B run that crashed shows as failed
    try:
        summary = _train(config, log, resume=resume, console=console)
        exit_code = 0
    finally:
        log.close(exit_code)
    plot_run(run_dir)
    console.print(summary_table(summary))
    return summary


def _train(config: RunConfig, log: RunLog, *, resume: bool, console: Console) -> dict[str, Any]:
    """The run from Ray's start to the summary record (written, and returned)."""
    run_dir = config.run_dir
    start_ray(config)
    model_path, state, ckpt = prepare_model(config, run_dir, log, resume=resume)
    if ckpt is not None:  # the slot layout the elastic pool had reached
        config = resumed_config(config, ckpt)
    cluster = Cluster(config, model_path, run_dir)
    try:
        if ckpt is not None:
            extra = cluster.load_checkpoint(str(ckpt))
            state = RunState(**extra["run_state"])
            console.print(f"resumed from {ckpt} at step {state.step} (weights v{state.version})")
        if resume:  # also with no checkpoint yet: the run starts over, and so does consumption
            undone = rewind_replay(cluster, state)
            console.print(f"replay: {undone} consumptions by steps after {state.step} undone")
        start_lineage(cluster, state, resumed_from=ckpt is not None if resume else None)
        if state.groups_quarantined:
            console.print(f"replay: {state.groups_quarantined} groups made by lost weights quarantined")
        ray.get(cluster.replay.clear_in_flight.remote())  # groups in flight at a crash never arrived
        clock = Clock(state)
        sync_weights(cluster, state.version)
        if not resume:
            evaluate(cluster, config, log, state, clock)
            if config.eval.pass_at_start:
                measure_headroom(cluster, config, log, state, "start")
        # how the rollout engines spend the loop (since this process started it: after a resume, since
        # the resume), the loop's own evaluations left out
        engines_at_start = cluster.engine_counters()
        evaluating_at_start = dict(cluster.engines_evaluating)
        if config.mode == "sync":
            carried = config.tail.active("sync")
            pending = leftover_groups(cluster, state, carried) if resume else []
            sync_loop(cluster, config, log, state, clock, pending)
        else:
            from reflow.recipes.decoupled import decoupled_loop

            decoupled_loop(cluster, config, log, state, clock)
        clock.tick()
        evaluating = {k: v - evaluating_at_start[k] for k, v in cluster.engines_evaluating.items()}
        engines = engine_use(engines_at_start, cluster.engine_counters(), evaluating)
        points = state.history + state.snapshots
        if not points or points[-1]["step"] != state.step:  # always end on an evaluation
            evaluate(cluster, config, log, state, clock)
        measure_headroom(cluster, config, log, state, "final")
        state.count_rollout_slots(len(cluster.rollout), state.wall_s)  # for the summary's idle ratio
        checkpoint(cluster, config, state)
        evaluate_snapshots(cluster, config, log, state)
        reuse = ray.get(cluster.replay.reuse_histogram.remote())
    finally:
        cluster.shutdown()
    summary = run_summary(config, state, reuse, engines)
    log.write("summary", summary)
    return summary


def sync_loop(
    cluster: Cluster,
    config: RunConfig,
    log: RunLog,
    state: RunState,
    clock: Clock,
    pending: list[GroupReport],
) -> None:
    """Generate B groups with reward spread using weights v, train on them once, sync weights v+1.
    A round with no group with spread (after every resampling round) trains nothing: no step is
    taken, weights and version stay, and it counts as `steps_no_signal` (towards `train.steps`, so a
    policy that gets no signal any more cannot loop forever). No round starts that the time budget
    cannot fit, judged by the mean round so far. With `tail.enabled`, a round over-provisions and
    its unfinished groups carry over, paused (`reflow.recipes.sync_tail`)."""
    tail = SyncTail(cluster, config, pending) if config.tail.active("sync") else None
    saved, state.scheduler = state.scheduler, {}  # what this run adapts is saved anew (none: tail off)
    if tail is not None and saved:  # a resume: the tail's durations and limits back
        tail.load_state_dict(saved, state, log)
    while steps_left(state, config.train.steps):
        rounds = state.step + state.steps_no_signal
        if out_of_time(config.train.seconds, clock.now(), state.wall_s / rounds if rounds else 0.0):
            break
        t0 = time.monotonic()
        groups, reports = (
            tail.collect(state, log) if tail else collect_groups(cluster, config, state, pending)
        )
        t1 = time.monotonic()
        state.rollout_busy_s += (t1 - t0) * len(cluster.rollout)
        # the zero-spread groups passed over are retired (as in the other modes), trained or not
        retired = [r.group_id for r in reports if not r.has_spread] + (tail.dropped if tail else [])
        if not groups:
            state.steps_no_signal += 1
            ray.get(cluster.replay.mark_consumed.remote(retired, state.step + 1))
            state.generated_tokens += sum(r.generated_tokens for r in reports)
            clock.tick()
            log.write(
                "no_signal",
                {
                    "step": state.step,
                    "groups_generated": len(reports),
                    "steps_no_signal": state.steps_no_signal,
                    "rollout_s": t1 - t0,
                },
            )
            log.console.print(f"no group with reward spread in {len(reports)}: step not taken")
            continue
        ids = [g.group_id for g in groups]
        metrics = cluster.train_step(ids, state.step + 1)
        t2 = time.monotonic()
        state.trainer_busy_s += t2 - t1
        if not took_step(state, metrics):  # no sampled token: nothing trained, weights and version stay
            state.generated_tokens += sum(r.generated_tokens for r in reports)
            ray.get(cluster.replay.mark_consumed.remote([*ids, *retired], state.step + 1))
            clock.tick()
            log.write("no_signal", {"step": state.step, "groups": len(ids), "sampled_tokens": 0})
            continue
        sync_weights(cluster, state.version)
        ray.get(cluster.replay.mark_consumed.remote([*ids, *retired], state.step))
        t3 = time.monotonic()
        clock.tick()
        times = {"rollout_s": t1 - t0, "train_s": t2 - t1, "sync_s": t3 - t2}
        staleness = [state.version - 1 - g.policy_version for g in groups]  # 0 bar carried-over groups
        log.step(step_record(state, len(cluster.rollout), reports, len(groups), metrics, staleness, times))
        after_step(cluster, config, log, state, clock, tail.state_dict if tail else None)
    if tail is not None:
        tail.close(state, log)


def collect_groups(
    cluster: Cluster, config: RunConfig, state: RunState, pending: list[GroupReport]
) -> tuple[list[GroupReport], list[GroupReport]]:
    """Groups with reward spread for one step, generated with the current weights. Zero-spread groups
    carry no gradient: generate more (DAPO dynamic sampling) for up to `max_resample_rounds` rounds.
    Every group, used or not, is in the store. `pending`: groups of the current weights stored
    before a resume, used first and only by this step (the next one has other weights)."""
    want, reports = config.rollout.groups_per_step, list(pending)
    usable = [r for r in reports if r.has_spread]
    pending.clear()
    for _ in range(1 + config.rollout.max_resample_rounds):
        seeds = next_seeds(state, spread_round_size(want, want - len(usable), reports), config)
        new = cluster.generate(seeds)  # dealt round-robin over the rollout workers
        observe_tasks(config, state, seeds, new, len(cluster.rollout))
        reports += new
        usable += [r for r in new if r.has_spread]
        if len(usable) >= want:
            break
    return usable[:want], reports
