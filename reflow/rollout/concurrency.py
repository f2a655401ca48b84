"""An engine's concurrency: the limit a rollout worker keeps, and the curve it is read from.

- `LimitedEngine`: an `Engine` behind a limit on the generate calls in flight at once (the sequences
  a worker runs on its engine: its own episodes' and those migrated to it from other workers). The
  tail scheduler's `SetConcurrency` moves the limit (`set_limit`); calls over it wait in order, and
  `abort` of a waiting call finishes it at once with finish_reason "abort" and no tokens, as the
  engine does for a request it has not started; so does an abort that comes after its call was
  granted a place but before it reached the engine (an engine ignores ids it does not know).
- `ConcurrencyCurve` (pure arithmetic, no clock): (concurrency, tokens/s) points from the engine's
  `health()` counters sampled over time. Each pair of consecutive samples is an interval whose
  concurrency is the mean of the two `running` readings (rounded half up) and whose rate is the
  `generated_tokens` counter's growth over its seconds; intervals with nothing running, a counter
  that went back (an engine restarted) or no time passed are skipped. A point is a concurrency's
  tokens over its seconds summed, once it has `min_seconds` of measurement: the tail policy reads
  the knee off these points.
- `prefill_rate`: prefill tokens per second from the same counters (0: unknown).
"""

from __future__ import annotations

import asyncio
import collections
import math
import uuid
from typing import Any

from reflow.engine import Engine, GenerateResult, SamplingParams

CURVE_MIN_S = 2.0
"""Seconds of measurement a concurrency needs before it is a point of the curve."""


class ConcurrencyCurve:
    """(concurrency, tokens/s) from samples of (seconds, running, generated_tokens); see the module."""

    def __init__(self, min_seconds: float = CURVE_MIN_S) -> None:
        if not (math.isfinite(min_seconds) and min_seconds >= 0):
            raise ValueError(f"min_seconds must be finite and >= 0, got {min_seconds}")
        self.min_seconds = min_seconds
        self._last: tuple[float, float, float] | None = None
        self._buckets: dict[int, list[float]] = {}  # concurrency -> [seconds, tokens]

    def sample(self, t: float, running: float, generated_tokens: float) -> None:
        """One reading: `t` seconds on any clock that only goes forward, the engine's running
        sequences and its cumulative generated tokens."""
        if running < 0 or not all(math.isfinite(x) for x in (t, running, generated_tokens)):
            raise ValueError(f"bad engine sample: t={t}, running={running}, tokens={generated_tokens}")
        if self._last is not None:
            t0, r0, g0 = self._last
            dt, tokens = t - t0, generated_tokens - g0
            concurrency = math.floor((r0 + running) / 2 + 0.5)
            if dt > 0 and tokens >= 0 and concurrency >= 1:
                bucket = self._buckets.setdefault(concurrency, [0.0, 0.0])
                bucket[0] += dt
                bucket[1] += tokens
        self._last = (t, running, generated_tokens)

    def points(self) -> tuple[tuple[int, float], ...]:
        """(concurrency, tokens/s) of every concurrency measured for at least `min_seconds`, by c."""
        return tuple(
            (c, tokens / seconds)
            for c, (seconds, tokens) in sorted(self._buckets.items())
            if seconds >= self.min_seconds and seconds > 0
        )


def prefill_rate(health: dict[str, Any]) -> float:
    """Prefill tokens per second from an engine's cumulative counters (0: not reported or none yet)."""
    tokens, seconds = health.get("prefill_tokens"), health.get("prefill_s")
    if not isinstance(tokens, int | float) or not isinstance(seconds, int | float) or seconds <= 0:
        return 0.0
    return float(tokens) / float(seconds)


class LimitedEngine:
    """`engine` with at most `limit` generate calls in flight (see the module docstring)."""

    def __init__(self, engine: Engine, limit: int) -> None:
        self.engine = engine
        self._limit = self._checked(limit)
        self.active = 0
        self._queue: collections.OrderedDict[str, asyncio.Future[bool]] = collections.OrderedDict()
        self._granted: set[str] = set()  # given a place, not yet on the engine
        self._aborted_granted: set[str] = set()

    @staticmethod
    def _checked(limit: int) -> int:
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise ValueError(f"a concurrency limit is an int >= 1, got {limit!r}")
        return limit

    @property
    def limit(self) -> int:
        return self._limit

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def set_limit(self, limit: int) -> int:
        """A new limit; calls waiting start at once when it rose. Returns it."""
        self._limit = self._checked(limit)
        self._grant()
        return self._limit

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    async def generate(
        self, input_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> GenerateResult:
        rid = request_id or uuid.uuid4().hex
        granted = await self._acquire(rid)
        self._granted.discard(rid)
        if rid in self._aborted_granted:  # aborted between its grant and now: it never starts
            self._aborted_granted.discard(rid)
            self._release()
            granted = False
        if not granted:
            meta = {"request_id": rid, "aborted_waiting": True}
            return GenerateResult([], [], "abort", self.engine.weight_version, len(input_ids), meta=meta)
        try:
            return await self.engine.generate(input_ids, params, rid)
        finally:
            self._release()

    async def abort(self, request_id: str) -> None:
        waiting = self._queue.pop(request_id, None)
        if waiting is not None:
            if not waiting.done():
                waiting.set_result(False)
            return
        if request_id in self._granted:
            self._aborted_granted.add(request_id)
            return
        await self.engine.abort(request_id)

    async def update_weights(self, *args: Any, **kwargs: Any) -> int:
        return await self.engine.update_weights(*args, **kwargs)

    async def health(self) -> dict[str, Any]:
        return {
            **await self.engine.health(),
            "concurrency_limit": self._limit,
            "limited_active": self.active,
            "limited_waiting": len(self._queue),
        }

    async def close(self) -> None:
        await self.engine.close()

    async def _acquire(self, rid: str) -> bool:
        """True once a place is taken (counted in `active`), False when aborted while waiting."""
        if not self._queue and self.active < self._limit:
            self.active += 1
            return True
        if rid in self._queue:
            raise ValueError(f"request id {rid!r} is already waiting")
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._queue[rid] = future
        try:
            return await future
        except asyncio.CancelledError:
            granted = future.done() and not future.cancelled() and future.result()
            if self._queue.pop(rid, None) is None and granted:  # granted just before the cancel
                self._granted.discard(rid)
                self._aborted_granted.discard(rid)
                self._release()
            raise

    def _release(self) -> None:
        self.active -= 1
        self._grant()

    def _grant(self) -> None:
        while self._queue and self.active < self._limit:
            rid, future = self._queue.popitem(last=False)
            if not future.done():
                self.active += 1
                self._granted.add(rid)
                future.set_result(True)
