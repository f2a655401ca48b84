"""What the tail scheduler asks of a rollout worker: `WorkerTail`, which each
`RolloutWorker` holds and whose calls it serves as its own actor methods.

A worker's episodes generate through routes (`reflow.rollout.routing`) over its engine behind a
concurrency limit (`reflow.rollout.concurrency.LimitedEngine`), so the driver can:

- `progress()`: read the episodes it runs (turns, context tokens, seconds, the engine each generates
  on now), its engine's limit, measured (concurrency, tokens/s) curve and prefill rate, and the
  migrations measured since the last call;
- `migrate(episode, target, name)`: move one of its episodes' generation to another worker's engine
  (`target`, that worker's actor handle), or back home; the env and record stay here;
- `engine_generate` / `engine_abort`: serve the episodes other workers migrated here, on this engine
  and under this worker's limit. Calls from different callers reach an async actor in no set order,
  so an abort may arrive before the generate it is meant to stop: such an id is remembered (the last
  `REMEMBERED_ABORTS`) and its generate returns "abort" at once. While this worker is paused
  (`pause_served`, with its own episodes) the requests served for others are aborted the same way
  (`meta["paused"]`: their routes resubmit them) and new ones wait for the resume (`meta["paused_s"]`);
  none decodes through a train step;
- `set_concurrency(limit)`: apply `SetConcurrency` (clamped to 1..`rollout.max_batch_size`).

The curve is measured here, from the engine's `health()` counters (`running`, `generated_tokens`,
`prefill_tokens`, `prefill_s`: TorchEngine's) sampled every `SAMPLE_S` once the worker is in use
(`ConcurrencyCurve`); an engine whose health has no such counters gets no curve and no prefill rate,
so the policy neither migrates onto it by price nor moves its limit.
"""

from __future__ import annotations

import asyncio
import collections
import time
import uuid
from dataclasses import replace
from typing import Any

from reflow.engine import GenerateResult, SamplingParams
from reflow.rollout.concurrency import ConcurrencyCurve, LimitedEngine, prefill_rate
from reflow.rollout.routing import Routes

SAMPLE_S = 0.25
"""How often a worker samples its engine's counters for the concurrency curve."""

REMEMBERED_ABORTS = 4096
"""Aborts of requests not (yet) served here that a worker remembers: request ids are unique, so an abort
that came after its request ended only takes a place until newer ones push it out."""


def engine_name(index: int) -> str:
    """The name the tail scheduler gives rollout worker `index`'s engine (its slot index: it stays
    the same across role changes)."""
    return f"w{index}"


class WorkerTail:
    """The tail scheduler's side of a rollout worker (see the module docstring). `engine`: the
    worker's own; `limit`: its starting concurrency limit, also the highest."""

    def __init__(self, engine: Any, name: str, limit: int, decode: Any = None) -> None:
        self.max_limit = limit
        self.limited = LimitedEngine(engine, limit)
        self.routes = Routes(self.limited, name, decode=decode)
        self.curve = ConcurrencyCurve()
        self._prefill_tokens_per_s = 0.0
        self._sampler: asyncio.Task[None] | None = None
        self._served: set[str] = set()  # requests generating here for other workers' episodes
        self._early_aborts: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._pause_aborted: set[str] = set()

    def start_sampling(self) -> None:
        """Start the curve's sampler on this actor's event loop (once; called by the async methods)."""
        if self._sampler is None or self._sampler.done():
            self._sampler = asyncio.ensure_future(self._sample())

    async def _sample(self) -> None:
        while True:
            try:
                health = await self.limited.engine.health()
            except Exception:  # a failing engine adds no point; its episodes report the failure
                health = {}
            running, generated = health.get("running"), health.get("generated_tokens")
            if not (isinstance(running, int | float) and isinstance(generated, int | float)):
                if health:  # an engine without these counters (SGLang's): no curve, no prefill rate
                    return
            else:
                self.curve.sample(time.monotonic(), running, generated)
                self._prefill_tokens_per_s = prefill_rate(health)
            await asyncio.sleep(SAMPLE_S)

    async def engine_generate(
        self, input_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> GenerateResult:
        """Generate for an episode another worker migrated here (module docstring: aborts that came
        first, pauses)."""
        self.start_sampling()
        rid = request_id or uuid.uuid4().hex
        gate, waited = self.routes.gate, 0.0
        if not gate.is_set():
            since = time.monotonic()
            while not gate.is_set():
                await gate.wait()
            waited = time.monotonic() - since
        if self._early_aborts.pop(rid, "absent") is None:
            meta = {"request_id": rid, "aborted_before_start": True, "paused_s": waited}
            return GenerateResult([], [], "abort", self.limited.weight_version, len(input_ids), meta=meta)
        self._served.add(rid)
        try:
            result = await self.limited.generate(input_ids, params, rid)
        finally:
            self._served.discard(rid)
            paused = rid in self._pause_aborted
            self._pause_aborted.discard(rid)
        paused = paused and result.finish_reason == "abort"
        if not (paused or waited):
            return result
        return replace(result, meta={**result.meta, "paused": paused, "paused_s": waited})

    async def engine_abort(self, request_id: str) -> None:
        if request_id not in self._served:  # not started here yet (or ended): its generate, if it
            self._early_aborts[request_id] = None  # comes, returns "abort" at once
            while len(self._early_aborts) > REMEMBERED_ABORTS:
                self._early_aborts.popitem(last=False)
            return
        await self.limited.abort(request_id)

    async def pause_served(self) -> int:
        """Abort the requests generating here for other workers (their tokens go back to their routes,
        which resubmit once this worker resumes); returns how many. Called with `routes.pause`."""
        served = list(self._served)
        self._pause_aborted.update(served)
        await asyncio.gather(*(self.limited.abort(rid) for rid in served))
        return len(served)

    async def migrate(self, episode: str, target: Any, target_name: str) -> dict[str, Any]:
        """Move `episode` (one this worker runs) to `target_name`'s engine; says whether it did."""
        return await self.routes.migrate(episode, target, target_name)

    async def set_concurrency(self, limit: int) -> int:
        """The new concurrency limit, clamped to 1..the starting one; returns the limit applied."""
        return self.limited.set_limit(max(1, min(int(limit), self.max_limit)))

    async def progress(self) -> dict[str, Any]:
        self.start_sampling()
        return {
            "engine": self.routes.home_name,
            "limit": self.limited.limit,
            "running": self.limited.active + self.limited.waiting,
            "curve": [list(p) for p in self.curve.points()],
            "prefill_tokens_per_s": self._prefill_tokens_per_s,
            "episodes": self.routes.progress(),
            "migrations": self.routes.take_measured(),
        }
