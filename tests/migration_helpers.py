"""Test doubles for episode migration: a deterministic engine that samples one token per event-loop tick
(so a test can migrate at a known token), a stand-in for a rollout worker's Ray actor handle, and a tail
policy with scripted migrations for real runs."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from reflow.engine import EngineError, GenerateResult, SamplingParams
from reflow.policy.tail import TailPolicy
from reflow.policy.tail_actions import FreeSlot, Migrate, SetConcurrency
from reflow.runtime.tail import is_placeholder


def next_token(context: list[int]) -> int:
    """A 'greedy' model: the next id is a function of the whole context, whatever engine computes it."""
    return (sum(context) * 31 + len(context)) % 97 + 3


def expected_ids(n: int, prompt: list[int]) -> list[int]:
    """The `n` ids `next_token` gives after `prompt`: what any engine here generates, in one call or several."""
    out: list[int] = []
    for _ in range(n):
        out.append(next_token([*prompt, *out]))
    return out


def logprob_of(token: int) -> float:
    return -0.1 * (token % 7) - 0.01


class CountingEngine:
    """The `Engine` protocol over `next_token`: one token per tick; `abort` finishes a request with the
    tokens it has; `on_token(n, request_id)` runs after each of a request's tokens (a test migrates
    from there); `fail` makes every call raise; `stop_every`: a request stops (as on an EOS) when the
    context's length becomes a multiple of it, a function of the context like the tokens."""

    def __init__(self, version: int = 0, stop_every: int | None = None, fail: bool = False) -> None:
        self._version, self.stop_every, self.fail = version, stop_every, fail
        self.prompts: list[list[int]] = []
        self.aborted: set[str] = set()
        self.on_token: Callable[[int, str], Awaitable[None]] | None = None
        self.in_flight = self.max_in_flight = 0

    @property
    def weight_version(self) -> int:
        return self._version

    async def generate(
        self, input_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> GenerateResult:
        if self.fail:
            raise EngineError("the engine process died")
        rid = request_id or "r"
        self.prompts.append(list(input_ids))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        out: list[int] = []
        finish = "length"
        try:
            while len(out) < params.max_new_tokens:
                await asyncio.sleep(0)
                if rid in self.aborted:
                    finish = "abort"
                    break
                out.append(next_token([*input_ids, *out]))
                if self.on_token is not None:
                    await self.on_token(len(out), rid)
                if self.stop_every and (len(input_ids) + len(out)) % self.stop_every == 0:
                    finish = "stop"
                    break
        finally:
            self.in_flight -= 1
        return GenerateResult(out, [logprob_of(t) for t in out], finish, self._version, len(input_ids))  # type: ignore[arg-type]

    async def abort(self, request_id: str) -> None:
        self.aborted.add(request_id)

    async def update_weights(self, *args: Any, **kwargs: Any) -> int:
        return self._version

    async def health(self) -> dict[str, Any]:
        return {"ok": True, "running": self.in_flight, "generated_tokens": 0}

    async def close(self) -> None:
        pass


class _Method:
    def __init__(self, fn: Callable[..., Awaitable[Any]]) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> Awaitable[Any]:
        return self.fn(*args)  # awaited like an ObjectRef


class FakeHandle:
    """What `RemoteEngine` calls on another worker's actor handle, served by `engine` in-process."""

    def __init__(self, engine: Any) -> None:
        self.engine_generate = _Method(engine.generate)
        self.engine_abort = _Method(engine.abort)


class ScriptedTail:
    """The real tail policy, plus scripted actions the runtime applies for real (as `ScriptedElastic`):
    the first two times two engines run started episodes, every episode of the less loaded one
    migrates to the other, which is freed for the next batch; and once, engine w0's limit is 12."""

    def __init__(self, cfg=None) -> None:
        self.policy, self.forced, self.limit_set = TailPolicy(cfg), 0, False
        self.cfg = self.policy.cfg

    def extra_groups(self, *args):
        return self.policy.extra_groups(*args)

    def decide(self, obs):
        actions = self.policy.decide(obs)
        started = [ep for ep in obs.episodes if not is_placeholder(ep.id)]
        engines = {e.id for e in obs.engines if not e.released}
        by_engine = {e: [ep for ep in started if ep.engine == e] for e in engines}
        busy = sorted((e for e in by_engine if by_engine[e]), key=lambda e: (len(by_engine[e]), e))
        if self.forced < 2 and len(busy) >= 2 and not any(a.kind == "migrate" for a in actions):
            src, dst = busy[0], busy[-1]
            actions += [Migrate(ep.id, src, dst, ep.tokens, "scripted: consolidate") for ep in by_engine[src]]
            actions.append(FreeSlot(src, "next_batch", "scripted: emptied"))
            self.forced += 1
        if not self.limit_set and "w0" in engines:
            actions.append(SetConcurrency("w0", 12, "scripted: the knee"))
            self.limit_set = True
        return actions
