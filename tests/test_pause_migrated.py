"""Pauses and migrated requests: an abort that reaches the target before the generate it stops, a target
that pauses while it serves another worker's episode, and the time an episode waits paused kept out
of its age (what the tail scheduler's quantiles and remaining-time estimates read)."""

from __future__ import annotations

import asyncio

from migration_helpers import CountingEngine, expected_ids
from test_runtime_reports import _episode

from reflow.engine import SamplingParams
from reflow.rollout.concurrency import LimitedEngine
from reflow.rollout.routing import Routes
from reflow.runtime.worker_tail import REMEMBERED_ABORTS, WorkerTail
from reflow.runtime.workers import report_group

PROMPT = [5, 6, 7, 8]


class _Method:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return self.fn(*args)


class TailHandle:
    """What `RemoteEngine` calls on another worker's actor, served by that worker's `WorkerTail`."""

    def __init__(self, tail: WorkerTail) -> None:
        self.engine_generate = _Method(tail.engine_generate)
        self.engine_abort = _Method(tail.engine_abort)


async def _ticks(n: int = 20) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def test_an_abort_that_arrives_before_its_generate_stops_it_when_it_comes():
    engine = CountingEngine()
    tail = WorkerTail(engine, "w1", limit=8)
    await tail.engine_abort("src.1")  # the source's abort overtook its generate
    out = await tail.engine_generate(PROMPT, SamplingParams(max_new_tokens=10), "src.1")
    assert out.finish_reason == "abort" and out.output_ids == [] and engine.prompts == []
    # another request generates as usual, and the remembered ids stay bounded
    out = await tail.engine_generate(PROMPT, SamplingParams(max_new_tokens=4), "other")
    assert out.output_ids == expected_ids(4, PROMPT)
    for i in range(REMEMBERED_ABORTS + 10):
        await tail.engine_abort(f"ended-{i}")
    assert len(tail._early_aborts) == REMEMBERED_ABORTS


async def test_a_target_that_pauses_aborts_the_request_it_serves_and_the_episode_resumes_there():
    home, target_engine = CountingEngine(version=3), CountingEngine(version=3)
    routes = Routes(LimitedEngine(home, 8), "w0")
    target = WorkerTail(target_engine, "w1", limit=8)
    route = routes.open("ep", "g")
    paused: list[int] = []

    async def migrate_at_2(n: int, rid: str) -> None:
        if n == 2 and not home.aborted:
            await routes.migrate("ep", TailHandle(target), "w1")

    async def pause_target_at_3(n: int, rid: str) -> None:
        if n == 3 and not paused:  # the target's worker pauses (its trainer's step); the source does not
            paused.append(await target.routes.pause())
            paused.append(await target.pause_served())

    home.on_token = migrate_at_2
    target_engine.on_token = pause_target_at_3
    call = asyncio.ensure_future(route.generate(PROMPT, SamplingParams(max_new_tokens=12), "req"))
    await _ticks(60)
    # the served request was aborted; its route resubmitted it, and the resubmission waits on the target
    assert paused == [0, 1] and not call.done() and target_engine.in_flight == 0
    assert route.waiting  # there, where the route cannot time it: the runner's deadline holds off
    prompts_while_paused = len(target_engine.prompts)
    await asyncio.sleep(0.05)
    assert len(target_engine.prompts) == prompts_while_paused  # nothing decodes through the pause
    target_engine._version = 4  # the weights the target got while paused
    target.routes.resume()
    out = await asyncio.wait_for(call, 5)
    assert out.output_ids == expected_ids(12, PROMPT) and out.finish_reason == "length"
    versions = out.meta["token_versions"]
    assert versions[:2] == [3, 3] and versions[-1] == 4 and sorted(versions) == versions
    assert "paused" not in out.meta and "paused_s" not in out.meta  # the route's own meta only
    # the wait at the target's gate is the episode's paused time
    assert route.paused_total_s >= 0.04 and route.take_paused_s() >= 0.04 and not route.waiting


async def test_an_episode_paused_here_while_it_generates_on_another_worker_counts_as_waiting():
    """Sync mode pauses every worker: the part on the target may wait at its gate, unseen from here
    until it returns; the route says it may be waiting, so the runner's deadline holds off."""
    home, target_engine = CountingEngine(), CountingEngine()
    routes = Routes(LimitedEngine(home, 8), "w0")
    target = WorkerTail(target_engine, "w1", limit=8)
    route = routes.open("ep", "g")
    waiting: list[bool] = []

    async def migrate_at_2(n: int, rid: str) -> None:
        if n == 2 and not home.aborted:
            await routes.migrate("ep", TailHandle(target), "w1")

    async def pause_here_at_3(n: int, rid: str) -> None:
        if n == 3 and not waiting:
            waiting.append(route.waiting)  # generating there, no pause yet
            await routes.pause()
            waiting.append(route.waiting)

    home.on_token = migrate_at_2
    target_engine.on_token = pause_here_at_3
    call = asyncio.ensure_future(route.generate(PROMPT, SamplingParams(max_new_tokens=12), "req"))
    await _ticks(60)
    assert waiting == [False, True] and route.waiting and not call.done()  # back here, at the gate
    routes.resume()
    out = await asyncio.wait_for(call, 5)
    assert out.output_ids == expected_ids(12, PROMPT) and not route.waiting


async def test_an_episodes_age_leaves_out_the_time_it_waited_paused():
    now = [100.0]
    engine = CountingEngine()
    routes = Routes(LimitedEngine(engine, 8), "w0", clock=lambda: now[0])
    route = routes.open("ep", "g")
    now[0] += 5.0
    await routes.pause()
    call = asyncio.ensure_future(route.generate(PROMPT, SamplingParams(max_new_tokens=4), "t1"))
    await _ticks()
    now[0] += 30.0  # a train step
    assert routes.progress()[0]["seconds"] == 5.0  # waiting now: the wait does not age it
    routes.resume()
    await asyncio.wait_for(call, 5)
    now[0] += 2.0
    assert route.paused_total_s == 30.0 and routes.progress()[0]["seconds"] == 7.0


def test_a_groups_episode_seconds_leave_out_their_paused_time():
    records = [
        _episode(1.0, "ok", [], {"total_s": 40.0, "paused_s": 30.0}),
        _episode(0.0, "ok", [], {"total_s": 8.0}),
    ]
    assert report_group(records, 40.0).episode_seconds == [10.0, 8.0]


async def test_a_migrations_first_token_leaves_out_its_wait_at_a_paused_targets_gate():
    home, target_engine = CountingEngine(version=3), CountingEngine(version=3)
    routes = Routes(LimitedEngine(home, 8), "w0")
    target = WorkerTail(target_engine, "w1", limit=8)
    await target.routes.pause()  # the target's worker is paused (its trainer's step)
    route = routes.open("ep", "g")

    async def migrate_at_2(n: int, rid: str) -> None:
        if n == 2 and not home.aborted:
            await routes.migrate("ep", TailHandle(target), "w1")

    home.on_token = migrate_at_2
    call = asyncio.ensure_future(route.generate(PROMPT, SamplingParams(max_new_tokens=8), "req"))
    await _ticks(40)
    assert not call.done() and target_engine.prompts == []  # the probe waits at the target's gate
    await asyncio.sleep(0.1)
    target.routes.resume()
    out = await asyncio.wait_for(call, 5)
    assert out.output_ids == expected_ids(8, PROMPT)
    (report,) = routes.take_measured()
    # the re-prefill's time is the target's computing, not its pause; the pause is the episode's
    assert report["outcome"] == "ok" and report["first_token_s"] < 0.05
    assert route.paused_total_s >= 0.1 and route.counters["reprefill_s"] < 0.05
