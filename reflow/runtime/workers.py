"""The Ray actors of a run: rollout workers (an engine plus env instances) and trainer ranks.

Both are plain classes, made remote by `reflow.runtime.cluster` on a device slot, so they can also be used
in-process (tests, debugging). A rollout worker plays GRPO groups, fixes each group's advantages and
stores it durably in the replay store before reporting it; a trainer rank reads groups from the store,
takes its share of the rows and does one update (FSDP2 across ranks).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import ray

from reflow.config import RunConfig
from reflow.engine import GenerateResult, SamplingParams
from reflow.env import make
from reflow.env.registration import load_env_plugin
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
    """Each episode's duration (the tail scheduler's remaining-time estimate)."""
    env_seconds: list[float] = field(default_factory=list)
    """Each episode's time in its env (tool calls, sandboxes, grading), the rest being generation."""


def _threads(config: RunConfig) -> int:
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
        episode_seconds=[float(r.timings.get("total_s", 0.0)) for r in records],
        env_seconds=[float(r.timings.get("env_s", 0.0)) for r in records],
    )


class RolloutWorker:
    """An inference engine plus env instances on one device slot (an async Ray actor). Its episodes
    generate through migratable routes over its engine behind a concurrency limit (`WorkerTail`)."""

    def __init__(self, config: RunConfig, model_path: str, replay: Any, index: int = 0) -> None:
        import torch

        from reflow.runtime.engines import build_engine

        torch.set_num_threads(_threads(config))
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
        return make(self.config.env.id, **self.config.env.kwargs)

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
        """Around each call that runs episodes: when the last one in flight ends, the engine hands its
        KV memory back (finished episodes' prefixes serve no later request; in sync mode the trainer's
        step runs next, on the same machine's memory)."""
        self._calls_in_flight += 1
        try:
            yield
        finally:
            self._calls_in_flight -= 1
            release = getattr(self.engine, "release_cache", None)  # TorchEngine; SGLang's pool is fixed
            if self._calls_in_flight == 0 and release is not None:
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

    async def engine_generate(
        self, input_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> GenerateResult:
        """Generate for an episode another worker migrated here (under this worker's limit)."""
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
        self, episodes: int, seed: int, temperature: float, samples: int
    ) -> list[EpisodeRecord]:
        """`samples` episodes on each of `episodes` held-out tasks (task seeds from `seed`), at
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
                seed=seed,
                concurrency=self.config.rollout.max_batch_size,
                env_kwargs=self.config.env.kwargs if ev.env_kwargs is None else ev.env_kwargs,
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

    async def close(self) -> None:
        await self.engine.close()


class TrainerRank:
    """One trainer rank on one device slot; several ranks shard the model with FSDP2."""

    def __init__(
        self, config: RunConfig, model_path: str, replay: Any, rank: int = 0, world_size: int = 1
    ) -> None:
        self.config, self.model_path = config, model_path
        self.replay, self.rank, self.world_size = replay, rank, world_size

    def setup(self, master: tuple[str, int] | None = None) -> None:
        """Join the process group (several ranks), load the model, build the trainer. Separate from
        `__init__` because every rank must be created before rank 0 can publish its address."""
        import torch
        from transformers.utils import logging as hf_logging

        from reflow.models import load_model
        from reflow.train.distributed import init_distributed
        from reflow.train.lora import load_lora_model
        from reflow.train.trainer import PolicyTrainer

        hf_logging.disable_progress_bar()  # a progress bar per checkpoint save is noise in the run log
        config = self.config
        torch.set_num_threads(_threads(config))
        torch.manual_seed(config.seed)
        if self.world_size > 1:
            if master is None:
                raise ValueError("several trainer ranks need the rank-0 address")
            backend = "nccl" if config.resources.device == "cuda" else "gloo"
            init_distributed(self.rank, self.world_size, master[0], master[1], backend)
        lora = config.model.lora_settings()
        if lora is None:
            model, self.tokenizer = load_model(self.model_path, device=config.resources.device)
        else:  # the base with adapters (a resumed run's own; the checkpoint or `load_full_state` follows)
            model, self.tokenizer = load_lora_model(
                self.model_path, lora, device=config.resources.device, seed=config.seed
            )
        settings = config.train.trainer_config(
            behaviour_is_prox=config.mode == "sync" and not config.train.engine_correction,
            temperature=config.rollout.temperature or 1.0,
            seed=config.seed,
            lora=lora,
        )
        self.trainer = PolicyTrainer(model, self.tokenizer.pad_token_id, settings)

    def prepare(self) -> None:
        """Import what `setup` needs (torch, transformers, the trainer): a rank started by a role change
        is a ready process before the group forms, so its start is timed as actor start, not re-form."""
        import torch.distributed.fsdp  # noqa: F401
        import transformers  # noqa: F401

        import reflow.models
        import reflow.train.trainer  # noqa: F401

    def leave(self) -> None:
        """Leave the process group (every rank does, before a new group forms: `reform`, or before its
        slot goes to rollout). `shutdown_distributed`: a barrier, so no rank tears its connections down
        under a peer still in a collective, then the group goes. The actor process itself is ended by
        `ray.kill`, without the interpreter's finalization that gloo's threads do not survive."""
        from reflow.train.distributed import shutdown_distributed

        shutdown_distributed()

    def reform(self, rank: int, world_size: int, master: tuple[str, int] | None = None) -> None:
        """Join a new group as `rank` of `world_size` (the elastic pool's role change): leave the old one,
        rebuild the model from the model path and shard it anew (an FSDP2 module cannot be re-sharded
        in place). The current weights and optimizer state come after (`load_full_state`)."""
        self.leave()
        self.rank, self.world_size = rank, world_size
        self.trainer = None  # the old sharded model goes before the new one is built
        self.setup(master)

    def full_state(self) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """(full weights, the rest: optimizer state, step, version, the trainer's RNG) on rank 0, (None,
        None) elsewhere; collective: call on every rank. The optimizer state is keyed by parameter
        name whatever the world size, so a group of another size loads it (`load_full_state`)."""
        t = self.trainer
        model, optim = t.full_state_dict(), t.optimizer_state()
        if self.rank != 0:
            return None, None
        rest = {"optimizer": optim, "step": t.step, "version": t.version, "rng": t.rng.getstate()}
        return model, rest

    def load_full_state(self, model: dict[str, Any], rest: dict[str, Any]) -> int:
        """Load what `full_state` returned (every rank gets the full state); returns the version."""
        t = self.trainer
        t.load_state(model, rest["optimizer"])
        t.step, t.version = rest["step"], rest["version"]
        t.rng.setstate(rest["rng"])  # as a checkpoint restores it: every rank takes rank 0's
        return t.version

    def train_step(self, group_ids: list[str], step: int) -> dict[str, float]:
        """One update on the batch `group_ids`. With several ranks each fetches only its share of the
        groups (balanced by generated tokens, the same split on every rank): the replay actor sends
        every record once per step, not once per rank. Each rank then writes back the importance-weight
        statistics of its groups (`ReplayStore.set_use_stats`), before the step counts as done, so
        the next plan after it ranks replay candidates by them."""
        from reflow.train.batch import rows_from_groups, shard_groups

        mine = group_ids
        if self.world_size > 1:
            sizes = ray.get(self.replay.group_sizes.remote(group_ids))
            shares = shard_groups([sizes[g] for g in group_ids], self.world_size)
            mine = [group_ids[i] for i in shares[self.rank]]
        groups = ray.get(self.replay.groups.remote(mine)) if mine else []
        metrics = self.trainer.train_step(rows_from_groups(groups, step), step=step)
        if self.trainer.group_stats:  # each rank writes back its own groups' (a group is on one rank)
            ray.get(self.replay.set_use_stats.remote(self.trainer.group_stats, step))
        return metrics

    def state_dict(self) -> dict[str, Any] | None:
        """Full weights on rank 0 (None on the others); collective: call on every rank."""
        state = self.trainer.full_state_dict()
        return state if self.rank == 0 else None

    def save_checkpoint(self, root: str, extra: dict[str, Any], keep: int) -> str | None:
        from reflow.train.trainer_state import save_checkpoint

        path = save_checkpoint(root, self.trainer, self.tokenizer, extra=extra, keep=keep)
        return str(path) if path else None

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        from reflow.train.trainer_state import load_checkpoint

        return load_checkpoint(path, self.trainer)

    def version(self) -> int:
        return self.trainer.version

    def master_address(self) -> tuple[str, int]:
        """A free TCP port on this rank's node, for the process group rendezvous."""
        import socket

        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]
