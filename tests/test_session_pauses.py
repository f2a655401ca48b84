"""An episode that waits paused (sync mode's partial rollouts, a lent engine) keeps its time: the
runner's own deadline moves by the pause, and on an env server the session stays: the client reports
the pause (`extend`: the server moves the session's deadline, up to `--max-extend` in all) and, while
a generation runs, keeps the session from the idle reaper."""

from __future__ import annotations

import asyncio
import time

import pytest
from migration_helpers import CountingEngine
from server_helpers import ServerProcess, remote_kwargs

import reflow
from reflow.engine import SamplingParams
from reflow.rollout.concurrency import LimitedEngine
from reflow.rollout.episode import EpisodeRunner, RolloutConfig
from reflow.rollout.routing import Routes

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from reflow.models import build_tiny

    return AutoTokenizer.from_pretrained(build_tiny(tmp_path_factory.mktemp("tiny")))


def test_extend_moves_a_sessions_deadline_up_to_the_cap_and_marks_it_active(tmp_path):
    with ServerProcess(tmp_path, "--max-extend", "5") as server, server.client() as http:
        sid = http.post("/v1/sessions", json={"env_id": "test/Echo-v0", "seed": 0, "deadline_s": 60}).json()[
            "session_id"
        ]
        time.sleep(0.3)
        before = http.get(f"/v1/sessions/{sid}").json()
        first = http.post(f"/v1/sessions/{sid}/extend", json={"seconds": 3}).json()
        assert first["extended_s"] == 3.0 and first["idle_s"] < before["idle_s"]
        assert first["deadline_left_s"] == pytest.approx(before["deadline_left_s"] + 3, abs=0.5)
        capped = http.post(f"/v1/sessions/{sid}/extend", json={"seconds": 10}).json()
        assert capped["extended_s"] == 5.0  # the cap, in all
        assert capped["deadline_left_s"] == pytest.approx(first["deadline_left_s"] + 2, abs=0.5)
        kept = http.post(f"/v1/sessions/{sid}/extend", json={"seconds": 0}).json()
        assert kept["extended_s"] == 5.0 and kept["idle_s"] < 0.2
        for bad in ({"seconds": -1}, {"seconds": "3"}, {}, {"seconds": 1, "more": 1}):
            r = http.post(f"/v1/sessions/{sid}/extend", json=bad)
            assert (r.status_code, r.json()["code"]) == (422, "invalid_request"), bad
        http.delete(f"/v1/sessions/{sid}")
        gone = http.post(f"/v1/sessions/{sid}/extend", json={"seconds": 1})
        assert (gone.status_code, gone.json()["code"]) == (410, "session_closed")
        assert http.post("/v1/sessions/nope/extend", json={"seconds": 1}).status_code == 404


def test_a_pause_reported_after_the_deadline_passed_gives_the_time_back(tmp_path):
    """The client reports a pause as it goes, every keepalive_s: a session whose deadline passed waits
    for that report (the reaper's grace, here the idle timeout) and plays on once extended."""
    with ServerProcess(tmp_path, "--idle-timeout", "3") as server, server.client() as http:
        body = {"env_id": "test/Echo-v0", "seed": 0, "deadline_s": 1}
        sid = http.post("/v1/sessions", json=body).json()["session_id"]
        time.sleep(1.8)  # past the deadline; the reaper (every 0.75 s) has looked at it twice
        assert http.get(f"/v1/sessions/{sid}").json()["deadline_left_s"] == 0.0
        assert http.post(f"/v1/sessions/{sid}/extend", json={"seconds": 5}).json()["deadline_left_s"] > 3
        turn = {"content": "hi", "tool_calls": [], "finish_reason": "stop"}
        step = http.post(f"/v1/sessions/{sid}/step", json={"turn_index": 0, "turn": turn}).json()
        assert step["state"] == "ready" and step["result"]["info"].get("status") != "timeout", step


async def _paused_remote_episode(server: ServerProcess, tokenizer, transport: str):
    """An Echo episode on `server` whose first turn waits out a 3.5-s pause; its record and what the
    server says of its session at the end."""
    engine = CountingEngine(stop_every=5)
    routes = Routes(LimitedEngine(engine, 8), "w0")
    runner = EpisodeRunner(
        routes.home, tokenizer, RolloutConfig(SamplingParams(max_new_tokens=6)), routes=routes
    )
    # the client speaks up more often than the server's idle timeout
    kwargs = remote_kwargs(server, "test/Echo-v0", transport=transport, keepalive_s=0.3)
    env = reflow.make("reflow/Remote-v0", max_turns=3, session_deadline_s=2, **kwargs)

    async def pause_at_2(n: int, rid: str) -> None:
        if n == 2 and len(engine.prompts) == 1:
            await routes.pause()
            asyncio.get_running_loop().call_later(3.5, routes.resume)  # a long train step

    engine.on_token = pause_at_2
    rec = await runner.run(env, seed=0)
    with server.client() as http:
        session = http.get(f"/v1/sessions/{env.unwrapped.session_id}").json()
    await env.close()
    return rec, session


@pytest.mark.parametrize("transport", ["ws", "http"])
async def test_a_remote_episode_paused_past_the_servers_idle_timeout_and_deadline_plays_on(
    tmp_path, tiny_tokenizer, transport
):
    """The pause (3.5 s) is longer than the server's idle timeout (2 s) and than what is left of the
    session's deadline (2 s); the episode still ends by its turn limit, its session never closed."""
    with ServerProcess(tmp_path, "--idle-timeout", "2") as server:
        rec, held = await _paused_remote_episode(server, tiny_tokenizer, transport)
    assert (rec.status, rec.termination, rec.n_turns) == ("truncated", "max_turns", 3), rec.error
    assert rec.timings["paused_s"] >= 3.4
    # the server kept the session (the turn limit is the client's) and moved its deadline by the pause
    assert held["state"] == "ready" and 3.4 <= held["extended_s"] <= rec.timings["paused_s"] + 0.1


async def test_a_server_that_extends_nothing_keeps_its_deadline(tmp_path, tiny_tokenizer):
    """`--max-extend 0`: the operator's deadline holds; kept from the idle reaper, the paused episode
    ends as a timeout at its next step."""
    with ServerProcess(tmp_path, "--idle-timeout", "2", "--max-extend", "0") as server:
        rec, _ = await _paused_remote_episode(server, tiny_tokenizer, "http")
    assert (rec.status, rec.termination, rec.n_turns) == ("timeout", "deadline", 1)


async def test_a_route_hands_over_a_wait_in_progress_and_counts_it_once():
    """What the runner reports while a generation waits paused is the wait so far; the rest follows
    when it resumes, and the episode's total counts every second once."""
    now = [10.0]
    routes = Routes(LimitedEngine(CountingEngine(), 8), "w0", clock=lambda: now[0])
    route = routes.open("ep", "g")
    await routes.pause()
    call = asyncio.ensure_future(route.generate([5, 6, 7], SamplingParams(max_new_tokens=2), "t"))
    for _ in range(10):
        await asyncio.sleep(0)
    now[0] = 13.0
    assert route.take_paused_s() == 3.0 and route.active_s() == 0.0  # paused since it opened
    now[0] = 15.0
    routes.resume()
    await asyncio.wait_for(call, 5)
    assert route.take_paused_s() == 2.0 and route.paused_total_s == 5.0 and route.take_paused_s() == 0.0


async def test_the_runners_deadline_moves_by_the_time_waited_paused(tiny_tokenizer):
    """`rollout.episode_deadline_s` (1 s) with a 2-s pause in the first turn: the episode ends by its
    turn limit; and a deadline that passes while nothing pauses still ends it as a timeout."""
    engine = CountingEngine(stop_every=5)
    routes = Routes(LimitedEngine(engine, 8), "w0")
    config = RolloutConfig(SamplingParams(max_new_tokens=6), deadline_s=1.0)
    runner = EpisodeRunner(routes.home, tiny_tokenizer, config, routes=routes)

    async def pause_at_2(n: int, rid: str) -> None:
        if n == 2 and len(engine.prompts) == 1:
            await routes.pause()
            asyncio.get_running_loop().call_later(2.0, routes.resume)

    engine.on_token = pause_at_2
    rec = await runner.run(reflow.make("test/Echo-v0", max_turns=3, deadline_s=None), seed=0)
    assert (rec.status, rec.termination, rec.n_turns) == ("truncated", "max_turns", 3), rec.error
    assert rec.timings["paused_s"] >= 1.9 and rec.timings["total_s"] > 2.0

    slow = CountingEngine(stop_every=5)
    routes = Routes(LimitedEngine(slow, 8), "w0")
    runner = EpisodeRunner(routes.home, tiny_tokenizer, config, routes=routes)

    async def slow_at_2(n: int, rid: str) -> None:  # the same two seconds spent generating: no pause
        if n == 2 and len(slow.prompts) == 1:
            await asyncio.sleep(2.0)

    slow.on_token = slow_at_2
    rec = await runner.run(reflow.make("test/Echo-v0", max_turns=3, deadline_s=None), seed=0)
    assert (rec.status, rec.termination) == ("timeout", "deadline")


async def test_a_remote_session_hears_of_a_pause_once_a_keepalive_and_of_all_of_it_before_the_step():
    """The runner polls a paused generation often (its deadline moves with the wait); the server hears
    once per `keepalive_s`, and of the rest before the env's next step."""
    from reflow.rollout.pauses import EpisodePauses

    class Remote:  # what EpisodePauses reads of a RemoteEnv
        keepalive_s = 0.2

        def __init__(self) -> None:
            self.unwrapped, self.reports = self, []

        async def extend_session(self, seconds: float) -> None:
            self.reports.append(seconds)

    env = Remote()
    routes = Routes(LimitedEngine(CountingEngine(), 8), "w0")
    route = routes.open("ep", "g")
    start = time.monotonic()
    pauses = EpisodePauses(env, route, deadline=start + 1.0)
    await routes.pause()
    call = asyncio.ensure_future(route.generate([5, 6, 7], SamplingParams(max_new_tokens=2), "t"))
    for _ in range(6):  # 0.3 s of polling at 0.05 s
        await asyncio.sleep(0.05)
        await pauses.take()
    assert pauses.waiting and len(env.reports) == 1 and 0.15 < env.reports[0] < 0.3
    routes.resume()
    await asyncio.wait_for(call, 5)
    await pauses.take(flush=True)
    assert not pauses.waiting and len(env.reports) == 2
    assert sum(env.reports) == pytest.approx(route.paused_total_s)
    assert pauses.deadline == pytest.approx(start + 1.0 + route.paused_total_s)
