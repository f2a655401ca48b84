"""The loop's position and its clock, and the task seeds each round draws: `RunState` (saved with every
checkpoint), `Clock`, the learnability filter's bookkeeping and the time budget.

Time: `RunState.wall_s` is training wall-clock with evaluation excluded (evaluation is a measurement,
not training), so success-vs-time curves of different modes compare what each mode's training costs.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from reflow.config import RunConfig
from reflow.policy.task_selection import LearnabilityFilter, round_size
from reflow.rollout.collect import EVAL_SEED_BASE

if TYPE_CHECKING:  # the workers module imports Ray: not needed to read or write a run state
    from reflow.runtime.workers import GroupReport


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
    """Sampled tokens trained on, every use of a replayed group counted again."""
    new_trained_tokens: float = 0.0
    """Sampled tokens of groups trained for the first time: new work, replays not counted."""
    rollout_busy_s: float = 0.0
    """Summed over rollout workers: time with at least one episode group in flight."""
    rollout_slot_s: float = 0.0
    """Rollout slot-seconds offered so far: the rollout slot count integrated over training time, up to
    `slots_counted_s` (`count_rollout_slots`; the elastic pool changes the count during a run)."""
    slots_counted_s: float = 0.0
    trainer_busy_s: float = 0.0
    episode_s: float = 0.0
    """Summed over the episodes of every group the loop received: their durations."""
    env_s: float = 0.0
    """The part of `episode_s` spent in the envs (tool calls, sandboxes, grading)."""
    tool_calls: int = 0
    malformed_calls: int = 0
    """Of `tool_calls` (those of every group the loop received), the ones whose text did not parse."""
    steps_no_signal: int = 0
    """Steps not taken: no group with reward spread, or no sampled token in the batch (no gradient);
    weights and version stayed."""
    staleness_hist: dict[str, int] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    snapshots: list[dict[str, Any]] = field(default_factory=list)
    """Deferred evaluation points (step, version, wall_s, generated_tokens); weights kept aside."""
    task_stats: dict[str, dict[str, Any]] = field(default_factory=dict)
    """The learnability filter's per-task pass rates (`tasks.learnability`; reflow.policy.task_selection)."""
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
    lent_busy_s: float = 0.0
    """Summed over the engines lent beside the trainer ranks (`elastic.lend`): time generating."""
    lent_stored_s: float = 0.0
    """Of `lent_busy_s`, the seconds up to each lent engine's last group stored (the rest produced
    nothing: the train slot's idle time counts it)."""
    lent_yields: int = 0
    """Step starts at which a lent engine yielded its slot to the trainer (its requests aborted)."""
    lent_handed_over: int = 0
    """Episodes lent engines handed over to rollout engines with room at a yield, instead of pausing."""
    lineage: int = 0
    """The replay store's lineage of these weights: a resumed run forks a new one from its
    checkpoint's (`ReplayStore.start_lineage`), so no (lineage, version) names two weight sets."""
    scheduler: dict[str, Any] = field(default_factory=dict)
    """The loop's adaptive state at the last checkpoint, so a resume restores it: the recent group and
    episode durations (the tail's quantiles, the budget's estimate) and each engine's concurrency
    limit; in the decoupled modes also the replay share and its history, the elastic pool's measured
    costs and last change, and the slot layout (`recipes.decoupled`, `recipes.sync_tail`)."""
    groups_quarantined: int = 0
    """Groups in the store made by weights a resume lost (never trained), after the last resume."""

    def count_rollout_slots(self, n: int, now_s: float) -> None:
        """`n` rollout slots held since the last count, up to training second `now_s`: call it before
        the count changes and before reading idle ratios."""
        self.rollout_slot_s += n * max(0.0, now_s - self.slots_counted_s)
        self.slots_counted_s = max(self.slots_counted_s, now_s)


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
    learnable = task_filter(config, state) if config is not None else None
    revisits = learnable.pick(n, random.Random(state.next_seed)) if learnable else []
    seeds = revisits + list(range(state.next_seed, state.next_seed + n - len(revisits)))
    state.next_seed += n - len(revisits)
    if state.next_seed >= EVAL_SEED_BASE:
        raise RuntimeError("training task seeds ran into the held-out range")
    if learnable:
        learnable.start(seeds)
    return seeds


def observe_tasks(
    config: RunConfig, state: RunState, seeds: list[int], reports: list[GroupReport], workers: int = 1
) -> None:
    """Each group's successes to the learnability filter (a no-op with `tasks.learnability` off).
    `reports` come as `Cluster.generate(seeds)` returns them: the seeds dealt round-robin over
    `workers` rollout workers, then worker by worker."""
    learnable = task_filter(config, state)
    if learnable is None:
        return
    dealt = [s for i in range(workers) for s in seeds[i::workers]]
    if len(dealt) != len(reports):
        raise ValueError(f"{len(dealt)} seeds for {len(reports)} group reports")
    for seed, report in zip(dealt, reports, strict=True):
        learnable.observe(seed, report.successes)


def spread_round_size(want: int, missing: int, reports: list[GroupReport]) -> int:
    """How many groups to generate for `missing` groups with reward spread, from the spread rate so far."""
    return round_size(want, missing, sum(r.has_spread for r in reports), len(reports))


def took_step(state: RunState, train_metrics: dict[str, Any]) -> bool:
    """Count a train step in the run state, the one place both loops do it: step and version up. A
    step with no sampled token on any rank (`updates` 0: the trainer changed neither its weights nor
    its version) counts as `steps_no_signal` instead and leaves them, so the loop's version stays the
    trainer's and no weights are pushed. Returns whether the step was taken."""
    if not train_metrics["updates"]:
        state.steps_no_signal += 1
        return False
    state.step, state.version = state.step + 1, state.version + 1
    return True


def steps_left(state: RunState, steps: int) -> bool:
    """Whether the run may take another step: steps taken and not taken (no signal) count towards
    `train.steps`, so a run that gets no signal any more cannot loop forever."""
    return state.step + state.steps_no_signal < steps


def out_of_time(budget_s: float | None, now_s: float, next_s: float = 0.0) -> bool:
    """Whether work expected to take `next_s` seconds, started at training second `now_s`, would not
    finish inside the budget `budget_s` (`train.seconds`; None: no budget). With next_s = 0: whether
    the budget is spent. The loops pass their estimate of the next step (or collection) so that they
    do not start work that would overrun the budget."""
    if budget_s is None:
        return False
    return now_s >= budget_s or now_s + next_s > budget_s
