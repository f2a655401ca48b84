"""Held-out evaluation during a run: live points, deferred weight snapshots evaluated after the run, the
wall-clock or step schedule that says when, and the start/end RL-headroom measurement (`eval.pass_at`).
Its time counts as evaluation (`RunState.eval_s`), not training.

Every mode runs on the same clock. A live point stops the sync loop, whose rollout and training both
wait, so its time is taken off the training clock; in the decoupled modes rollout would go on
generating while the clock stood still, so there every point is a snapshot (`deferred`), whatever
`eval.deferred` says, and its cost (a copy of the weights) stays on the training clock in every mode.
A snapshot is a file (`run_dir/snapshots/`, removed once evaluated), so the points taken before a
crash are evaluated after the resumed run too.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import ray

from reflow.config import RunConfig
from reflow.policy.eval_schedule import EvalSchedule
from reflow.recipes.run_log import RunLog
from reflow.recipes.run_state import Clock, RunState
from reflow.rollout.collect import EVAL_SEED_BASE
from reflow.runtime.cluster import Cluster


def deferred(config: RunConfig) -> bool:
    """Whether evaluation points are snapshots evaluated after the run (see the module docstring)."""
    return config.eval.deferred or config.mode != "sync"


def evaluate(cluster: Cluster, config: RunConfig, log: RunLog, state: RunState, clock: Clock) -> None:
    """Held-out success now (greedy, or sampled per `eval.temperature`), or (`deferred`) a weight
    snapshot evaluated after the run."""
    if not config.eval.episodes:
        return
    point = {
        "step": state.step,
        "version": state.version,
        "wall_s": clock.tick(),
        "generated_tokens": state.generated_tokens,
    }
    if deferred(config):
        import torch

        path = config.run_dir / "snapshots" / f"step-{state.step:06d}.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(ray.get(cluster.state_dict_ref()), path)
        state.snapshots.append({**point, "weights": str(path)})
        return
    start = time.monotonic()
    _evaluate_point(cluster, config, log, state, point)
    state.eval_s += time.monotonic() - start


def eval_due(config: RunConfig, state: RunState) -> bool:
    """Whether the loop takes an evaluation point now (after a step, `state.wall_s` ticked): with
    `eval.every_s`, on the wall-clock grid after the run's last point (`EvalSchedule`; the points are
    in the run state, so a resumed run carries on the same grid), else every `eval.every` steps."""
    if config.eval.every_s is not None:
        last_s = max((p["wall_s"] for p in state.history + state.snapshots), default=0.0)
        return EvalSchedule(config.eval.every_s, after_s=last_s).due(state.wall_s)
    return bool(config.eval.every) and state.step % config.eval.every == 0


def measure_headroom(cluster: Cluster, config: RunConfig, log: RunLog, state: RunState, when: str) -> None:
    """With `eval.pass_at` = k > 0: greedy success, mean@k sampled success, pass@k and the RL headroom
    on `eval.end_episodes` held-out tasks (`RolloutWorker.headroom`), kept as `state.headroom[when]`
    for the run summary. Live, whatever `eval.deferred` says: a start-and-end figure is no curve. Its
    time counts as evaluation, not training."""
    if not config.eval.pass_at or not config.eval.episodes:
        return
    start = time.monotonic()
    ev = config.eval
    result = ray.get(cluster.rollout[0].headroom.remote(ev.end_episodes, EVAL_SEED_BASE, ev.pass_at))
    state.eval_s += time.monotonic() - start
    state.headroom[when] = {"step": state.step, **result}
    log.write("headroom", {"when": when, **state.headroom[when]})
    k = result["samples_per_task"]
    log.console.print(
        f"held-out ({when}, {result['tasks']} tasks): greedy {result['greedy_success']:.1%}, "
        f"mean@{k} {result['sampled_success']:.1%}, pass@{k} {result['pass_at_k']:.1%}, "
        f"RL headroom {result['headroom']:.1%} ({result['seconds']:.0f}s)"
    )


def _evaluate_point(
    cluster: Cluster, config: RunConfig, log: RunLog, state: RunState, point: dict[str, Any]
) -> None:
    result = cluster.evaluate(config.eval.episodes, EVAL_SEED_BASE)
    record = {
        **{k: v for k, v in point.items() if k != "weights"},
        "success_rate": result["success_rate"],
        "reward_mean": result["reward_mean"],
        "episodes": result["episodes"],
        "samples": result["samples"],
        "temperature": result["temperature"],
        "eval_s": result["seconds"],
    }
    state.history.append(record)
    log.eval(record)


def evaluate_snapshots(cluster: Cluster, config: RunConfig, log: RunLog, state: RunState) -> None:
    """Deferred evaluation: load each snapshot into engine 0, evaluate it and remove its file, restore
    nothing (the run is over). A point whose file is gone (evaluated by an earlier incarnation that
    crashed later, or a snapshot of an older ReFlow) is skipped."""
    import torch

    for point in state.snapshots:
        path = Path(point.get("weights") or "")
        if not path.is_file():
            continue
        weights = ray.put(torch.load(path, weights_only=True))
        ray.get(cluster.rollout[0].update_weights.remote(weights, point["version"], rewind=True))
        _evaluate_point(cluster, config, log, state, point)
        path.unlink()
    state.snapshots = [{k: v for k, v in p.items() if k != "weights"} for p in state.snapshots]
    shutil.rmtree(config.run_dir / "snapshots", ignore_errors=True)  # and those of steps a crash lost
