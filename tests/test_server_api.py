"""The env server's HTTP protocol: auth, idempotent steps, limits and error bodies, on a real server."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
from server_helpers import TOKEN, ServerProcess, remote_kwargs

import reflow
from reflow.env import InfraError, parse_assistant, play_episode, scripted_policy

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "6 * 7"}}</tool_call>'


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServerProcess(
        tmp_path_factory.mktemp("server"),
        "--max-sessions", "3",
        "--max-body-bytes", "65536",
        "--step-timeout", "0.5",
        "--env-kwargs", '{"test/Slow-v0": {"step_s": 0.3}}',
        "--allow-client-kwarg", "test/Slow-v0:step_s=float:0..5",
    ) as server:  # fmt: skip
        yield server


@pytest.fixture
def http(server):
    with server.client() as client:
        yield client
        for sid in _created:  # every test leaves the server empty for the next one
            client.delete(f"/v1/sessions/{sid}")
        _created.clear()


_created: list[str] = []


def _create(http, env_id="reflow/Calc-v0", **body):
    r = http.post("/v1/sessions", json={"env_id": env_id, "seed": 0, **body})
    if r.status_code == 201:
        _created.append(r.json()["session_id"])
    return r


def _turn(text: str) -> dict:
    from dataclasses import asdict

    return asdict(parse_assistant(text))


def _error(r: httpx.Response, status: int, kind: str, code: str) -> dict:
    body = r.json()
    assert (r.status_code, body["error_kind"], body["code"]) == (status, kind, code), body
    assert body["message"]
    return body


# ---- auth -------------------------------------------------------------------------------------------
def test_every_route_but_health_needs_the_token(server):
    routes = [
        ("GET", "/v1/envs"),
        ("GET", "/v1/capacity"),
        ("GET", "/openapi.json"),
        ("GET", "/v1/sessions/x"),
    ]
    routes += [("POST", "/v1/sessions"), ("POST", "/v1/sessions/x/step"), ("DELETE", "/v1/sessions/x")]
    for method, path in routes:
        missing = httpx.request(method, server.url + path)
        _error(missing, 401, "agent", "unauthorized")
        assert missing.headers["WWW-Authenticate"] == "Bearer"
        for header in ("Token " + TOKEN, "Bearer", "Basic dXNlcjpwYXNz", TOKEN):
            _error(
                httpx.request(method, server.url + path, headers={"Authorization": header}),
                401,
                "agent",
                "unauthorized",
            )
        wrong = {"Authorization": "Bearer " + TOKEN[:-1] + "X"}
        _error(httpx.request(method, server.url + path, headers=wrong), 403, "agent", "forbidden")
    assert httpx.get(server.url + "/healthz").json()["status"] == "ok"
    right = httpx.get(server.url + "/v1/envs", headers=server.headers)
    ids = [e["env_id"] for e in right.json()["envs"]]
    assert "reflow/Calc-v0" in ids and "reflow/Remote-v0" not in ids  # a proxy is never served
    calc = next(e for e in right.json()["envs"] if e["env_id"] == "reflow/Calc-v0")
    assert calc["tools"][0]["function"]["name"] == "calculator" and calc["max_turns"] == 12
    doc = httpx.get(server.url + "/openapi.json", headers=server.headers).json()
    assert (
        "/v1/sessions/{session_id}/step" in doc["paths"]
        and "HTTPBearer" in doc["components"]["securitySchemes"]
    )


async def test_remote_env_with_a_wrong_token_fails_loudly(server):
    env = reflow.make("reflow/Remote-v0", **{**remote_kwargs(server, "reflow/Calc-v0"), "token": "nope" * 5})
    with pytest.raises(reflow.env.EnvError, match="403 forbidden"):
        await env.reset(seed=0)
    await env.close()


# ---- sessions and idempotent steps ------------------------------------------------------------------
def test_create_get_step_delete(http):
    created = _create(http).json()
    assert created["state"] == "ready" and created["turns"] == 0
    assert created["observation"]["tools"][0]["function"]["name"] == "calculator"
    assert "answer" not in created["observation"]["info"]  # the hidden task stays on the server
    sid = created["session_id"]
    step = http.post(f"/v1/sessions/{sid}/step", json={"turn_index": 0, "turn": _turn(CALL)}).json()
    assert step["replayed"] is False and step["result"]["messages"][0]["content"] == "42"
    assert http.get(f"/v1/sessions/{sid}").json()["turns"] == 1
    gone = http.delete(f"/v1/sessions/{sid}").json()
    assert gone == {"session_id": sid, "state": "closed", "reason": "deleted"}
    assert http.delete(f"/v1/sessions/{sid}").json()["reason"] == "deleted"  # idempotent
    _error(http.get(f"/v1/sessions/{sid}"), 410, "agent", "session_closed")
    _error(
        http.post(f"/v1/sessions/{sid}/step", json={"turn_index": 1, "turn": _turn(CALL)}),
        410,
        "agent",
        "session_closed",
    )
    _error(http.get("/v1/sessions/never"), 404, "agent", "session_not_found")
    _error(http.delete("/v1/sessions/never"), 404, "agent", "session_not_found")


def test_a_retried_step_returns_the_stored_result_and_runs_nothing_twice(http):
    sid = _create(http).json()["session_id"]
    body = {"turn_index": 0, "turn": _turn(CALL)}
    first = http.post(f"/v1/sessions/{sid}/step", json=body).json()
    again = http.post(f"/v1/sessions/{sid}/step", json=body).json()
    assert again["replayed"] is True and again["result"] == first["result"]
    assert http.get(f"/v1/sessions/{sid}").json()["turns"] == 1
    other = {"turn_index": 0, "turn": _turn("The answer is \\boxed{1}.")}
    _error(http.post(f"/v1/sessions/{sid}/step", json=other), 409, "agent", "turn_mismatch")
    _error(http.post(f"/v1/sessions/{sid}/step", json={**body, "turn_index": 2}), 409, "agent", "turn_index")
    final = {"turn_index": 1, "turn": _turn("The answer is \\boxed{1}.")}
    ended = http.post(f"/v1/sessions/{sid}/step", json=final).json()
    assert ended["state"] == "done" and ended["result"]["terminated"]
    assert http.post(f"/v1/sessions/{sid}/step", json=final).json()["result"] == ended["result"]
    _error(http.post(f"/v1/sessions/{sid}/step", json={**final, "turn_index": 2}), 409, "agent", "not_ready")
    assert http.get(f"/v1/sessions/{sid}").json()["status"] in ("ok", "truncated")


async def test_concurrent_retries_of_a_running_step_share_one_run(server):
    async with httpx.AsyncClient(base_url=server.url, headers=server.headers) as client:
        r = await client.post("/v1/sessions", json={"env_id": "test/Slow-v0", "seed": 0})
        sid = r.json()["session_id"]
        body = {"turn_index": 0, "turn": _turn("hi")}
        answers = await asyncio.gather(
            *(client.post(f"/v1/sessions/{sid}/step", json=body) for _ in range(3))
        )
        assert [a.status_code for a in answers] == [200] * 3
        assert sorted(a.json()["replayed"] for a in answers) == [False, True, True]
        assert (await client.get(f"/v1/sessions/{sid}")).json()["turns"] == 1
        await client.delete(f"/v1/sessions/{sid}")


async def test_remote_env_retries_a_step_whose_answer_was_lost(server):
    """The first answer of a step is dropped on the way back: the retry gets the stored result."""
    env = reflow.make("reflow/Remote-v0", **remote_kwargs(server, "reflow/Calc-v0", transport="http"))
    await env.reset(seed=0)
    remote = env.unwrapped
    real = remote.transport.http()
    lost = []

    async def drop_first_answer(request: httpx.Request) -> httpx.Response:
        response = await real.send(request)
        if request.url.path.endswith("/step") and not lost:
            lost.append(await response.aread())
            raise httpx.ReadError("connection reset while reading the answer", request=request)
        return response

    transport = httpx.MockTransport(drop_first_answer)
    remote.transport.client = httpx.AsyncClient(
        transport=transport, base_url=server.url, headers=server.headers
    )
    result = await env.step(parse_assistant(CALL, tools=remote.tools))
    assert lost and result.messages[0]["content"] == "42" and remote.turn_index == 1
    await env.close()
    await real.aclose()


async def test_remote_env_over_the_websocket_retries_a_step_whose_socket_was_lost(server, http):
    """The step ran, then its socket died before the answer was read: a new socket, the same turn
    index, the stored result; the step ran once."""
    from reflow.server.transports import Lost, WsTransport

    env = reflow.make("reflow/Remote-v0", **remote_kwargs(server, "reflow/Calc-v0", transport="ws"))
    await env.reset(seed=0)
    remote = env.unwrapped
    assert isinstance(remote.transport, WsTransport)
    first_socket, real_answer, lost = remote.transport.ws, remote.transport._answer, []

    async def lose_first_answer(ws, request_id, timeout_s):
        reply = await real_answer(ws, request_id, timeout_s)
        if not lost:
            lost.append(reply)
            raise Lost("socket reset while reading the answer")
        return reply

    remote.transport._answer = lose_first_answer
    result = await env.step(parse_assistant(CALL, tools=remote.tools))
    assert lost and lost[0]["body"]["replayed"] is False
    assert result.messages[0]["content"] == "42" and remote.turn_index == 1
    assert remote.transport.ws is not first_socket  # the lost socket was dropped, a new one opened
    assert http.get(f"/v1/sessions/{remote.session_id}").json()["turns"] == 1
    await env.close()


async def test_an_env_whose_episode_ended_ok_is_reused_and_others_are_closed(server, http):
    before = http.get("/v1/capacity").json()["idle_envs"]
    env = reflow.make("reflow/Remote-v0", **remote_kwargs(server, "reflow/Math-v0"))
    won = await play_episode(env, scripted_policy(env, 0.0, 0), seed=0)
    cap = http.get("/v1/capacity").json()
    assert won.status == "ok" and cap["idle_envs"] == before + 1 and cap["live_sessions"] == 0
    again = await play_episode(env, scripted_policy(env, 0.0, 1), seed=1)  # reuses it: none is built
    assert again.success and http.get("/v1/capacity").json()["idle_envs"] == before + 1
    await env.close()
    slow = _create(http, env_id="test/Slow-v0", env_kwargs={"step_s": 2.0}).json()["session_id"]
    timed_out = http.post(f"/v1/sessions/{slow}/step", json={"turn_index": 0, "turn": _turn("hi")}).json()
    assert timed_out["result"]["info"]["status"] == "timeout"
    assert http.get("/v1/capacity").json()["idle_envs"] == before + 1  # a cancelled env is not kept


# ---- limits -----------------------------------------------------------------------------------------
def test_capacity_429_with_retry_after_then_room_again(http):
    ids = [_create(http).json()["session_id"] for _ in range(3)]
    cap = http.get("/v1/capacity").json()
    assert (cap["live_sessions"], cap["available"], cap["max_sessions"]) == (3, 0, 3)
    full = _create(http)
    _error(full, 429, "infra", "at_capacity")
    assert full.headers["Retry-After"] == "1"
    http.delete(f"/v1/sessions/{ids[0]}")
    assert _create(http).status_code == 201


async def test_remote_env_waits_out_a_full_server(server, http):
    ids = [_create(http).json()["session_id"] for _ in range(3)]
    threading.Timer(0.4, lambda: http.delete(f"/v1/sessions/{ids[0]}")).start()
    env = reflow.make("reflow/Remote-v0", **remote_kwargs(server, "reflow/Calc-v0"))
    obs = await env.reset(seed=1)  # 429 with Retry-After: 1, then a free slot
    assert obs.messages and env.unwrapped.session_id
    await env.close()


async def test_remote_env_gives_up_on_a_server_that_stays_full(server, http):
    [_create(http) for _ in range(3)]
    env = reflow.make("reflow/Remote-v0", **remote_kwargs(server, "reflow/Calc-v0", retries=1))
    with pytest.raises(reflow.env.InfraError, match="at_capacity"):  # capacity is infrastructure
        await env.reset(seed=1)
    await env.close()


def test_request_body_limit(http):
    sid = _create(http).json()["session_id"]
    huge = {"turn_index": 0, "turn": {"content": "x" * 70_000}}
    _error(http.post(f"/v1/sessions/{sid}/step", json=huge), 413, "agent", "body_too_large")

    def chunks():  # no Content-Length: the limit must hold on the stream too
        for _ in range(20):
            yield b"x" * 8192

    _error(http.post(f"/v1/sessions/{sid}/step", content=chunks()), 413, "agent", "body_too_large")
    ok = http.post(f"/v1/sessions/{sid}/step", json={"turn_index": 0, "turn": _turn(CALL)})
    assert ok.status_code == 200


def test_bad_requests_are_agent_errors(http):
    _error(http.post("/v1/sessions", json={"env_id": "acme/Nope-v0"}), 404, "agent", "env_not_found")
    _error(http.post("/v1/sessions", content=b"{not json"), 422, "agent", "invalid_request")
    _error(
        http.post("/v1/sessions", json={"env_id": "reflow/Calc-v0", "surprise": 1}),
        422,
        "agent",
        "invalid_request",
    )
    _error(_create(http, task={"id": "t"}), 422, "agent", "bad_task")  # lacks question and answer
    _error(_create(http, env_kwargs={"sandbox": "subprocess"}), 403, "agent", "env_kwargs_refused")
    _error(http.get("/v1/nothing"), 404, "agent", "not_found")
    _error(http.put("/v1/capacity"), 405, "agent", "method_not_allowed")
    sid = _create(http).json()["session_id"]
    _error(
        http.post(f"/v1/sessions/{sid}/step", json={"turn_index": -1, "turn": {}}),
        422,
        "agent",
        "invalid_request",
    )
    _error(http.post(f"/v1/sessions/{sid}/step", json={"turn_index": 0}), 422, "agent", "invalid_request")


def test_step_timeout_and_session_deadline_end_the_episode_as_timeout(http):
    slow = _create(http, env_id="test/Slow-v0", env_kwargs={"step_s": 2.0}).json()["session_id"]
    r = http.post(f"/v1/sessions/{slow}/step", json={"turn_index": 0, "turn": _turn("hi")}).json()
    assert r["state"] == "done"
    assert (r["result"]["info"]["status"], r["result"]["info"]["termination"]) == ("timeout", "step_timeout")

    short = _create(http, env_id="test/Slow-v0", env_kwargs={"step_s": 2.0}, deadline_s=1)
    short = short.json()["session_id"]
    time.sleep(0.7)  # the deadline (a second, the shortest allowed) now ends before the step timeout
    r = http.post(f"/v1/sessions/{short}/step", json={"turn_index": 0, "turn": _turn("hi")}).json()
    assert (r["result"]["info"]["status"], r["result"]["info"]["termination"]) == ("timeout", "deadline")


async def test_an_env_crash_in_step_is_an_env_error_result(server):
    env = reflow.make("reflow/Remote-v0", **remote_kwargs(server, "test/Crashy-v0"))
    await env.reset(seed=0)
    r1 = await env.step(parse_assistant("one"))
    r2 = await env.step(parse_assistant("two"))
    await env.close()
    assert not r1.done and r2.info["status"] == "env_error" and "error id" in r2.info["error"]
    assert "divided by zero" not in r2.info["error"]  # the cause is in the server's log only


async def test_a_session_closed_under_the_client_is_an_infra_error(server, http):
    env = reflow.make("reflow/Remote-v0", **remote_kwargs(server, "reflow/Calc-v0"))
    await env.reset(seed=0)
    http.delete(f"/v1/sessions/{env.unwrapped.session_id}")
    result = await env.step(parse_assistant(CALL))
    assert result.info["status"] == "infra_error" and "lost the session" in result.info["error"]
    with pytest.raises(InfraError):
        await env.unwrapped.step(parse_assistant(CALL))
    await env.close()
