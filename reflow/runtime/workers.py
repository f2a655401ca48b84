"""A run's rollout workers (an engine plus env instances), Ray actors; the trainer ranks are
`reflow.runtime.trainer_rank`.

A plain class, made remote by `reflow.runtime.cluster` on a device slot, so it can also be used
in-process (tests, debugging). A rollout worker plays GRPO groups, fixes each group's advantages and
stores it durably in the replay store before reporting it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from reflow.config import RunConfig
from reflow.engine import GenerateResult, SamplingParams
from reflow.env import make
from reflow.env.registration import load_env_plugin
from reflow.env.wrappers import MalformedCallPenalty
from reflow.metrics import ENGINE_COUNTERS
from reflow.records import EpisodeRecord
from reflow.rollout.episode import EpisodeRunner, RolloutConfig, run_group
from reflow.runtime.worker_tail import WorkerTail, engine_name
from reflow.train.advantages import group_advantages, has_spread, train_mask


@dataclass
class GroupReport:
    """What the loop needs to know about a stored group, without shipping its records around."""

    group_id: str
    policy_version: int
    rewards: list[float]
    successes: list[bool]
    statuses: list[str]
    turns: list[int]
    generated_tokens: int
    has_spread: bool
    seconds: float
    tool_latencies_ms: list[float] = field(default_factory=list)
    episode_seconds: list[float] = field(default_factory=list)
    """Each episode's duration less the time it waited paused (the tail scheduler's remaining-time
    estimate)."""
    env_seconds: list[float] = field(default_factory=list)
    """Each episode's time in its env (tool calls, sandboxes, grading), the rest being generation."""
    tool_calls: int = 0
    malformed_calls: int = 0
    """Tool calls whose text did not parse (the parser's `parse_error`): a rising share is the first
    sign of a policy losing its call format."""


def torch_threads(config: RunConfig) -> int:
    """Torch threads of an actor on one slot (a rollout worker or a trainer rank)."""
    if config.resources.threads_per_slot:
        return config.resources.threads_per_slot
    cores = os.cpu_count() or 1
    if config.mode == "sync":  # rollout and training take turns: each may use every core
        return cores
    return max(1, cores // len(config.resources.slots))  # they overlap: split the cores between slots


def _sampling(
    config: RunConfig,
    temperature: float | None = None,
    max_new_tokens: int | None = None,
    seed: int | None = None,
) -> SamplingParams:
    """The rollout's sampling parameters; `temperature` overrides the rollout's (0: greedy); `seed`
    (None: unseeded) is the base each episode's and turn's seed derives from (`SamplingParams.child`)."""
    r = config.rollout
    return SamplingParams(
        max_new_tokens=max_new_tokens or r.max_new_tokens,
        temperature=r.temperature if temperature is None else temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        stop=list(r.stop),
        seed=seed,
    )


def active_seconds(record: EpisodeRecord) -> float:
    """An episode's duration less the time it waited paused through train steps."""
    return max(0.0, float(record.timings.get("total_s", 0.0)) - float(record.timings.get("paused_s", 0.0)))


def report_group(records: list[EpisodeRecord], seconds: float) -> GroupReport:
    rewards = [r.reward for r in records]
    # tool results are `ToolResult` dicts (latency_s); a custom env may report other shapes
    latencies = [
        1000.0 * res["latency_s"]
        for rec in records
        for turn in rec.turns
        for res in turn.tool_results
        if isinstance(res, dict) and "latency_s" in res
    ]
    calls = [call for rec in records for turn in rec.turns for call in turn.tool_calls]
    return GroupReport(
        group_id=records[0].group_id,
        policy_version=min(r.oldest_version for r in records),
        rewards=rewards,
        successes=[r.success for r in records],
        statuses=[r.status for r in records],
        turns=[r.n_turns for r in records],
        generated_tokens=sum(r.n_generated_tokens for r in records),
        has_spread=has_spread(rewards, mask=train_mask([r.status for r in records])),
        seconds=seconds,
        tool_latencies_ms=latencies,
        episode_seconds=[active_seconds(r) for r in records],
        env_seconds=[float(r.timings.get("env_s", 0.0)) for r in records],
        tool_calls=len(calls),
        malformed_calls=sum(1 for c in calls if isinstance(c, dict) and c.get("parse_error")),
    )


class RolloutWorker:
    """An inference engine plus env instances on one device slot (an async Ray actor). Its episodes
    generate through migratable routes over its engine behind a concurrency limit (`WorkerTail`)."""

    def __init__(self, config: RunConfig, model_path: str, replay: Any, index: int = 0) -> None:
        import torch

        from reflow.runtime.engines import build_engine

        torch.set_num_threads(torch_threads(config))
        self.config, self.replay, self.index, self.model_path = config, replay, index, model_path
        self._calls_in_flight = 0
        self._load_plugins()
        self.engine, self.tokenizer = build_engine(config, model_path, index)
        r = config.rollout
        self.tail = WorkerTail(self.engine, engine_name(index), r.max_batch_size, self._decode)
        self.runner = EpisodeRunner(
            self.tail.limited,
            self.tokenizer,
            RolloutConfig(
                sampling=_sampling(config),
                max_context_tokens=r.max_context_tokens,
                max_generated_tokens=r.max_generated_tokens,
                deadline_s=r.episode_deadline_s,
                max_turns=r.max_turns,
            ),
            routes=self.tail.routes,
        )

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def _make_env(self) -> Any:
        env = make(self.config.env.id, **self.config.env.kwargs)
        penalty = self.config.env.malformed_call_penalty
        return MalformedCallPenalty(env, penalty) if penalty else env

    def _load_plugins(self) -> None:
        for spec in self.config.env.plugins:
            load_env_plugin(spec)

    async def generate(self, seeds: list[int], group_ids: list[str] | None = None) -> list[GroupReport]:
        """One group per task seed, all in flight together; each is durable in the store on return.
        `group_ids` name groups registered in flight beforehand (admission control)."""
        adv_scale = self.config.train.advantage_scale
        self.tail.start_sampling()

        async def one(seed: int, group_id: str | None) -> GroupReport:
            start = time.monotonic()
            try:
                records = await run_group(
                    self.runner, self._make_env, self.config.rollout.group_size, seed=seed, group_id=group_id
                )
            except BaseException:
                if group_id is not None:  # never arrives: free its admission slot
                    await self.replay.end_group.remote(group_id)
                raise
            statuses = [r.status for r in records]
            advantages = group_advantages(
                [r.reward for r in records], scale=adv_scale, mask=train_mask(statuses)
            )
            await self.replay.add_group.remote(records, advantages, meta={"seed": seed, "worker": self.index})
            return report_group(records, time.monotonic() - start)

        ids = group_ids or [None] * len(seeds)
        async with self._episodes():
            return list(await asyncio.gather(*(one(s, g) for s, g in zip(seeds, ids, strict=True))))

    @contextlib.asynccontextmanager
    async def _episodes(self) -> AsyncIterator[None]:
        """Around each call that runs episodes on this engine (migrated-in requests too): in sync mode,
        when the last one in flight ends, the engine hands its KV memory back (finished episodes'
        prefixes serve no later request, and the trainer's step runs next, on the same machine's
        memory). The decoupled modes keep it: their rollouts run on, and freeing it after each group
        would only rebuild it."""
        self._calls_in_flight += 1
        try:
            yield
        finally:
            self._calls_in_flight -= 1
            if self._calls_in_flight == 0 and self.config.mode == "sync":
                await self._release_cache()

    async def _release_cache(self) -> None:
        """The engine hands its KV memory back if nothing runs (TorchEngine; SGLang's pool is fixed)."""
        release = getattr(self.engine, "release_cache", None)
        if release is not None:
            await release()

    # -- the tail scheduler's calls (`reflow.runtime.worker_tail`) ------------------------------------------

    async def progress(self) -> dict[str, Any]:
        """Episodes in flight, the engine's limit, curve and prefill rate, migrations measured."""
        return await self.tail.progress()

    async def migrate(self, episode: str, target: Any, target_name: str) -> dict[str, Any]:
        """Move one of this worker's episodes to `target_name`'s engine (`target`: its actor handle)."""
        return await self.tail.migrate(episode, target, target_name)

    async def set_concurrency(self, limit: int) -> int:
        return await self.tail.set_concurrency(limit)

    async def pause_episodes(self) -> int:
        """Sync mode's partial rollouts: no episode generates until `resume_episodes` (requests in flight
        aborted, their tokens kept); the engine's KV memory goes back meanwhile. The episodes paused."""
        # its own episodes' requests and those migrated in from other workers' pause together
        paused, _ = await asyncio.gather(self.tail.routes.pause(), self.tail.pause_served())
        await self._release_cache()  # a no-op while an aborted request is still winding down
        return paused

    async def yield_episodes(
        self, target: Any = None, target_name: str = "", hand_over: int = 0, target_version: int | None = None
    ) -> dict[str, Any]:
        """A lent engine's yield at a train step's start: up to `hand_over` of its episodes move to
        `target_name`'s engine (`target`: that rollout worker's actor handle, holding weights
        `target_version`) and go on there, through the step and after it; the rest pause as
        `pause_episodes`. Returns the episodes moved per group and how many paused, with
        `lent_report`'s. A lent engine yields through this call even with nothing to hand over: its
        report keeps the loop's books on what runs where."""
        moved = {}
        if hand_over > 0 and target is not None:
            moved = await self.tail.routes.hand_over(target, target_name, hand_over, target_version)
        paused = await self.pause_episodes()
        return {"moved": moved, "paused": paused, **await self.lent_report()}

    async def lent_report(self) -> dict[str, Any]:
        """What runs where of a lent engine's groups: episodes per group on its own engine (`home`),
        those handed over and still running elsewhere (`away`, per group and engine name), and the
        migrations measured since the last report (this worker's hand-overs: the tail polls only
        rollout workers)."""
        routes = self.tail.routes
        return {"home": routes.at_home(), "away": routes.away(), "migrations": routes.take_measured()}

    async def resume_episodes(self) -> None:
        """The paused episodes resubmit their prefixes, on the engine's weights now."""
        self.tail.routes.resume()

    async def engine_generate(
        self, input_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> GenerateResult:
        """Generate for an episode another worker migrated here (under this worker's limit)."""
        async with self._episodes():
            return await self.tail.engine_generate(input_ids, params, request_id)

    async def engine_abort(self, request_id: str) -> None:
        await self.tail.engine_abort(request_id)

    async def update_weights(self, state_dict: dict[str, Any], version: int, rewind: bool = False) -> int:
        """Load the policy of `version` into the engine; returns the version the engine confirms. An older
        version than the engine's is refused (ValueError) unless `rewind` (a snapshot evaluated after
        the run): calls to this async actor are not ordered, the loop orders them (`WeightPusher`)."""
        from reflow.runtime.engines import load_policy

        return await load_policy(
            self.engine, self.config, self.model_path, self.index, state_dict, version, rewind=rewind
        )

    async def held_out(
        self,
        episodes: int,
        seed: int,
        temperature: float,
        samples: int,
        progress: Callable[[int, int], None] | None = None,
        first_task: int = 0,
    ) -> list[EpisodeRecord]:
        """`samples` episodes on each of `episodes` held-out tasks (task seeds from `seed` +
        `first_task`: a long measurement in parts plays the same episodes as in one go), at
        `temperature` (0: greedy), on `eval.env_kwargs` (None: the env's kwargs). Sampled episodes
        are seeded from `seed`, the task seed and the sample index (`SamplingParams.child`): the same
        weights measure the same figures in every run, and the start and end measurements of a run
        draw the same noise, so their difference is the policy's, not the dice's."""
        from reflow.rollout.collect import collect

        ev = self.config.eval
        sampling = _sampling(self.config, temperature, ev.max_new_tokens, seed=seed)
        runner = EpisodeRunner(self.engine, self.tokenizer, RolloutConfig(sampling=sampling))
        async with self._episodes():
            return await collect(
                runner,
                self.config.env.id,
                episodes * samples,
                group_size=samples,
                seed=seed + first_task,
                concurrency=self.config.rollout.max_batch_size,
                env_kwargs=self.config.held_out_env_kwargs,
                progress=progress,
            )

    async def headroom(self, episodes: int, seed: int, k: int) -> dict[str, Any]:
        """On `episodes` held-out tasks: one greedy episode and `k` at the rollout's temperature each;
        greedy success, mean@k sampled success, pass@k and the RL headroom (`rl_headroom`, as
        `reflow rollout --eval --pass-at K` reports them)."""
        from reflow.rollout.collect import rl_headroom

        start = time.monotonic()
        greedy = await self.held_out(episodes, seed, 0.0, 1)
        sampled = await self.held_out(episodes, seed, self.config.rollout.temperature, k)
        return {**rl_headroom(greedy, sampled), "seconds": time.monotonic() - start}

    async def evaluate(self, episodes: int, seed: int) -> dict[str, Any]:
        """Success on the fixed held-out task set (task seeds from `seed`): greedy, or with
        `eval.temperature` > 0 the mean over `eval.samples` sampled episodes per task."""
        from reflow.rollout.collect import summarize

        ev = self.config.eval
        start = time.monotonic()
        records = await self.held_out(episodes, seed, ev.temperature, ev.samples)
        return {
            **summarize(records, time.monotonic() - start),
            "tasks": episodes,
            "samples": ev.samples,
            "temperature": ev.temperature,
        }

    async def weight_version(self) -> int:
        return self.engine.weight_version

    async def engine_counters(self) -> dict[str, float]:
        """The engine's cumulative work counters (`ENGINE_COUNTERS` and `started_at`, TorchEngine's
        `counters()`), {} for an engine that keeps none (SGLang's): the run's summary reads how its
        time went from them (`reflow.metrics.engine_use`)."""
        read = getattr(self.engine, "counters", None)
        counters = read() if read is not None else {}
        if not all(k in counters for k in (*ENGINE_COUNTERS, "started_at")):
            return {}
        return {k: counters[k] for k in (*ENGINE_COUNTERS, "started_at")}

    async def close(self) -> None:
        await self.engine.close()
