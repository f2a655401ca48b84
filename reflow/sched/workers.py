"""The Ray actors of a run: rollout workers (an engine plus env instances) and trainer ranks.

Both are plain classes, made remote by `reflow.sched.pool` on a device slot, so they can also be used
in-process (tests, debugging). A rollout worker plays GRPO groups, fixes each group's advantages and
stores it durably in the replay store before reporting it; a trainer rank reads groups from the store,
takes its share of the rows and does one update (FSDP2 across ranks).
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field
from typing import Any

import ray

from reflow.config import RunConfig
from reflow.engine import SamplingParams
from reflow.env import make
from reflow.env.registration import load_env_plugin
from reflow.records import EpisodeRecord
from reflow.rollout.episode import EpisodeRunner, RolloutConfig, run_group
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


def _threads(config: RunConfig) -> int:
    if config.resources.threads_per_slot:
        return config.resources.threads_per_slot
    cores = os.cpu_count() or 1
    if config.mode == "sync":  # rollout and training take turns: each may use every core
        return cores
    return max(1, cores // len(config.resources.slots))  # they overlap: split the cores between slots


def _sampling(
    config: RunConfig, temperature: float | None = None, max_new_tokens: int | None = None
) -> SamplingParams:
    """The rollout's sampling parameters; `temperature` overrides the rollout's (0: greedy)."""
    r = config.rollout
    return SamplingParams(
        max_new_tokens=max_new_tokens or r.max_new_tokens,
        temperature=r.temperature if temperature is None else temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        stop=list(r.stop),
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
        policy_version=min(r.policy_version_start for r in records),
        rewards=rewards,
        successes=[r.success for r in records],
        statuses=[r.status for r in records],
        turns=[r.n_turns for r in records],
        generated_tokens=sum(r.n_generated_tokens for r in records),
        has_spread=has_spread(rewards, mask=train_mask([r.status for r in records])),
        seconds=seconds,
        tool_latencies_ms=latencies,
    )


class RolloutWorker:
    """An inference engine plus env instances on one device slot (an async Ray actor)."""

    def __init__(self, config: RunConfig, model_path: str, replay: Any, index: int = 0) -> None:
        import torch

        from reflow.sched.engines import build_engine

        torch.set_num_threads(_threads(config))
        self.config, self.replay, self.index, self.model_path = config, replay, index, model_path
        self._load_plugins()
        self.engine, self.tokenizer = build_engine(config, model_path, index)
        r = config.rollout
        self.runner = EpisodeRunner(
            self.engine,
            self.tokenizer,
            RolloutConfig(
                sampling=_sampling(config),
                max_context_tokens=r.max_context_tokens,
                max_generated_tokens=r.max_generated_tokens,
                deadline_s=r.episode_deadline_s,
                max_turns=r.max_turns,
            ),
        )

    def _make_env(self) -> Any:
        return make(self.config.env.id, **self.config.env.kwargs)

    def _load_plugins(self) -> None:
        for spec in self.config.env.plugins:
            load_env_plugin(spec)

    async def generate(self, seeds: list[int], group_ids: list[str] | None = None) -> list[GroupReport]:
        """One group per task seed, all in flight together; each is durable in the store on return.
        `group_ids` name groups registered in flight beforehand (admission control)."""
        adv_scale = self.config.train.advantage_scale

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
        return list(await asyncio.gather(*(one(s, g) for s, g in zip(seeds, ids, strict=True))))

    async def update_weights(self, state_dict: dict[str, Any], version: int) -> int:
        from reflow.sched.engines import push_weights

        return await push_weights(self.engine, self.config, self.model_path, self.index, state_dict, version)

    async def evaluate(self, episodes: int, seed: int) -> dict[str, Any]:
        """Success on the fixed held-out task set (task seeds from `seed`): greedy, or with
        `eval.temperature` > 0 the mean over `eval.samples` sampled episodes per task."""
        from reflow.rollout.collect import collect, summarize

        ev = self.config.eval
        sampling = _sampling(self.config, temperature=ev.temperature, max_new_tokens=ev.max_new_tokens)
        runner = EpisodeRunner(self.engine, self.tokenizer, RolloutConfig(sampling=sampling))
        start = time.monotonic()
        env_kwargs = self.config.env.kwargs if ev.env_kwargs is None else ev.env_kwargs
        records = await collect(
            runner,
            self.config.env.id,
            episodes * ev.samples,
            group_size=ev.samples,
            seed=seed,
            concurrency=self.config.rollout.max_batch_size,
            env_kwargs=env_kwargs,
        )
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
        from reflow.train.losses import LossConfig
        from reflow.train.trainer import PolicyTrainer, TrainerConfig, init_distributed

        hf_logging.disable_progress_bar()  # a progress bar per checkpoint save is noise in the run log
        config = self.config
        torch.set_num_threads(_threads(config))
        torch.manual_seed(config.seed)
        if self.world_size > 1:
            if master is None:
                raise ValueError("several trainer ranks need the rank-0 address")
            backend = "nccl" if config.resources.device == "cuda" else "gloo"
            init_distributed(self.rank, self.world_size, master[0], master[1], backend)
        model, self.tokenizer = load_model(self.model_path, device=config.resources.device)
        t = config.train
        self.trainer = PolicyTrainer(
            model,
            self.tokenizer.pad_token_id,
            TrainerConfig(
                lr=t.lr,
                weight_decay=t.weight_decay,
                grad_clip=t.grad_clip,
                micro_batch_tokens=t.micro_batch_tokens,
                minibatches=t.minibatches,
                epochs=t.epochs,
                prox_logp=t.prox_logp,
                loss=LossConfig(**t.loss.model_dump()),
                behaviour_is_prox=config.mode == "sync",
                temperature=config.rollout.temperature or 1.0,
                bf16=t.bf16,
                seed=config.seed,
            ),
        )

    def train_step(self, group_ids: list[str], step: int) -> dict[str, float]:
        from reflow.train.batch import rows_from_groups, shard_rows

        groups = ray.get([self.replay.group.remote(g) for g in group_ids])
        rows = shard_rows(rows_from_groups(groups), self.world_size)[self.rank]
        return self.trainer.train_step(rows, step=step)

    def state_dict(self) -> dict[str, Any] | None:
        """Full weights on rank 0 (None on the others); collective: call on every rank."""
        state = self.trainer.full_state_dict()
        return state if self.rank == 0 else None

    def save_checkpoint(self, root: str, extra: dict[str, Any], keep: int) -> str | None:
        from reflow.train.checkpoint import save_checkpoint

        path = save_checkpoint(root, self.trainer, self.tokenizer, extra=extra, keep=keep)
        return str(path) if path else None

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        from reflow.train.checkpoint import load_checkpoint

        return load_checkpoint(path, self.trainer)

    def version(self) -> int:
        return self.trainer.version

    def master_address(self) -> tuple[str, int]:
        """A free TCP port on this rank's node, for the process group rendezvous."""
        import socket

        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]
