"""An Engine that replays given texts as token ids, recording every prompt it is sent.

It implements the real `Engine` protocol; the tests use it to drive the episode runner through exact,
known turns (and through engine faults) without depending on what a random tiny model samples.
"""

from __future__ import annotations

import asyncio
from typing import Any

from reflow.engine import EngineError, GenerateResult, SamplingParams


class ScriptedEngine:
    def __init__(
        self,
        tokenizer: Any,
        texts: list[str],
        *,
        fail_on_call: int | None = None,
        delay_s: float = 0.0,
        finish_override: dict[int, str] | None = None,
    ) -> None:
        self.tokenizer, self.texts = tokenizer, list(texts)
        self.fail_on_call, self.delay_s = fail_on_call, delay_s
        self.finish_override = finish_override or {}
        self.prompts: list[list[int]] = []
        self.seeds: list[int | None] = []  # each call's SamplingParams.seed
        self.results: list[GenerateResult] = []
        self.aborted: list[str] = []
        self._version = 0
        self.in_flight = self.max_in_flight = 0

    @property
    def weight_version(self) -> int:
        return self._version

    async def generate(
        self, input_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> GenerateResult:
        call = len(self.prompts)
        self.prompts.append(list(input_ids))
        self.seeds.append(params.seed)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
        finally:
            self.in_flight -= 1
        if call == self.fail_on_call:
            raise EngineError("the engine process died")
        text = self.texts[call % len(self.texts)]
        ids = [*self.tokenizer.encode(text, add_special_tokens=False), self.tokenizer.eos_token_id]
        finish = "stop"
        if len(ids) > params.max_new_tokens:
            ids, finish = ids[: params.max_new_tokens], "length"
        finish = self.finish_override.get(call, finish)
        logprobs = [-0.01 * (call + 1) - 0.001 * i for i in range(len(ids))]
        result = GenerateResult(ids, logprobs, finish, self._version, len(input_ids))
        self.results.append(result)
        return result

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def update_weights(self, state_dict=None, path=None, version=None) -> int:
        self._version = version if version is not None else self._version + 1
        return self._version

    async def health(self) -> dict[str, Any]:
        return {"ok": True}

    async def close(self) -> None:
        pass
