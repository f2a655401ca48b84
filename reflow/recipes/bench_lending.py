"""`reflow bench lending`: what a lent engine costs the trainer it sits beside.

Lending (`elastic.lend`) puts a rollout engine on a trainer rank's slot; it generates while the trainer
waits for a batch and yields when a step starts. The elastic policy weighs a lend against the trainer's
slowdown beside the engine, which a run reads from its own steps (`reflow.policy.lending.LendWindow`;
`elastic.lend_overhead` is the prior before it has). This benchmark measures it on a real cluster of
the config (mode reflow, lending on): the wall time of one train step, seen from the driver, under
three conditions, the rollout workers generating throughout as they do in a run:

- `alone`: the lent engine idle (its weights and memory held, as beside any step of a lending run:
  the benchmark measures what the engine's activity costs, not its presence);
- `yields`: the lent engine generates until the step, pauses for it (requests aborted, tokens kept:
  `RolloutWorker.pause_episodes`) and resumes after it; the time counts the pause's round trip. This
  is lending's normal case;
- `runs_on`: the lent engine generates through the step (a lent group older than `replay.eta` runs
  on beside it).

A round takes `--steps` train steps in each condition, in an order that rotates from round to round
(drift in the machine's speed falls on every condition alike); each engine runs as many groups at once
as a run's loop gives it (`rollout.max_batch_size // rollout.group_size`); every step trains the same
batch of stored groups, so the work per step is the same. Each round gives one ratio per condition to `alone`
(mean step seconds); the report is their geometric mean with its 95% interval over the rounds, and
the overhead o = 1 - t_alone / t_condition (the figures behind `elastic.lend_overhead`'s prior and the
simulator's `sync.lend_beside_slowdown`). Nothing here is trained for keeps: the run folder is scratch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reflow.recipes.bench_stats import Interval, geometric_interval, mean_interval

# Ray is imported where it is used: `reflow --help` builds this command's parser without it

CONDITIONS = ("alone", "yields", "runs_on")
FILL_ROUNDS = 20
"""Rounds of generation the benchmark tries for a batch of groups with reward spread before it gives up."""


@dataclass(frozen=True)
class ConditionResult:
    """One condition's step seconds over the rounds, and its ratio to `alone` (None for `alone`)."""

    name: str
    step_s: Interval
    ratio: Interval | None

    @property
    def overhead(self) -> float | None:
        """o = 1 - t_alone / t_condition, from the geometric-mean ratio."""
        return None if self.ratio is None else 1.0 - 1.0 / self.ratio.mean


def summarize(rounds: list[dict[str, list[float]]]) -> list[ConditionResult]:
    """Per condition: the mean step seconds over rounds (each round's mean) with its interval, and the
    geometric mean of the per-round ratios to `alone` with its interval."""
    means = [{c: statistics.fmean(r[c]) for c in CONDITIONS} for r in rounds]
    out = []
    for c in CONDITIONS:
        step_s = mean_interval(m[c] for m in means)
        assert step_s is not None  # at least one round
        ratio = None if c == "alone" else geometric_interval(m[c] / m["alone"] for m in means)
        out.append(ConditionResult(c, step_s, ratio))
    return out


def order(round_index: int) -> list[str]:
    """The conditions of a round, rotated by its index."""
    k = round_index % len(CONDITIONS)
    return [*CONDITIONS[k:], *CONDITIONS[:k]]


class Feeder:
    """Keeps `per_worker` groups generating on each of the given workers (a run's load: the loop
    starts `rollout.max_batch_size // rollout.group_size` groups on a worker): a group that ends is
    followed by the next (`top_up`) until `stop`, which waits for the ones in flight."""

    def __init__(self, workers: list[Any], seeds: Any, per_worker: int = 1) -> None:
        self.workers, self.seeds, self.per_worker = workers, seeds, per_worker
        self.refs: dict[Any, Any] = {}

    def top_up(self) -> None:
        import ray

        if self.refs:
            done, _ = ray.wait(list(self.refs), num_returns=len(self.refs), timeout=0)
            for ref in done:
                ray.get(ref)  # a failed group fails the benchmark: its figures would be off
                del self.refs[ref]
        for worker in self.workers:
            for _ in range(self.per_worker - sum(w is worker for w in self.refs.values())):
                self.refs[worker.generate.remote([next(self.seeds)])] = worker

    def stop(self) -> None:
        import ray

        ray.get(list(self.refs))
        self.refs = {}


def timed_step(cluster: Any, ids: list[str], step: int, feeders: list[Feeder]) -> float:
    """One train step on `ids`, the feeders kept generating meanwhile; its wall seconds."""
    import ray

    t0 = time.monotonic()
    refs = cluster.start_train_step(ids, step)
    pending = list(refs)
    while pending:
        for feeder in feeders:
            feeder.top_up()
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=0.05)
    ray.get(refs)  # a failed step fails the benchmark
    return time.monotonic() - t0


def measure(
    cluster: Any, ids: list[str], rounds: int, steps: int, seeds: Any, echo: Any, per_worker: int = 1
) -> list[dict[str, list[float]]]:
    """Step seconds per condition per round (module docstring); two warm-up steps first."""
    import ray

    rollout, lent = Feeder(cluster.rollout, seeds, per_worker), Feeder(cluster.lent, seeds, per_worker)
    rollout.top_up()
    step = 0
    for _ in range(2):  # warm-up: allocator and thread pools settle
        step += 1
        timed_step(cluster, ids, step, [rollout])
    results: list[dict[str, list[float]]] = []
    for r in range(rounds):
        got: dict[str, list[float]] = {c: [] for c in CONDITIONS}
        for condition in order(r):
            for _ in range(steps):
                step += 1
                if condition == "alone":
                    got[condition].append(timed_step(cluster, ids, step, [rollout]))
                    continue
                lent.top_up()
                time.sleep(1.0)  # the lent engine is past its groups' first prefill when the step comes
                t0 = time.monotonic()
                if condition == "yields":
                    ray.get([w.pause_episodes.remote() for w in cluster.lent])
                    seconds = (time.monotonic() - t0) + timed_step(cluster, ids, step, [rollout])
                    ray.get([w.resume_episodes.remote() for w in cluster.lent])
                else:
                    seconds = timed_step(cluster, ids, step, [rollout, lent])
                got[condition].append(seconds)
                lent.stop()  # the next condition starts from an idle lent engine
        results.append(got)
        means = "  ".join(f"{c} {statistics.fmean(got[c]):.3f} s" for c in CONDITIONS)
        echo(f"round {r + 1}/{rounds}: {means}")
    rollout.stop()
    return results


def batch(cluster: Any, groups: int, seeds: Any, per_worker: int = 1) -> list[str]:
    """Ids of `groups` stored groups with reward spread (what a train step trains), generated
    `per_worker` groups a rollout worker at a time."""
    ids: list[str] = []
    for _ in range(FILL_ROUNDS):
        reports = cluster.generate([next(seeds) for _ in range(per_worker * len(cluster.rollout))])
        ids += [r.group_id for r in reports if r.has_spread]
        if len(ids) >= groups:
            return ids[:groups]
    raise RuntimeError(
        f"{FILL_ROUNDS} rounds of generation gave {len(ids)} of {groups} groups with reward spread"
    )


def table(results: list[ConditionResult], rounds: int, steps: int, load: tuple[float, float]) -> str:
    def iv(i: Interval | None, fmt: str) -> str:
        if i is None:
            return "-"
        if i.low is None or i.high is None:
            return format(i.mean, fmt)
        return f"{i.mean:{fmt}} [{i.low:{fmt}}, {i.high:{fmt}}]"

    lines = [
        f"train step seconds beside a lent engine ({rounds} rounds x {steps} steps a condition; "
        f"load average {load[0]:.2f} before, {load[1]:.2f} after)",
        "",
        "| condition | step s (95% interval) | / alone (95% interval) | overhead o |",
        "| --- | --- | --- | --- |",
    ]
    for r in results:
        o = "-" if r.overhead is None else f"{r.overhead:.1%}"
        lines.append(f"| {r.name} | {iv(r.step_s, '.3f')} | {iv(r.ratio, '.3f')} | {o} |")
    return "\n".join(lines)


def cmd_bench_lending(args: argparse.Namespace) -> int:
    import itertools
    import os

    import ray

    from reflow.config import load_config
    from reflow.console import console
    from reflow.errors import UsageError
    from reflow.recipes.initial_model import prepare_model
    from reflow.recipes.run_log import RunLog
    from reflow.recipes.weight_sync import sync_weights
    from reflow.runtime.cluster import Cluster, start_ray

    if args.rounds < 2 or args.steps < 1:
        raise UsageError(f"--rounds {args.rounds} --steps {args.steps}: at least 2 rounds of 1 step")
    out = Path(args.out)
    overrides = [*args.overrides, "mode=reflow", "elastic.lend=true", f"out_dir={out}", "run_name=scratch"]
    config = load_config(args.config, overrides)
    load_before = os.getloadavg()[0]
    start_ray(config)
    log = RunLog(config.run_dir, console, live=False)
    model_path, _, _ = prepare_model(config, config.run_dir, log, resume=False)
    cluster = Cluster(config, model_path, config.run_dir)
    seeds = itertools.count(10**6)  # task seeds apart from a training run's
    try:
        sync_weights(cluster, 0)
        per_worker = max(1, config.rollout.max_batch_size // config.rollout.group_size)
        ids = batch(cluster, config.rollout.groups_per_step, seeds, per_worker)
        rounds = measure(cluster, ids, args.rounds, args.steps, seeds, console.print, per_worker)
    finally:
        cluster.shutdown()
        log.close(0)
        ray.shutdown()
    results = summarize(rounds)
    load = (load_before, os.getloadavg()[0])
    markdown = table(results, args.rounds, args.steps, load)
    report = {
        "config": args.config,
        "overrides": args.overrides,
        "rounds": rounds,
        "load_average": load,
        "results": [
            {"condition": r.name, "step_s": r.step_s.__dict__, "ratio": r.ratio and r.ratio.__dict__,
             "overhead": r.overhead}
            for r in results
        ],
    }  # fmt: skip
    (out / "bench_lending.json").write_text(json.dumps(report, indent=1))
    (out / "bench_lending.md").write_text(markdown + "\n")
    console.print(markdown)
    return 0


def add_parser(bench_sub: argparse._SubParsersAction) -> None:
    p = bench_sub.add_parser(
        "lending",
        help="a train step's seconds with and without a lent engine beside the trainer",
        description="Time train steps on one stored batch with the lent engine idle, yielding at the step "
        "(lending's normal case) and running on through it; rounds rotate the order; ratios to idle "
        "with 95% intervals, and the overhead each implies.",
    )
    p.add_argument("--config", help="the run config (default: the built-in defaults)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")
    p.add_argument("--rounds", type=int, default=8, help="rounds (each gives one ratio per condition)")
    p.add_argument("--steps", type=int, default=2, help="train steps per condition per round")
    p.add_argument("--out", default="runs/bench-lending", help="results: bench_lending.md and .json")
    p.set_defaults(fn=cmd_bench_lending)
