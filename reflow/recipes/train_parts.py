"""The pieces every training mode shares: the run state and its clock, weight sync, checkpoints,
held-out evaluation (live or deferred), per-step records and the run summary.

Time: `RunState.wall_s` is training wall-clock with evaluation excluded (evaluation is a measurement,
not training), so success-vs-time curves of different modes compare what each mode's training costs.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import ray

from reflow.config import RunConfig
from reflow.metrics import idle_ratio
from reflow.metrics import quantile as _quantile
from reflow.recipes.run_log import RunLog
from reflow.rollout.collect import EVAL_SEED_BASE
from reflow.sched.eval_schedule import EvalSchedule
from reflow.sched.pool import ResourcePool
from reflow.sched.tasks import LearnabilityFilter
from reflow.sched.workers import GroupReport, report_group


@dataclass
class RunState:
    """The loop's position; saved with every checkpoint (the replay cursor included)."""

    step: int = 0
    version: int = 0
    next_seed: int = 0
    wall_s: float = 0.0
    eval_s: float = 0.0
    generated_tokens: int = 0
    trained_tokens: float = 0.0
    rollout_busy_s: float = 0.0
    """Summed over rollout workers: time with at least one episode group in flight."""
    trainer_busy_s: float = 0.0
    steps_no_signal: int = 0
    """Steps not taken: no group with reward spread (no gradient); weights and version stayed."""
    staleness_hist: dict[str, int] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    snapshots: list[dict[str, Any]] = field(default_factory=list)
    """Deferred evaluation points (step, version, wall_s, generated_tokens); weights kept aside."""
    task_stats: dict[str, dict[str, Any]] = field(default_factory=dict)
    """The learnability filter's per-task pass rates (`tasks.learnability`; reflow.sched.tasks)."""
    headroom: dict[str, dict[str, Any]] = field(default_factory=dict)
    """`eval.pass_at` measurements: "start" and "final" (greedy, mean@k, pass@k, RL headroom)."""
    role_changes: int = 0
    """Elastic pool role changes applied (`elastic:`; mode reflow)."""
    role_change_s: float = 0.0
    """Their measured cost summed (actor start + weight load + group re-form)."""
    tail_over_provisioned: int = 0
    """Groups started beyond a batch's B by the tail scheduler (`tail:`)."""
    tail_carried_over: int = 0
    """Groups still generating when a step started on the first B done: they carry over."""
    tail_migrations: int = 0
    """Episodes migrated to another engine (consolidation)."""


class Clock:
    """Training wall-clock: monotonic time since the run started, minus time spent evaluating."""

    def __init__(self, state: RunState) -> None:
        self.state = state
        self.origin = time.monotonic() - state.wall_s - state.eval_s

    def now(self) -> float:
        return time.monotonic() - self.origin - self.state.eval_s

    def tick(self) -> float:
        self.state.wall_s = self.now()
        return self.state.wall_s


def task_filter(config: RunConfig, state: RunState) -> LearnabilityFilter | None:
    """The learnability filter over the run state's task table (None: `tasks.learnability` off)."""
    if not config.tasks.learnability:
        return None
    return LearnabilityFilter(config.tasks.policy_config(), state.task_stats)


def next_seeds(state: RunState, n: int, config: RunConfig | None = None) -> list[int]:
    """Task seeds for `n` groups: fresh ones (training seeds count up from 0), or with
    `tasks.learnability` (pass `config`) revisits of learnable tasks first, then fresh ones. The
    filter's random draw is seeded by the run state, so a resumed run draws as the original did."""
    tasks = task_filter(config, state) if config is not None else None
    revisits = tasks.pick(n, random.Random(state.next_seed)) if tasks else []
    seeds = revisits + list(range(state.next_seed, state.next_seed + n - len(revisits)))
    state.next_seed += n - len(revisits)
    if state.next_seed >= EVAL_SEED_BASE:
        raise RuntimeError("training task seeds ran into the held-out range")
    if tasks:
        tasks.start(seeds)
    return seeds


def observe_tasks(
    config: RunConfig, state: RunState, seeds: list[int], reports: list[GroupReport], workers: int = 1
) -> None:
    """Each group's successes to the learnability filter (a no-op with `tasks.learnability` off).
    `reports` come as `ResourcePool.generate(seeds)` returns them: the seeds dealt round-robin over
    `workers` rollout workers, then worker by worker."""
    tasks = task_filter(config, state)
    if tasks is None:
        return
    dealt = [s for i in range(workers) for s in seeds[i::workers]]
    if len(dealt) != len(reports):
        raise ValueError(f"{len(dealt)} seeds for {len(reports)} group reports")
    for seed, report in zip(dealt, reports, strict=True):
        tasks.observe(seed, report.successes)


def spread_round_size(want: int, missing: int, reports: list[GroupReport]) -> int:
    """How many groups to generate for `missing` groups with reward spread, from the spread rate so far."""
    rate = sum(r.has_spread for r in reports) / len(reports) if reports else 1.0
    return min(2 * want, math.ceil(missing / max(rate, 0.25)))


def rewind_replay(pool: ResourcePool, state: RunState) -> int:
    """Bring the replay store back to the restored run state (a resume). Consumption is part of the
    checkpointed state: the steps after the checkpoint (every step, when there was none) never reached
    the restored weights, so the groups they consumed are handed out again (`rollback_consumption`).
    Task seeds continue past every stored group's: the groups generated after the checkpoint are
    fresh again, and a new group on the same task would weigh that task twice (harmless for
    correctness, a skew all the same). Returns the number of consumptions undone."""
    undone = ray.get(pool.replay.rollback_consumption.remote(state.step))
    last_seed = ray.get(pool.replay.max_meta.remote("seed"))
    if last_seed is not None:
        state.next_seed = max(state.next_seed, int(last_seed) + 1)
    return undone


def leftover_groups(pool: ResourcePool, state: RunState) -> list[GroupReport]:
    """Fresh groups generated with the current weights (a resume: stored after the checkpoint, or
    consumed by steps it never saw), in arrival order, zero-spread ones included (the step that
    trains the others retires them): sync mode trains on those before generating more. Fresh groups
    of other versions were generated with weights lost in the crash (or are spares of an older
    step): sync trains only on groups of the current weights, so they stay in the store untrained."""
    stored = [g for g in ray.get(pool.replay.fresh.remote()) if g.policy_version == state.version]
    return [report_group(g.episodes, 0.0) for g in stored]


def sync_weights(pool: ResourcePool, version: int) -> None:
    """Trainer weights to every engine, tagged `version`; returns once every engine has them."""
    ref = pool.state_dict_ref()
    versions = ray.get([w.update_weights.remote(ref, version) for w in pool.rollout])
    if any(v != version for v in versions):
        raise RuntimeError(f"engines report weight versions {versions}, expected {version}")


def checkpoint(pool: ResourcePool, config: RunConfig, state: RunState) -> None:
    """Save the trainer and the run state at `state.step`. Call it only once every step up to
    `state.step` is trained: a resume keeps the store's consumptions of steps <= the checkpoint's
    and undoes the later ones (`rewind_replay`)."""
    run_state = asdict(state)
    # snapshot weights live in Ray's object store: a resumed run cannot evaluate pre-crash snapshots
    run_state["snapshots"] = [{k: v for k, v in p.items() if k != "weights"} for p in state.snapshots]
    extra = {"run_state": run_state}
    root = str(config.run_dir / "checkpoints")
    pool.save_checkpoint(root, extra, config.train.keep_checkpoints)
    ray.get(pool.replay.set_cursor.remote("run_state", {"step": state.step, "next_seed": state.next_seed}))


def evaluate(pool: ResourcePool, config: RunConfig, log: RunLog, state: RunState, clock: Clock) -> None:
    """Held-out success now (greedy, or sampled per `eval.temperature`), or (eval.deferred) a weight
    snapshot evaluated after the run."""
    if not config.eval.episodes:
        return
    point = {
        "step": state.step,
        "version": state.version,
        "wall_s": clock.tick(),
        "generated_tokens": state.generated_tokens,
    }
    start = time.monotonic()
    if config.eval.deferred:
        point["weights"] = pool.state_dict_ref()
        ray.wait([point["weights"]])
        state.snapshots.append(point)
    else:
        _evaluate_point(pool, config, log, state, point)
    state.eval_s += time.monotonic() - start


def eval_due(config: RunConfig, state: RunState) -> bool:
    """Whether the loop takes an evaluation point now (after a step, `state.wall_s` ticked): with
    `eval.every_s`, on the wall-clock grid after the run's last point (`EvalSchedule`; the points are
    in the run state, so a resumed run carries on the same grid), else every `eval.every` steps."""
    if config.eval.every_s is not None:
        last_s = max((p["wall_s"] for p in state.history + state.snapshots), default=0.0)
        return EvalSchedule(config.eval.every_s, after_s=last_s).due(state.wall_s)
    return bool(config.eval.every) and state.step % config.eval.every == 0


def measure_headroom(pool: ResourcePool, config: RunConfig, log: RunLog, state: RunState, when: str) -> None:
    """With `eval.pass_at` = k > 0: greedy success, mean@k sampled success, pass@k and the RL headroom
    on `eval.end_episodes` held-out tasks (`RolloutWorker.headroom`), kept as `state.headroom[when]`
    for the run summary. Live, whatever `eval.deferred` says: a start-and-end figure is no curve. Its
    time counts as evaluation, not training."""
    if not config.eval.pass_at or not config.eval.episodes:
        return
    start = time.monotonic()
    ev = config.eval
    result = ray.get(pool.rollout[0].headroom.remote(ev.end_episodes, EVAL_SEED_BASE, ev.pass_at))
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
    pool: ResourcePool, config: RunConfig, log: RunLog, state: RunState, point: dict[str, Any]
) -> None:
    result = pool.evaluate(config.eval.episodes, EVAL_SEED_BASE)
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


def evaluate_snapshots(pool: ResourcePool, config: RunConfig, log: RunLog, state: RunState) -> None:
    """Deferred evaluation: load each snapshot into engine 0, evaluate it, restore nothing (the run is
    over)."""
    for point in state.snapshots:
        if "weights" not in point:  # taken before a resume: its weights are gone with that Ray session
            continue
        ray.get(pool.rollout[0].update_weights.remote(point["weights"], point["version"], rewind=True))
        _evaluate_point(pool, config, log, state, point)
    state.snapshots = [{k: v for k, v in p.items() if k != "weights"} for p in state.snapshots]


def step_record(
    state: RunState,
    n_workers: int,
    reports: list[GroupReport],
    n_trained: int,
    train_metrics: dict[str, float],
    staleness: list[int],
    times: dict[str, float],
) -> dict[str, Any]:
    """One line of metrics for a train step: rollout (the groups that arrived since the last step),
    training, IS health, staleness, idle ratios so far and the phase times. `staleness` per trained
    group: the trainer's version at the update (the weights the gradient is taken at, `state.version`
    before the step) minus the version that generated the group (its oldest episode's start)."""
    rewards = [x for r in reports for x in r.rewards]
    successes = [x for r in reports for x in r.successes]
    turns = [float(x) for r in reports for x in r.turns]
    latencies = [x for r in reports for x in r.tool_latencies_ms]
    generated = sum(r.generated_tokens for r in reports)
    state.generated_tokens += generated
    state.trained_tokens += train_metrics["trained_tokens"]
    for s in staleness:
        state.staleness_hist[str(s)] = state.staleness_hist.get(str(s), 0) + 1
    statuses: dict[str, int] = {}
    for r in reports:
        for s in r.statuses:
            statuses[s] = statuses.get(s, 0) + 1
    wall = max(state.wall_s, 1e-9)
    return {
        "step": state.step,
        "version": state.version,
        "wall_s": state.wall_s,
        "reward_mean": sum(rewards) / max(1, len(rewards)),
        "success_rate": sum(successes) / max(1, len(successes)),
        "groups_generated": len(reports),
        "groups_trained": n_trained,
        "zero_spread_share": 1 - sum(r.has_spread for r in reports) / max(1, len(reports)),
        "generated_tokens": state.generated_tokens,
        "step_generated_tokens": generated,
        "generated_tokens_per_s": state.generated_tokens / wall,
        "trained_tokens_per_s": state.trained_tokens / wall,
        "rollout_idle_ratio": idle_ratio(state.rollout_busy_s, wall * n_workers),
        "trainer_idle_ratio": idle_ratio(state.trainer_busy_s, wall),
        "staleness_mean": sum(staleness) / max(1, len(staleness)),
        "staleness_max": max(staleness, default=0),
        "steps_no_signal": state.steps_no_signal,
        "turns_p50": _quantile(turns, 0.5),
        "turns_p90": _quantile(turns, 0.9),
        "turns_max": max(turns, default=0.0),
        "tool_latency_p50_ms": _quantile(latencies, 0.5),
        "tool_latency_p99_ms": _quantile(latencies, 0.99),
        **times,
        **{f"status_{k}": v for k, v in statuses.items()},
        **{k: v for k, v in train_metrics.items() if k != "train_s"},
    }


def out_of_time(budget_s: float | None, now_s: float, next_s: float = 0.0) -> bool:
    """Whether work expected to take `next_s` seconds, started at training second `now_s`, would not
    finish inside the budget `budget_s` (`train.seconds`; None: no budget). With next_s = 0: whether
    the budget is spent. The loops pass their estimate of the next step (or collection) so that they
    do not start work that would overrun the budget."""
    if budget_s is None:
        return False
    return now_s >= budget_s or now_s + next_s > budget_s


def time_to_target(history: list[dict[str, Any]], target: float) -> float | None:
    """Training seconds at the first evaluation reaching `target` held-out success (None: never)."""
    return next((e["wall_s"] for e in history if e["success_rate"] >= target), None)


def run_summary(
    config: RunConfig, state: RunState, reuse_hist: dict[int, int] | None = None
) -> dict[str, Any]:
    evals = state.history
    first, last = (evals[0], evals[-1]) if evals else ({}, {})
    wall = max(state.wall_s, 1e-9)
    return {
        "run": str(config.run_dir),
        "mode": config.mode,
        "steps": state.step,
        "steps_no_signal": state.steps_no_signal,
        "minutes": round(state.wall_s / 60, 2),
        "heldout_success_start": first.get("success_rate"),
        "heldout_success_final": last.get("success_rate"),
        "heldout_success_best": max((e["success_rate"] for e in evals), default=None),
        "generated_tokens": state.generated_tokens,
        "generated_tokens_per_s": state.generated_tokens / wall,
        "trained_tokens_per_s": state.trained_tokens / wall,
        "seconds_per_step": state.wall_s / max(state.step, 1),
        "rollout_idle_ratio": idle_ratio(
            state.rollout_busy_s, wall * max(1, config.resources.slots.count("rollout"))
        ),
        "trainer_idle_ratio": idle_ratio(state.trainer_busy_s, wall),
        "staleness_hist": dict(sorted(state.staleness_hist.items(), key=lambda kv: int(kv[0]))),
        "reuse_hist": reuse_hist or {},
        "role_changes": state.role_changes,
        "role_change_s": state.role_change_s,
        "tail_over_provisioned": state.tail_over_provisioned,
        "tail_carried_over": state.tail_carried_over,
        "tail_migrations": state.tail_migrations,
        **headroom_summary(state.headroom),
    }


def headroom_summary(headroom: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The `eval.pass_at` figures, start then final ({} when not measured)."""
    out: dict[str, Any] = {}
    for when in ("start", "final"):
        room = headroom.get(when)
        if room:
            k = room["samples_per_task"]
            out[f"greedy_{when}"] = room["greedy_success"]
            out[f"mean@{k}_{when}"] = room["sampled_success"]
            out[f"pass@{k}_{when}"] = room["pass_at_k"]
            out[f"headroom_{when}"] = room["headroom"]
    return out
