"""The engine interface shared by every backend, and its request/result records."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol, runtime_checkable

FinishReason = Literal["stop", "length", "abort"]


class EngineError(RuntimeError):
    """The engine failed to serve a request (crashed, unreachable, aborted by a fault)."""


@dataclass
class SamplingParams:
    """How to sample. `top_k=0` and `top_p=1.0` turn those filters off; temperature 0 is greedy."""

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    def child(self, *parts: int | None) -> SamplingParams:
        """These parameters with a seed derived from this seed and `parts` (a task seed, a sample
        index, a turn index), the same in every process and run; unseeded stays unseeded. Each
        episode and each turn of a seeded measurement then draws noise of its own, not a copy of
        another episode's or turn's (the engine restarts a seeded request's generator per call)."""
        if self.seed is None:
            return self
        digest = hashlib.blake2b(repr((self.seed, *parts)).encode(), digest_size=8).digest()
        return replace(self, seed=int.from_bytes(digest, "big") >> 1)  # a non-negative int64


@dataclass
class GenerateResult:
    """One completion. `logprobs[i]` is the log-probability of `output_ids[i]` under
    softmax(logits / temperature) (temperature 0 counts as 1), without the top-p/top-k filters: the
    same quantity the trainer recomputes for the current policy."""

    output_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    weight_version: int
    prompt_tokens: int
    matched_stop: str | int | None = None
    meta: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Engine(Protocol):
    """What rollout needs from an inference engine."""

    @property
    def weight_version(self) -> int: ...

    async def generate(
        self, input_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> GenerateResult: ...

    async def abort(self, request_id: str) -> None: ...

    async def update_weights(
        self, state_dict: dict[str, Any] | None = None, path: str | None = None, version: int | None = None
    ) -> int: ...

    async def health(self) -> dict[str, Any]: ...

    async def close(self) -> None: ...
