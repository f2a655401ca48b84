"""An engine's concurrency (`reflow.rollout.concurrency`): the (concurrency, tokens/s)
curve read from health counters as arithmetic, the limit a worker keeps, and `SetConcurrency` applied
to a worker changing that limit."""

from __future__ import annotations

import asyncio

import pytest
from migration_helpers import CountingEngine

from reflow.engine import SamplingParams
from reflow.policy.tail import EngineState, SetConcurrency, TailConfig, TailObservation, TailPolicy
from reflow.rollout.concurrency import ConcurrencyCurve, LimitedEngine, prefill_rate
from reflow.runtime.worker_tail import WorkerTail


def test_the_curve_is_tokens_over_seconds_per_concurrency():
    curve = ConcurrencyCurve(min_seconds=2.0)
    # (t, running, generated_tokens): 2 running for 2 s at 50 tokens/s, then 4 running for 2 s at
    # 80 tokens/s
    for t, running, tokens in [(0, 2, 0), (1, 2, 50), (2, 2, 100), (3, 4, 100), (4, 4, 180), (5, 4, 260)]:
        curve.sample(t, running, tokens)
    # (2 + 4) / 2 = 3 between t=2 and t=3: 1 s at concurrency 3 with nothing generated
    assert curve.points() == ((2, 50.0), (4, 80.0))  # concurrency 3 has 1 s: not a point yet
    curve.sample(6, 3, 280)  # (4 + 3) / 2 = 3.5 -> 4: 20 tokens in 1 s
    curve.sample(7, 0, 280)  # 1.5 -> 2: nothing generated in 1 s
    assert curve.points() == ((2, 100 / 3), (4, 180 / 3))
    curve.sample(8, 0, 280)  # nothing running: not a point of the curve
    curve.sample(9, 2, 10)  # the counter went back (an engine restart): that interval is skipped
    curve.sample(10, 2, 10)  # no tokens in 1 s at 2
    assert curve.points() == ((2, 100 / 4), (4, 60.0))
    with pytest.raises(ValueError, match="bad engine sample"):
        curve.sample(11, -1, 10)
    with pytest.raises(ValueError, match="min_seconds"):
        ConcurrencyCurve(min_seconds=float("nan"))


def test_the_policy_reads_its_knee_off_a_measured_curve():
    curve = ConcurrencyCurve(min_seconds=1.0)
    t = 0.0
    tokens = 0.0
    for running, rate in [(1, 100.0), (2, 190.0), (4, 350.0), (8, 480.0), (16, 500.0)]:
        curve.sample(t, running, tokens)  # the interval into this concurrency: mean with the last
        for _ in range(3):
            t, tokens = t + 1.0, tokens + rate
            curve.sample(t, running, tokens)
    points = dict(curve.points())
    assert points[8] == 480.0 and points[16] == 500.0
    eng = EngineState("w0", running=3, max_running=16, curve=curve.points())
    (act,) = TailPolicy(TailConfig(set_concurrency=True)).decide(TailObservation(8, 8, (), (eng,)))
    assert act == SetConcurrency("w0", 8, act.reason)  # 480 >= 0.95 x 500; 4 (350) is not
    off = TailPolicy(TailConfig(set_concurrency=False)).decide(TailObservation(8, 8, (), (eng,)))
    assert off == []


def test_prefill_rate_from_counters():
    assert prefill_rate({"prefill_tokens": 3000, "prefill_s": 1.5}) == 2000.0
    assert prefill_rate({"prefill_tokens": 10, "prefill_s": 0.0}) == 0.0
    assert prefill_rate({"ok": True}) == 0.0  # an engine that does not report them: unknown


async def test_the_limit_bounds_calls_in_flight_and_a_new_limit_applies_at_once():
    inner = CountingEngine()
    engine = LimitedEngine(inner, 2)
    params = SamplingParams(max_new_tokens=20)
    calls = [asyncio.ensure_future(engine.generate([1, 2], params, f"r{i}")) for i in range(5)]
    while inner.in_flight < 2:
        await asyncio.sleep(0)
    assert engine.active == 2 and engine.waiting == 3
    # a waiting call aborted finishes at once with no tokens, as an engine does for one not started
    await engine.abort("r4")
    assert engine.set_limit(3) == 3 and engine.active == 3 and engine.waiting == 1
    results = await asyncio.gather(*calls)
    assert results[4].finish_reason == "abort" and results[4].output_ids == []
    assert all(len(r.output_ids) == 20 for r in results[:4])
    assert inner.max_in_flight == 3 and engine.active == 0
    with pytest.raises(ValueError, match="int >= 1"):
        engine.set_limit(0)


async def test_a_cancelled_waiting_call_gives_its_place_back():
    inner = CountingEngine()
    engine = LimitedEngine(inner, 1)
    params = SamplingParams(max_new_tokens=5)
    first = asyncio.ensure_future(engine.generate([1], params, "a"))
    second = asyncio.ensure_future(engine.generate([1], params, "b"))
    await asyncio.sleep(0)
    second.cancel()
    await first
    assert engine.active == 0 and engine.waiting == 0
    assert len((await engine.generate([1], params, "c")).output_ids) == 5


class ForgetfulEngine(CountingEngine):
    """Ignores an abort of a request it is not running, as TorchEngine and SGLang's server do."""

    def __init__(self) -> None:
        super().__init__()
        self.running: set[str] = set()
        self.started: list[str] = []

    async def generate(self, input_ids, params, request_id=None):
        self.running.add(request_id)
        self.started.append(request_id)
        try:
            return await super().generate(input_ids, params, request_id)
        finally:
            self.running.discard(request_id)

    async def abort(self, request_id: str) -> None:
        if request_id in self.running:
            await super().abort(request_id)


async def test_an_abort_between_a_calls_grant_and_its_start_keeps_it_off_the_engine():
    """A place freed hands the next waiting call its grant; an abort that comes before that call runs
    (a pause) must stop it: the engine, which does not know it yet, would ignore the abort."""
    inner = ForgetfulEngine()
    engine = LimitedEngine(inner, 1)
    params = SamplingParams(max_new_tokens=5)
    first = asyncio.ensure_future(engine.generate([1], params, "a"))
    second = asyncio.ensure_future(engine.generate([1], params, "b"))
    while engine.waiting < 1:
        await asyncio.sleep(0)
    engine.set_limit(2)  # b is granted a place; its task has not run yet
    assert engine.active == 2 and engine.waiting == 0
    await engine.abort("b")
    out = await second
    assert out.finish_reason == "abort" and out.output_ids == [] and inner.started == ["a"]
    assert len((await first).output_ids) == 5
    assert engine.active == 0  # b's place given back
    assert len((await engine.generate([1], params, "c")).output_ids) == 5


async def test_set_concurrency_applied_changes_the_workers_limit():
    tail = WorkerTail(CountingEngine(), "w3", limit=8)
    assert (await tail.progress())["limit"] == 8
    assert await tail.set_concurrency(3) == 3
    report = await tail.progress()
    assert report["limit"] == 3 and tail.limited.limit == 3 and report["engine"] == "w3"
    assert await tail.set_concurrency(100) == 8  # never above the engine's batch size it started at
    assert await tail.set_concurrency(0) == 1
    # the worker's own episodes and those migrated to it share that limit
    inner = tail.limited.engine
    params = SamplingParams(max_new_tokens=10)
    calls = [tail.engine_generate([1], params, f"m{i}") for i in range(3)]
    await asyncio.gather(*calls)
    assert inner.max_in_flight == 1
