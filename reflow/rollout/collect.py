"""Many episodes at once: task groups in flight on one engine, their summary, and the greedy held-out
evaluation every recipe and the training loop share (a fixed task set: seeds from `EVAL_SEED_BASE`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from reflow.engine import Engine, SamplingParams
from reflow.env import make
from reflow.env.play import episode_stats
from reflow.records import EpisodeRecord
from reflow.rollout.episode import EpisodeRunner, RolloutConfig, run_group

EVAL_SEED_BASE = 1_000_000
"""Held-out tasks use seeds from here on; training draws its seeds below it."""
DEMO_SEED_BASE = 2_000_000
"""Warm-start demonstrations use seeds from here on, so the RL phase never trains on (or re-rewards) a
problem the warm start memorised: a generated task is a function of its seed."""


async def collect(
    runner: EpisodeRunner,
    env_id: str,
    episodes: int,
    *,
    group_size: int = 1,
    seed: int = 0,
    concurrency: int = 32,
    env_kwargs: dict[str, Any] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> list[EpisodeRecord]:
    """`episodes` episodes in groups of `group_size` (task seed = seed + group index), at most
    `concurrency` episodes in flight at once on the runner's engine (at least one group): a group starts,
    in order, once its episodes all have a place, and each episode hands its place back as it ends,
    so a group's stragglers hold no place of its finished episodes. `progress(groups done, groups)`
    after each group."""
    n_groups = max(1, episodes // group_size)
    places = asyncio.Semaphore(max(group_size, concurrency))
    starting = asyncio.Lock()  # one group takes its places at a time: no two wait half-placed
    done = 0

    async def one(g: int) -> list[EpisodeRecord]:
        nonlocal done
        async with starting:
            for _ in range(group_size):
                await places.acquire()
        returning = _Returning(runner, places, group_size)
        try:
            group = await run_group(
                returning, lambda: make(env_id, **(env_kwargs or {})), group_size, seed=seed + g
            )
        finally:
            returning.give_back_rest()
        done += 1
        if progress is not None:
            progress(done, n_groups)
        return group

    groups = await asyncio.gather(*(one(g) for g in range(n_groups)))
    return [rec for group in groups for rec in group]


class _Returning:
    """An episode runner that hands one of `collect`'s places back as each episode it plays ends."""

    def __init__(self, runner: EpisodeRunner, places: asyncio.Semaphore, held: int) -> None:
        self.runner, self.places, self.held = runner, places, held
        self.config = runner.config

    async def run(self, *args: Any, **kwargs: Any) -> EpisodeRecord:
        try:
            return await self.runner.run(*args, **kwargs)
        finally:
            self._give_back(1)

    def give_back_rest(self) -> None:
        """The places of episodes that never ran (the group failed before them)."""
        self._give_back(self.held)

    def _give_back(self, n: int) -> None:
        n = min(n, self.held)
        self.held -= n
        for _ in range(n):
            self.places.release()


class ProgressLines:
    """A `collect` progress callback that says, through `say`, how far a long evaluation is: a line at
    every `every` share of the tasks done, with the seconds so far and the seconds left at that pace."""

    def __init__(self, say: Callable[[str], None], what: str, every: float = 0.1) -> None:
        self.say, self.what, self.every = say, what, every
        self.start, self.next = time.monotonic(), every

    def __call__(self, done: int, total: int) -> None:
        if done / total + 1e-9 < self.next and done < total:
            return
        while self.next <= done / total + 1e-9:
            self.next += self.every
        elapsed = time.monotonic() - self.start
        left = elapsed / done * (total - done)
        self.say(
            f"{self.what}: {done}/{total} tasks ({done / total:.0%}), {elapsed:.0f} s, ~{left:.0f} s left"
        )


def summarize(records: list[EpisodeRecord], seconds: float) -> dict[str, Any]:
    stats = episode_stats(
        [r.success for r in records],
        [r.reward for r in records],
        [r.n_turns for r in records],
        [r.status for r in records],
    )
    generated = sum(r.n_generated_tokens for r in records)
    return {
        **stats,
        "generated_tokens": generated,
        "generated_tokens_per_s": generated / seconds if seconds > 0 else 0.0,
        "seconds": seconds,
    }


def summary_line(summary: dict[str, Any]) -> str:
    """`summarize`'s figures as one line of text (rich markup free)."""
    return (
        f"success {summary['success_rate']:.1%}, reward {summary['reward_mean']:.3f}, "
        f"turns p50/p90/max {summary['turns_p50']:g}/{summary['turns_p90']:g}/{summary['turns_max']}, "
        f"{summary['generated_tokens_per_s']:.0f} generated tokens/s, statuses {summary['statuses']}"
    )


def deadline_note(records: list[EpisodeRecord], half: str, keys: str) -> str | None:
    """A warning when episodes of an evaluation ended at their wall-clock deadline (status timeout):
    their count depends on the machine's speed and load, not only on the model; None when none did.
    `keys`: the settings that set the deadline, for the user to raise."""
    n = sum(r.status == "timeout" for r in records)
    if not n:
        return None
    return (
        f"{n} of {len(records)} {half} episodes hit their deadline: a slower or busier machine cuts more "
        f"of them short and the figure drops; raise {keys} to measure the model alone"
    )


def rl_headroom(greedy: list[EpisodeRecord], sampled: list[EpisodeRecord]) -> dict[str, Any]:
    """How much greedy success RL can add: the share of tasks greedy decoding fails while at least one
    of their sampled episodes succeeds.

    GRPO only learns from groups with a success, so a task no sample solves cannot become a greedy
    success, and one greedy already solves has nothing to gain; greedy success after RL is roughly
    bounded by greedy + headroom. Records pair up by task seed (`collect` on the same seed range).
    An infra_error episode counts as no success.
    """
    by_seed: dict[int | None, list[EpisodeRecord]] = {}
    for rec in sampled:
        by_seed.setdefault(rec.seed, []).append(rec)
    first_greedy: dict[int | None, EpisodeRecord] = {}
    for rec in greedy:
        first_greedy.setdefault(rec.seed, rec)
    paired = [(g, by_seed[seed]) for seed, g in first_greedy.items() if seed in by_seed]
    if not paired:
        raise ValueError("no task has both a greedy and a sampled episode (different seed ranges?)")
    n = len(paired)
    return {
        "tasks": n,
        "samples_per_task": min(len(s) for _, s in paired),
        "greedy_success": sum(g.success for g, _ in paired) / n,
        "sampled_success": sum(sum(r.success for r in s) / len(s) for _, s in paired) / n,
        "pass_at_k": sum(any(r.success for r in s) for _, s in paired) / n,
        "headroom": sum(not g.success and any(r.success for r in s) for g, s in paired) / n,
    }


async def evaluate(
    engine: Engine,
    tokenizer: Any,
    env_id: str,
    episodes: int,
    *,
    greedy: bool = True,
    seed: int = EVAL_SEED_BASE,
    max_new_tokens: int = 128,
) -> dict[str, Any]:
    """Success on a fixed held-out task set (seeds from EVAL_SEED_BASE), greedy by default."""
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0 if greedy else 1.0)
    runner = EpisodeRunner(engine, tokenizer, RolloutConfig(sampling=sampling))
    start = time.monotonic()
    records = await collect(runner, env_id, episodes, seed=seed)
    return summarize(records, time.monotonic() - start)
