"""`reflow agent-train`: warm-start, then RL on Ray, in sync mode.

    reflow agent-train --config configs/calc-tiny.yaml [train.lr=3e-4 ...] [--resume RUN]

`train()` is the whole loop: generate a batch of groups with weights v (stored durably), train on it
once, push weights v+1 to the engines, checkpoint, evaluate. Everything it calls is a plain function
below or a method on a Ray handle (`reflow.sched`).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import ray
from rich.console import Console

from reflow.config import RunConfig, dump_config
from reflow.recipes.run_log import RunLog, plot_run, summary_table
from reflow.recipes.warm_phase import prepare_model
from reflow.rollout.collect import EVAL_SEED_BASE
from reflow.sched.pool import ResourcePool, start_ray
from reflow.sched.workers import GroupReport, report_group


@dataclass
class RunState:
    """The loop's position; saved with every checkpoint (the replay cursor included)."""

    step: int = 0
    version: int = 0
    next_seed: int = 0
    wall_s: float = 0.0
    generated_tokens: int = 0
    trained_tokens: float = 0.0
    history: list[dict[str, Any]] = field(default_factory=list)


def train(config: RunConfig, *, resume: bool = False, console: Console | None = None) -> dict[str, Any]:
    console = console or Console()
    run_dir = config.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_config(config))
    log = RunLog(run_dir, console)
    start_ray(config)
    model_path, state, ckpt = prepare_model(config, run_dir, log, resume=resume)
    pool = ResourcePool(config, model_path, run_dir)
    try:
        if ckpt is not None:
            extra = ray.get([t.load_checkpoint.remote(str(ckpt)) for t in pool.trainers])[0]
            state = RunState(**extra["run_state"])
            console.print(f"resumed from {ckpt} at step {state.step} (weights v{state.version})")
        start = time.monotonic() - state.wall_s
        sync_weights(pool, state.version)
        pending = leftover_groups(pool, state) if resume else []
        if not resume:
            evaluate(pool, config, log, state, time.monotonic() - start)
        while state.step < config.train.steps and not out_of_time(config, state):
            t0 = time.monotonic()
            groups, reports = collect_groups(pool, config, state, pending)
            t1 = time.monotonic()
            train_metrics = ray.get(
                [t.train_step.remote([g.group_id for g in groups], state.step + 1) for t in pool.trainers]
            )[0]
            t2 = time.monotonic()
            state.step, state.version = state.step + 1, state.version + 1
            sync_weights(pool, state.version)
            ray.get(pool.replay.mark_consumed.remote([g.group_id for g in groups], state.step))
            t3 = time.monotonic()
            state.wall_s = t3 - start
            log.step(step_record(state, reports, groups, train_metrics, (t0, t1, t2, t3)))
            if state.step % config.train.checkpoint_every == 0 or state.step == config.train.steps:
                checkpoint(pool, config, state)
            if config.eval.every and state.step % config.eval.every == 0:
                evaluate(pool, config, log, state, time.monotonic() - start)
        if not state.history or state.history[-1]["step"] != state.step:
            evaluate(pool, config, log, state, time.monotonic() - start)
        checkpoint(pool, config, state)
    finally:
        pool.shutdown()
        log.close()
    summary = run_summary(config, state)
    log.write("summary", summary)
    plot_run(run_dir)
    console.print(summary_table(summary))
    return summary


def collect_groups(
    pool: ResourcePool, config: RunConfig, state: RunState, pending: list[GroupReport]
) -> tuple[list[GroupReport], list[GroupReport]]:
    """Groups with reward spread for one step, generated with the current weights. Zero-spread groups
    carry no gradient: generate more (DAPO dynamic sampling) for up to `max_resample_rounds` rounds,
    sizing each round by the spread rate seen so far. Every group, used or not, is in the store."""
    want, reports = config.rollout.groups_per_step, []
    usable = pending[:want]
    del pending[: len(usable)]
    for _ in range(1 + config.rollout.max_resample_rounds):
        missing = want - len(usable)
        spread_rate = sum(r.has_spread for r in reports) / len(reports) if reports else 1.0
        n = min(2 * want, math.ceil(missing / max(spread_rate, 0.25)))
        seeds = list(range(state.next_seed, state.next_seed + n))
        state.next_seed += n
        if state.next_seed >= EVAL_SEED_BASE:
            raise RuntimeError("training task seeds ran into the held-out range")
        chunks = [seeds[i :: len(pool.rollout)] for i in range(len(pool.rollout))]
        new = [
            r
            for batch in ray.get(
                [w.generate.remote(c) for w, c in zip(pool.rollout, chunks, strict=True) if c]
            )
            for r in batch
        ]
        reports += new
        usable += [r for r in new if r.has_spread]
        if len(usable) >= want:
            break
    return usable[:want], reports


def leftover_groups(pool: ResourcePool, state: RunState) -> list[GroupReport]:
    """Groups stored but never trained on (a run killed between generation and training), generated by
    the current weights: sync mode trains on those first. Older ones stay in the store."""
    stored = [g for g in ray.get(pool.replay.fresh.remote()) if g.policy_version == state.version]
    return [r for r in (report_group(g.episodes, 0.0) for g in stored) if r.has_spread]


def sync_weights(pool: ResourcePool, version: int) -> None:
    """Trainer rank 0's full weights to every engine, tagged `version`."""
    state_dict = ray.get([t.state_dict.remote() for t in pool.trainers])[0]
    ref = ray.put(state_dict)
    versions = ray.get([w.update_weights.remote(ref, version) for w in pool.rollout])
    if any(v != version for v in versions):
        raise RuntimeError(f"engines report weight versions {versions}, expected {version}")


def checkpoint(pool: ResourcePool, config: RunConfig, state: RunState) -> None:
    extra = {"run_state": asdict(state)}
    root = str(config.run_dir / "checkpoints")
    ray.get([t.save_checkpoint.remote(root, extra, config.train.keep_checkpoints) for t in pool.trainers])
    ray.get(pool.replay.set_cursor.remote("run_state", {"step": state.step, "next_seed": state.next_seed}))


def evaluate(pool: ResourcePool, config: RunConfig, log: RunLog, state: RunState, wall_s: float) -> None:
    if not config.eval.episodes:
        return
    result = ray.get(pool.rollout[0].evaluate.remote(config.eval.episodes, EVAL_SEED_BASE))
    record = {
        "step": state.step,
        "version": state.version,
        "success_rate": result["success_rate"],
        "reward_mean": result["reward_mean"],
        "episodes": result["episodes"],
        "eval_s": result["seconds"],
        "wall_s": wall_s,
        "generated_tokens": state.generated_tokens,
    }
    state.history.append(record)
    log.eval(record)


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def step_record(
    state: RunState,
    reports: list[GroupReport],
    used: list[GroupReport],
    train_metrics: dict[str, float],
    times: tuple[float, float, float, float],
) -> dict[str, Any]:
    t0, t1, t2, t3 = times
    rewards = [x for r in reports for x in r.rewards]
    successes = [x for r in reports for x in r.successes]
    turns = [float(x) for r in reports for x in r.turns]
    latencies = [x for r in reports for x in r.tool_latencies_ms]
    generated = sum(r.generated_tokens for r in reports)
    state.generated_tokens += generated
    state.trained_tokens += train_metrics["trained_tokens"]
    statuses: dict[str, int] = {}
    for r in reports:
        for s in r.statuses:
            statuses[s] = statuses.get(s, 0) + 1
    return {
        "step": state.step,
        "version": state.version,
        "wall_s": state.wall_s,
        "reward_mean": sum(rewards) / max(1, len(rewards)),
        "success_rate": sum(successes) / max(1, len(successes)),
        "groups_generated": len(reports),
        "groups_trained": len(used),
        "zero_spread_share": 1 - sum(r.has_spread for r in reports) / max(1, len(reports)),
        "generated_tokens": state.generated_tokens,
        "step_generated_tokens": generated,
        "generated_tokens_per_s": generated / max(t1 - t0, 1e-9),
        "trained_tokens_per_s": train_metrics["trained_tokens"] / max(t2 - t1, 1e-9),
        "rollout_s": t1 - t0,
        "train_s": t2 - t1,
        "sync_s": t3 - t2,
        "staleness_max": max((state.version - 1 - g.policy_version for g in used), default=0),
        "turns_p50": _quantile(turns, 0.5),
        "turns_p90": _quantile(turns, 0.9),
        "turns_max": max(turns, default=0.0),
        "tool_latency_p50_ms": _quantile(latencies, 0.5),
        "tool_latency_p99_ms": _quantile(latencies, 0.99),
        **{f"status_{k}": v for k, v in statuses.items()},
        **{k: v for k, v in train_metrics.items() if k != "train_s"},
    }


def out_of_time(config: RunConfig, state: RunState) -> bool:
    return config.train.seconds is not None and state.wall_s >= config.train.seconds


def run_summary(config: RunConfig, state: RunState) -> dict[str, Any]:
    evals = state.history
    first, last = (evals[0], evals[-1]) if evals else ({}, {})
    steps = max(state.step, 1)
    return {
        "run": str(config.run_dir),
        "steps": state.step,
        "minutes": round(state.wall_s / 60, 2),
        "heldout_success_start": first.get("success_rate"),
        "heldout_success_final": last.get("success_rate"),
        "heldout_success_best": max((e["success_rate"] for e in evals), default=None),
        "generated_tokens": state.generated_tokens,
        "generated_tokens_per_s": state.generated_tokens / max(state.wall_s, 1e-9),
        "trained_tokens": state.trained_tokens,
        "seconds_per_step": state.wall_s / steps,
    }
