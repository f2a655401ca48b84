"""The env server's request limits against a hostile client, on a real server: every WebSocket frame of
both protocols is held to the body limit, an action of a megabyte of unclosed `<tool_call>` tags is
answered at once (the tool-call parser is linear), OpenEnv actions are bounded like the HTTP turn,
deeply nested JSON and binary frames get error frames, and a session cannot be born expired."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from server_helpers import ServerProcess
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

pytestmark = [pytest.mark.security, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

LIMIT = 1 << 20  # the server's default body limit
TAG = "<tool_call>"
REFUSED_S = 0.1  # a megabyte refused, or refused unparsed: at once
ANSWERED_S = 1.0  # a megabyte played: its JSON and the step's hash of it cost tens of ms on a loaded CI
CALL = {"name": "calculator", "arguments": {"expression": "6 * 7"}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServerProcess(tmp_path_factory.mktemp("limits"), "--env", "reflow/Calc-v0") as server:
        yield server


def ws_url(server: ServerProcess, path: str) -> str:
    return server.url.replace("http://", "ws://", 1) + path


def ours(server: ServerProcess, **kwargs):
    return connect(
        ws_url(server, "/v1/ws"), additional_headers=server.headers, **{"max_size": None, **kwargs}
    )


def openenv(server: ServerProcess, **kwargs):
    url = ws_url(server, "/openenv/reflow/Calc-v0/ws")
    return connect(url, additional_headers=server.headers, **{"max_size": None, **kwargs})


async def exchange(ws, frame: str | bytes) -> tuple[dict, float]:
    """Send one frame; its answer and how long it took to come."""
    start = time.perf_counter()
    await ws.send(frame)
    answer = json.loads(await asyncio.wait_for(ws.recv(), 30))
    return answer, time.perf_counter() - start


def tags(frame_bytes: int) -> str:
    """Unclosed `<tool_call>` tags filling about `frame_bytes` bytes."""
    return TAG * (frame_bytes // len(TAG))


async def openenv_reset(ws) -> None:
    answer, _ = await exchange(ws, json.dumps({"type": "reset", "data": {"seed": 1}}))
    assert answer["type"] == "observation", answer


def test_an_http_step_of_a_megabyte_of_tags_is_answered_or_refused_at_once(server):
    with server.client() as http:
        sid = http.post("/v1/sessions", json={"env_id": "reflow/Calc-v0", "seed": 1}).json()["session_id"]
        for size, status, bound in ((LIMIT - 1024, 200, ANSWERED_S), (LIMIT + 1024, 413, REFUSED_S)):
            body = {"turn_index": 0, "turn": {"content": tags(size), "raw_text": None}}
            start = time.perf_counter()
            r = http.post(f"/v1/sessions/{sid}/step", json=body)
            took = time.perf_counter() - start
            assert r.status_code == status, r.text[:300]
            assert took < bound, (size, took)


async def test_a_frame_of_a_megabyte_of_tags_is_answered_or_refused_at_once_on_our_socket(server):
    async with ours(server) as ws:
        created, _ = await exchange(
            ws, json.dumps({"id": 1, "op": "create", "body": {"env_id": "reflow/Calc-v0"}})
        )
        sid = created["body"]["session_id"]
        for size, status, bound in ((LIMIT - 1024, 200, ANSWERED_S), (LIMIT + 1024, 413, REFUSED_S)):
            turn = {"content": "", "tool_calls": [], "raw_text": tags(size)}
            frame = {"id": 2, "op": "step", "session_id": sid, "body": {"turn_index": 0, "turn": turn}}
            answer, took = await exchange(ws, json.dumps(frame))
            assert answer["status"] == status, str(answer)[:300]
            assert took < bound, (size, took)


async def test_an_openenv_action_of_a_megabyte_of_tags_is_answered_at_once(server):
    async with openenv(server) as ws:
        await openenv_reset(ws)
        answer, took = await exchange(ws, json.dumps({"type": "step", "data": {"text": tags(LIMIT - 1024)}}))
        assert answer["data"]["code"] == "VALIDATION_ERROR" and "64 tool calls" in answer["data"]["message"]
        assert took < REFUSED_S, took
        over, took = await exchange(ws, json.dumps({"type": "step", "data": {"text": tags(LIMIT + 1024)}}))
        assert over["data"]["code"] == "VALIDATION_ERROR" and "bytes" in over["data"]["message"], over
        assert took < REFUSED_S, took
        text = TAG * 64 + "x" * (LIMIT - 2048)  # as many unclosed tags as a turn may have, and a long tail
        answer, took = await exchange(ws, json.dumps({"type": "step", "data": {"text": text}}))
        assert answer["type"] == "observation", str(answer)[:300]
        (message,) = answer["data"]["observation"]["messages"]
        assert "no closing </tool_call>" in message["content"]  # one cut-off call, answered to the model
        assert took < ANSWERED_S, took


async def test_frames_far_over_the_limit_close_the_socket_unread(server):
    for opened in (ours, openenv):
        async with opened(server) as ws:
            with pytest.raises(ConnectionClosed) as closed:  # on the send, when it is cut off, or after
                await ws.send("x" * (2 * LIMIT + 1))
                await asyncio.wait_for(ws.recv(), 30)
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009  # message too big


async def test_the_server_does_not_compress_frames(server):
    for opened in (ours, openenv):
        async with opened(server, compression="deflate") as ws:  # the client offers permessage-deflate
            assert ws.response.headers.get("Sec-WebSocket-Extensions") is None


async def test_openenv_actions_are_bounded_like_the_http_turn(server):
    async with openenv(server) as ws:
        await openenv_reset(ws)
        calls = {"type": "step", "data": {"tool_calls": [CALL] * 65}}
        answer, _ = await exchange(ws, json.dumps(calls))
        assert answer["data"]["code"] == "VALIDATION_ERROR" and "64" in json.dumps(answer), answer
        text = "".join(f"<tool_call>{json.dumps(CALL)}</tool_call>" for _ in range(65))
        answer, _ = await exchange(ws, json.dumps({"type": "step", "data": {"text": text}}))
        assert answer["data"]["code"] == "VALIDATION_ERROR" and "64" in answer["data"]["message"], answer
        answer, _ = await exchange(ws, json.dumps({"type": "step", "data": {"tool_calls": [CALL] * 64}}))
        assert answer["type"] == "observation" and len(answer["data"]["observation"]["messages"]) == 64


async def test_deeply_nested_json_gets_an_error_frame_and_the_socket_plays_on(server):
    nested = "[" * 100_000
    async with ours(server) as ws:
        answer, _ = await exchange(ws, nested)
        assert (answer["status"], answer["body"]["code"]) == (400, "bad_request"), answer
        deep_body = {
            "id": 3,
            "op": "create",
            "body": {"env_id": "reflow/Calc-v0", "task": {"deep": json.loads("[" * 150 + "]" * 150)}},
        }
        assert (await exchange(ws, json.dumps(deep_body)))[0]["status"] == 422
        created, _ = await exchange(
            ws, json.dumps({"id": 4, "op": "create", "body": {"env_id": "reflow/Calc-v0"}})
        )
        assert created["status"] == 201
    async with openenv(server) as ws:
        answer, _ = await exchange(ws, nested)
        assert answer["data"]["code"] == "INVALID_JSON", answer
        await openenv_reset(ws)
    mcp = httpx.post(server.url + "/openenv/reflow/Calc-v0/mcp", content=nested, headers=server.headers)
    assert mcp.status_code == 200 and mcp.json()["error"]["code"] == -32700  # JSON-RPC's parse error
    assert httpx.get(server.url + "/healthz").json()["status"] == "ok"


async def test_openenv_takes_binary_frames_and_refuses_bytes_that_are_not_utf8(server):
    async with openenv(server) as ws:
        answer, _ = await exchange(ws, json.dumps({"type": "reset", "data": {"seed": 2}}).encode())
        assert answer["type"] == "observation", answer
        answer, _ = await exchange(ws, b"\xff\xfe{")
        assert answer["data"]["code"] == "INVALID_JSON", answer
        assert (await exchange(ws, json.dumps({"type": "state"})))[0]["type"] == "state"


@pytest.mark.parametrize("deadline", [5e-324, 0.5])
def test_a_deadline_under_a_second_is_refused(server, deadline):
    with server.client() as http:
        r = http.post("/v1/sessions", json={"env_id": "reflow/Calc-v0", "deadline_s": deadline})
        assert r.status_code == 422 and "deadline_s" in r.json()["message"], r.text
        assert (
            http.post("/v1/sessions", json={"env_id": "reflow/Calc-v0", "deadline_s": 1}).status_code == 201
        )


async def test_an_openenv_reset_refuses_a_deadline_under_a_second(server):
    async with openenv(server) as ws:
        answer, _ = await exchange(ws, json.dumps({"type": "reset", "data": {"deadline_s": 5e-324}}))
        assert answer["data"]["code"] == "VALIDATION_ERROR" and "deadline_s" in json.dumps(answer), answer
