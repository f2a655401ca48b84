"""Checkpoints and resume: what a checkpoint saves besides the trainer (the run state, the replay cursor),
when the loops take one (`after_step`, with the evaluation point it holds), and how a resumed run
brings the replay store back to it (consumptions undone, leftover groups).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import ray

from reflow.config import RunConfig
from reflow.recipes.evaluation import eval_due, evaluate
from reflow.recipes.run_log import RunLog
from reflow.recipes.run_state import Clock, RunState
from reflow.runtime.cluster import Cluster
from reflow.runtime.workers import GroupReport, report_group


def checkpoint(cluster: Cluster, config: RunConfig, state: RunState) -> None:
    """Save the trainer and the run state at `state.step`. Call it only once every step up to
    `state.step` is trained: a resume keeps the store's consumptions of steps <= the checkpoint's
    and undoes the later ones (`rewind_replay`)."""
    run_state = asdict(state)
    extra = {"run_state": run_state}
    root = str(config.run_dir / "checkpoints")
    cluster.save_checkpoint(root, extra, config.train.keep_checkpoints)
    ray.get(cluster.replay.set_cursor.remote("run_state", {"step": state.step, "next_seed": state.next_seed}))


def after_step(
    cluster: Cluster,
    config: RunConfig,
    log: RunLog,
    state: RunState,
    clock: Clock,
    scheduler: Callable[[], dict[str, Any]] | None = None,
) -> None:
    """What both loops do after a trained step, in this order: an evaluation point if one is due (live
    in sync mode; in async and reflow a weight snapshot evaluated after the run: `evaluation.evaluate`),
    then a checkpoint if one is due, which so holds that point. `scheduler` gives the adaptive state a
    checkpoint saves besides (`RunState.scheduler`)."""
    if eval_due(config, state):
        evaluate(cluster, config, log, state, clock)
    if state.step % config.train.checkpoint_every == 0 or state.step == config.train.steps:
        if scheduler is not None:
            state.scheduler = scheduler()
        checkpoint(cluster, config, state)


def rewind_replay(cluster: Cluster, state: RunState) -> int:
    """Bring the replay store back to the restored run state (a resume). Consumption is part of the
    checkpointed state: the steps after the checkpoint (every step, when there was none) never reached
    the restored weights, so the groups they consumed are handed out again (`rollback_consumption`).
    Task seeds continue past every stored group's: the groups generated after the checkpoint by its
    own weights are fresh again (those of later weights are quarantined next, `start_lineage`), and a
    new group on the same task would weigh that task twice (harmless for correctness, a skew all the
    same). Returns the number of consumptions undone."""
    undone = ray.get(cluster.replay.rollback_consumption.remote(state.step))
    last_seed = ray.get(cluster.replay.max_meta.remote("seed"))
    if last_seed is not None:
        state.next_seed = max(state.next_seed, int(last_seed) + 1)
    return undone


def leftover_groups(cluster: Cluster, state: RunState, carried: bool = False) -> list[GroupReport]:
    """Fresh groups generated with the current weights (a resume: stored after the checkpoint, or
    consumed by steps it never saw), in arrival order, zero-spread ones included (the step that
    trains the others retires them): sync mode trains on those before generating more. Fresh groups
    of newer versions were made by weights lost in the crash and are quarantined (`start_lineage`);
    those of older versions are spares of an older step: sync trains only on groups of the current
    weights, so they stay in the store untrained. `carried` (sync mode's tail handling): groups one
    version older too, partial rollouts carried over the last step and groups done beyond its B."""
    oldest = state.version - 1 if carried else state.version
    ids = [g.group_id for g in ray.get(cluster.replay.fresh.remote()) if g.policy_version >= oldest]
    return [report_group(g.episodes, 0.0) for g in ray.get(cluster.replay.groups.remote(ids))]


def start_lineage(cluster: Cluster, state: RunState, *, resumed_from: bool | None) -> None:
    """Start this run's lineage in the replay store and quarantine what lost weights made.
    `resumed_from`: None for a fresh run; True when resuming from a checkpoint (the weights of
    `state.version` in `state.lineage`); False when resuming with no checkpoint yet (the starting
    weights again, which every lineage shares at version 0: the latest lineage is the parent)."""
    if resumed_from is None:
        parent = None
    elif resumed_from:
        parent = state.lineage
    else:
        parent = ray.get(cluster.replay.latest_lineage.remote())
    state.lineage = ray.get(cluster.replay.start_lineage.remote(state.version, parent))
    ray.get(cluster.replay.quarantine.remote())
    state.groups_quarantined = len(ray.get(cluster.replay.quarantined.remote()))


def resumed_config(config: RunConfig, ckpt: Path) -> RunConfig:
    """`config` with the slot layout the run had at checkpoint `ckpt` (the elastic pool may have moved
    slots between roles), so the resumed cluster starts as the run left off; a checkpoint without one
    (sync mode, or older) keeps the configured layout, and so does a saved layout below the elastic
    pool's minimums as configured now (its policy refuses to decide from such a split)."""
    from reflow.train.trainer_state import read_state

    roles = read_state(ckpt).get("extra", {}).get("run_state", {}).get("scheduler", {}).get("roles")
    if not roles or len(roles) != len(config.resources.slots) or roles == config.resources.slots:
        return config
    limits = config.elastic.policy_config()
    if roles.count("rollout") < limits.min_rollout or roles.count("train") < limits.min_train:
        return config
    resumed = config.model_copy(deep=True)
    resumed.resources.slots = roles
    return resumed
