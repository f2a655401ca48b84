"""The session protocol over `/v1/ws` on a real server, and `RemoteEnv` on it: the same answers as the
HTTP routes, errors that leave the socket open, auth at the handshake, reconnects, and the fallback to
HTTP on a server that has no WebSocket."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
from server_helpers import TOKEN, ServerProcess, remote_kwargs
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

import reflow
from reflow.env import InfraError, parse_assistant, play_episode, scripted_policy
from reflow.server import RemoteEnv
from reflow.server.transports import HttpTransport, WsTransport

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "6 * 7"}}</tool_call>'
TURN = {"content": "", "tool_calls": [{"name": "calculator", "arguments": {"expression": "6 * 7"}}]}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServerProcess(
        tmp_path_factory.mktemp("server"),
        "--max-sessions", "4",
        "--max-body-bytes", "4096",
        "--env-kwargs", '{"test/Slow-v0": {"step_s": 1.0}}',
    ) as server:  # fmt: skip
        yield server


def ws_url(server: ServerProcess) -> str:
    return server.url.replace("http://", "ws://", 1) + "/v1/ws"


class Socket:
    """A bare client of the protocol: `await sock.ask(op, ...)` sends one frame and reads its answer."""

    def __init__(self, ws) -> None:
        self.ws, self.last_id = ws, 0

    async def ask(self, op: str, session_id: str | None = None, body: dict | None = None) -> dict:
        self.last_id += 1
        frame = {"id": self.last_id, "op": op, "session_id": session_id, "body": body}
        await self.ws.send(json.dumps({k: v for k, v in frame.items() if v is not None}))
        return await self.raw_answer()

    async def raw_answer(self) -> dict:
        return json.loads(await asyncio.wait_for(self.ws.recv(), 30))


def opened(server: ServerProcess, token: str | None = TOKEN):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return connect(ws_url(server), additional_headers=headers, compression=None)


async def test_the_socket_answers_as_the_http_routes(server):
    async with opened(server) as ws:
        sock = Socket(ws)
        created = await sock.ask("create", body={"env_id": "reflow/Calc-v0", "seed": 0})
        assert created["id"] == 1 and created["status"] == 201
        with server.client() as http:
            over_http = http.post("/v1/sessions", json={"env_id": "reflow/Calc-v0", "seed": 0}).json()
            http.delete(f"/v1/sessions/{over_http['session_id']}")
        assert created["body"].keys() == over_http.keys()
        assert created["body"]["observation"] == over_http["observation"]  # the same seed, the same task
        sid = created["body"]["session_id"]

        step = {"turn_index": 0, "turn": TURN}
        first = await sock.ask("step", sid, step)
        assert first["status"] == 200 and first["body"]["replayed"] is False
        assert first["body"]["result"]["messages"][0]["content"] == "42"
        again = await sock.ask("step", sid, step)  # a retry of the same turn: the stored result
        assert again["body"]["replayed"] is True and again["body"]["result"] == first["body"]["result"]
        got = await sock.ask("get", sid)
        assert (got["status"], got["body"]["turns"], got["body"]["state"]) == (200, 1, "ready")

        other = await sock.ask("step", sid, {"turn_index": 0, "turn": {"content": "something else"}})
        assert (other["status"], other["body"]["code"]) == (409, "turn_mismatch")
        deleted = await sock.ask("delete", sid)
        assert deleted["body"] == {"session_id": sid, "state": "closed", "reason": "deleted"}
        assert (await sock.ask("delete", sid))["body"]["reason"] == "deleted"  # idempotent
        gone = await sock.ask("get", sid)
        assert (gone["status"], gone["body"]["code"]) == (410, "session_closed")


async def test_bad_frames_get_error_answers_and_the_socket_stays_open(server):
    async with opened(server) as ws:
        sock = Socket(ws)
        await ws.send("{not json")
        answer = await sock.raw_answer()
        assert (answer["id"], answer["status"], answer["body"]["code"]) == (None, 400, "bad_request")
        await ws.send("[1, 2]")
        assert (await sock.raw_answer())["status"] == 422
        unknown = await sock.ask("launch")
        assert unknown["status"] == 422 and "create, step, extend, get, delete" in unknown["body"]["message"]
        no_id = await sock.ask("step", body={"turn_index": 0, "turn": TURN})
        assert no_id["status"] == 422 and "session_id" in no_id["body"]["message"]
        missing = await sock.ask("step", "no-such-session", {"turn_index": 0, "turn": TURN})
        assert (missing["status"], missing["body"]["code"]) == (404, "session_not_found")
        strict = await sock.ask("create", body={"env_id": "reflow/Calc-v0", "seed": "7"})
        assert strict["status"] == 422 and "body.seed" in strict["body"]["message"]
        unserved = await sock.ask("create", body={"env_id": "acme/Nope-v0"})
        assert (unserved["status"], unserved["body"]["code"]) == (404, "env_not_found")
        await ws.send(json.dumps({"id": "big", "op": "create", "body": {"pad": "x" * 5000}}))
        big = await sock.raw_answer()
        assert (big["status"], big["body"]["code"]) == (413, "body_too_large")
        wide = {"id": "wide", "op": "create", "body": {"pad": "é" * 2500}}  # 2.5k characters, 5k bytes
        await ws.send(json.dumps(wide, ensure_ascii=False))
        assert (await sock.raw_answer())["status"] == 413

        # after all of that the socket still plays; a binary frame and a string id work too
        await ws.send(
            json.dumps({"id": "s-1", "op": "create", "body": {"env_id": "reflow/Calc-v0"}}).encode()
        )
        created = await sock.raw_answer()
        assert (created["id"], created["status"]) == ("s-1", 201)
        await sock.ask("delete", created["body"]["session_id"])


async def test_the_handshake_needs_the_token(server):
    for token, status, code in ((None, 401, "unauthorized"), ("wrong-token-0123456789", 403, "forbidden")):
        with pytest.raises(InvalidStatus) as refused:
            async with opened(server, token):
                pass
        response = refused.value.response
        assert response.status_code == status and json.loads(response.body)["code"] == code


async def test_capacity_is_refused_with_retry_after(server):
    async with opened(server) as ws:
        sock = Socket(ws)
        ids = []
        for _ in range(4):
            ids.append((await sock.ask("create", body={"env_id": "reflow/Calc-v0"}))["body"]["session_id"])
        full = await sock.ask("create", body={"env_id": "reflow/Calc-v0"})
        assert (full["status"], full["body"]["code"], full["headers"]) == (
            429,
            "at_capacity",
            {"Retry-After": "1"},
        )
        for sid in ids:
            await sock.ask("delete", sid)


async def test_a_session_outlives_its_socket(server):
    async with opened(server) as ws:
        created = await Socket(ws).ask("create", body={"env_id": "reflow/Calc-v0", "seed": 1})
    sid = created["body"]["session_id"]
    async with opened(server) as ws:
        sock = Socket(ws)
        step = await sock.ask("step", sid, {"turn_index": 0, "turn": TURN})
        assert step["status"] == 200 and step["body"]["result"]["messages"][0]["content"] == "42"
        await sock.ask("delete", sid)


# ---- RemoteEnv on the socket -----------------------------------------------------------------------
async def test_remote_env_plays_the_same_episodes_over_the_socket_and_over_http(server):
    summaries = {}
    for transport in ("auto", "http"):
        env = reflow.make("reflow/Remote-v0", **remote_kwargs(server, "reflow/Calc-v0", transport=transport))
        played = []
        for seed in range(3):  # slips on odd seeds: malformed calls and wrong answers travel too
            result = await play_episode(env, scripted_policy(env, 0.3 * (seed % 2), seed), seed=seed)
            played.append((result.status, result.reward, result.turns, result.messages))
        kind = type(env.unwrapped.transport)
        await env.close()
        summaries[transport] = (kind, played)
    assert summaries["auto"][0] is WsTransport and summaries["http"][0] is HttpTransport
    assert summaries["auto"][1] == summaries["http"][1]
    assert all(status == "ok" for status, *_ in summaries["auto"][1][::2])


async def test_remote_env_reconnects_when_its_socket_is_gone(server):
    env = reflow.make("reflow/Remote-v0", **remote_kwargs(server, "reflow/Calc-v0"))
    await env.reset(seed=2)
    remote = env.unwrapped
    first = remote.transport.ws
    first.transport.abort()  # the connection dies between two steps
    for _ in range(10):
        await asyncio.sleep(0.01)
    result = await env.step(parse_assistant(CALL, tools=remote.tools))
    assert result.messages[0]["content"] == "42" and remote.turn_index == 1
    assert remote.transport.ws is not first
    await env.close()


async def test_a_request_that_finds_the_socket_busy_waits_only_its_own_timeout(server):
    """A second request while a step runs (a close from another task) waits for the socket at most its
    own timeout; the step it waited on is not disturbed."""
    from reflow.server.transports import Unsent

    env = reflow.make("reflow/Remote-v0", **remote_kwargs(server, "test/Slow-v0"))
    await env.reset(seed=0)
    remote = env.unwrapped
    stepping = asyncio.create_task(env.step(parse_assistant("hi")))
    await asyncio.sleep(0.2)  # the step (1 s on the server) holds the socket now
    with pytest.raises(Unsent, match="stayed busy"):
        await remote.transport.send("get", remote.session_id, None, timeout_s=0.2)
    result = await stepping
    assert result.messages == [{"role": "user", "content": "ok"}] and remote.turn_index == 1
    await env.close()


async def test_a_session_deadline_over_the_socket_ends_the_episode_as_timeout(server):
    env = reflow.make("reflow/Remote-v0", **remote_kwargs(server, "reflow/Calc-v0", session_deadline_s=1.0))
    await env.reset(seed=0)
    await asyncio.sleep(1.3)  # past the deadline (a second, the shortest a client may ask for)
    result = await env.step(parse_assistant(CALL, tools=env.unwrapped.tools))
    assert result.done and result.info["status"] == "timeout" and result.info["termination"] == "deadline"
    await env.close()


async def test_bad_settings_are_refused_plainly():
    with pytest.raises(ValueError, match="transport must be one of auto, ws, http"):
        RemoteEnv("http://127.0.0.1:1", "reflow/Calc-v0", transport="pigeon")
    with pytest.raises(ValueError, match="must start with http:// or https://"):
        await RemoteEnv("127.0.0.1:8765", "reflow/Calc-v0").reset(seed=0)


async def test_an_unreachable_server_is_an_infra_error_after_bounded_retries(tmp_path):
    with ServerProcess(tmp_path) as server:
        url = server.url
    env = RemoteEnv(url, "reflow/Calc-v0", token=TOKEN, retries=2, backoff_s=0.01)
    with pytest.raises(InfraError, match=r"did not answer POST /v1/sessions after 3 tries: ConnectError"):
        await env.reset(seed=0)
    await env.close()


class NoWebSocketServer:
    """The app on uvicorn without WebSocket support (ws="none"), in a thread: an upgrade is a plain GET."""

    def __init__(self) -> None:
        import uvicorn

        from reflow.server.app import create_app
        from reflow.server.cli import bind
        from reflow.server.settings import ServerSettings

        self.sock = bind("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        app = create_app(ServerSettings(token=TOKEN, env_ids=["reflow/Calc-v0"]))
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", ws="none"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> NoWebSocketServer:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)


async def test_remote_env_falls_back_to_http_on_a_server_without_the_socket():
    with NoWebSocketServer() as server:
        env = reflow.make("reflow/Remote-v0", url=server.url, env_id="reflow/Calc-v0", token=TOKEN)
        result = await play_episode(env, scripted_policy(env, 0.0, 0), seed=0)
        assert result.status == "ok" and isinstance(env.unwrapped.transport, HttpTransport)
        await env.close()

        strict = RemoteEnv(server.url, "reflow/Calc-v0", token=TOKEN, transport="ws")
        with pytest.raises(InfraError, match="does not serve the WebSocket protocol"):
            await strict.reset(seed=0)
        await strict.close()
