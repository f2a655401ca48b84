"""The trajectory record: episodes, their turns, and the token segments that become training rows.

Shared by rollout (which writes it), the replay store (which keeps it) and the trainer (which reads
it); it imports only the env API.

Field meanings are in docs/architecture.md (Records). Everything is a plain dataclass of JSON types, so
records go to JSONL, Parquet or the replay store without conversion code.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from reflow.env import Message

MASKED_STATUSES: frozenset[str] = frozenset({"infra_error"})
"""Episode statuses excluded from training. Other failures (timeout, env_error, truncated) are the
policy's outcome and keep their reward."""

SPREAD_TOL = 1e-9
"""Rewards closer than this are equal. A group whose valid rewards all lie within it has no reward
spread: its group-relative advantages are all 0, so it is never trained, replayed or counted as
accepted. The one tolerance the workers, the replay store, the planner and the advantages use."""


def reward_spread(rewards: Sequence[float]) -> float:
    """max - min of a group's valid rewards; 0.0 when there are fewer than two or they differ by no
    more than `SPREAD_TOL` (so `reward_spread(r) > 0` is "has spread" everywhere)."""
    if len(rewards) < 2:
        return 0.0
    spread = float(max(rewards) - min(rewards))
    return spread if spread > SPREAD_TOL else 0.0


@dataclass
class Segment:
    """One training row: the exact token ids, with a loss mask of 1 only on sampled tokens.

    `logprobs[i]` and `versions[i]` are the behaviour log-probability and policy version of token i
    where it was sampled; 0.0 and -1 on prompt and observation tokens.
    """

    segment_id: int
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    def extend_prompt(self, ids: list[int]) -> None:
        self.token_ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)

    def extend_sampled(self, ids: list[int], logprobs: list[float], versions: list[int]) -> None:
        if not len(ids) == len(logprobs) == len(versions):
            raise ValueError("sampled ids, logprobs and versions must have the same length")
        self.token_ids += ids
        self.loss_mask += [1] * len(ids)
        self.logprobs += logprobs
        self.versions += versions

    @property
    def n_sampled(self) -> int:
        return sum(self.loss_mask)


@dataclass
class TurnRecord:
    turn_index: int
    segment_id: int
    obs_messages: list[Message]
    prompt_delta_ids: list[int]
    completion_ids: list[int]
    completion_logprobs: list[float]
    finish_reason: str
    policy_version: int
    token_versions: list[int]
    sampling_params: dict[str, Any]
    raw_text: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    tool_results: list[dict[str, Any]] = field(default_factory=list)
    reward: float = 0.0
    generation_s: float = 0.0
    env_s: float = 0.0


@dataclass
class EpisodeRecord:
    episode_id: str
    group_id: str
    env_id: str
    task_id: Any
    task_hash: str
    seed: int | None
    status: str = "ok"
    termination: str = ""
    reward: float = 0.0
    reward_components: dict[str, float] = field(default_factory=dict)
    success: bool = False
    policy_version_start: int = 0
    policy_version_end: int = 0
    tokenizer_id: str = ""
    chat_template_id: str = ""
    sandbox_image: str | None = None
    error: str | None = None
    timings: dict[str, float] = field(default_factory=dict)
    messages: list[Message] = field(default_factory=list)
    turns: list[TurnRecord] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)

    @property
    def n_turns(self) -> int:
        return len(self.turns)

    @property
    def n_generated_tokens(self) -> int:
        return sum(len(t.completion_ids) for t in self.turns)

    @property
    def oldest_version(self) -> int:
        """The oldest policy version among the episode's sampled tokens (its start when it sampled
        none): its age for every staleness bound and metric. A migrated or carried-over episode can
        hold tokens older than its start (an engine that had not caught up generated them)."""
        return min((v for t in self.turns for v in t.token_versions), default=self.policy_version_start)

    @property
    def newest_version(self) -> int:
        """The newest policy version among its sampled tokens (its end when it sampled none): whether
        the weights that made the episode are an ancestor of a resumed run's."""
        return max((v for t in self.turns for v in t.token_versions), default=self.policy_version_end)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EpisodeRecord:
        data = dict(data)
        data["turns"] = [TurnRecord(**t) for t in data.get("turns", [])]
        data["segments"] = [Segment(**s) for s in data.get("segments", [])]
        return cls(**data)


def write_records(records: Sequence[EpisodeRecord], path: str | Path) -> None:
    """Episode records to a file: JSONL, or Parquet when the name ends in .parquet (one row per
    episode, nested columns)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [r.to_dict() for r in records]
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        # Free-form dicts (messages, tool results, info) vary in shape: store them as JSON text.
        for row in rows:
            for key in ("messages", "reward_components", "timings"):
                row[key] = json.dumps(row[key])
            for turn in row["turns"]:
                for key in ("obs_messages", "tool_calls", "tool_results", "sampling_params"):
                    turn[key] = json.dumps(turn[key])
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        with open(path, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
