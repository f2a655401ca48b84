"""Connection limits of the env server, with real sockets on a real server: a request head must come
within the head timeout (slowloris), open connections are capped with WebSockets counted, and an idle
WebSocket of either protocol is closed."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest
from server_helpers import ServerProcess
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

pytestmark = [pytest.mark.security, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

MAX_CONNECTIONS = 4
HEAD_TIMEOUT_S = 1.0
WS_IDLE_S = 4.0
PATHS = ("/v1/ws", "/openenv/reflow/Calc-v0/ws")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    args = ["--env", "reflow/Calc-v0", "--max-connections", str(MAX_CONNECTIONS)]
    args += ["--head-timeout", str(HEAD_TIMEOUT_S), "--ws-idle-timeout", str(WS_IDLE_S)]
    with ServerProcess(tmp_path_factory.mktemp("connections"), *args) as server:
        yield server


def address(server: ServerProcess) -> tuple[str, int]:
    url = urlsplit(server.url)
    return url.hostname, url.port


def opened(server: ServerProcess, path: str):
    url = server.url.replace("http://", "ws://", 1) + path
    return connect(url, additional_headers=server.headers, open_timeout=30)


def read_until_closed(sock: socket.socket, within_s: float, trickle: bool = False) -> bytes | None:
    """What the server sent before it closed the connection, or None if it was still open after
    `within_s`; with `trickle`, one more header byte goes out every 0.2 s meanwhile."""
    sock.settimeout(0.2)
    received, deadline = b"", time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if trickle:
                sock.sendall(b"x")
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except (BrokenPipeError, ConnectionResetError):
            return received
        if not chunk:
            return received
        received += chunk
    return None


def get_healthz(sock: socket.socket) -> bytes:
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n")
    sock.settimeout(10)
    received = b""
    while b"\r\n\r\n" not in received:
        received += sock.recv(65536)
    head, _, body = received.partition(b"\r\n\r\n")
    length = int(re.search(rb"content-length: *(\d+)", head, re.IGNORECASE).group(1))
    while len(body) < length:
        body += sock.recv(65536)
    return head.split(b"\r\n", 1)[0]


def test_a_request_head_that_stops_half_way_is_answered_408_and_closed(server):
    with socket.create_connection(address(server)) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nX-Slow: ")
        received = read_until_closed(sock, within_s=10 * HEAD_TIMEOUT_S)
    assert received is not None, "the server kept a half-sent request head open"
    status, _, body = received.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 408") and json.loads(body)["code"] == "request_timeout"


def test_a_head_sent_a_byte_at_a_time_is_cut_off(server):
    with socket.create_connection(address(server)) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nX-Slow: ")
        assert read_until_closed(sock, within_s=10 * HEAD_TIMEOUT_S, trickle=True) is not None


def test_a_connection_that_sends_nothing_is_closed(server):
    with socket.create_connection(address(server)) as sock:
        assert read_until_closed(sock, within_s=10 * HEAD_TIMEOUT_S) == b""


def test_an_idle_keep_alive_connection_outlives_the_head_timeout(server):
    with socket.create_connection(address(server)) as sock:
        assert get_healthz(sock) == b"HTTP/1.1 200 OK"
        time.sleep(2 * HEAD_TIMEOUT_S)  # idle between requests: the keep-alive timeout's business
        assert get_healthz(sock) == b"HTTP/1.1 200 OK"


async def test_websockets_count_toward_the_connection_limit(server):
    async with contextlib.AsyncExitStack() as stack:
        sockets = [
            await stack.enter_async_context(opened(server, PATHS[i % 2])) for i in range(MAX_CONNECTIONS)
        ]
        for path in PATHS:
            with pytest.raises(InvalidStatus) as refused:
                await opened(server, path)
            response = refused.value.response
            assert response.status_code == 503 and response.headers["Retry-After"] == "1"
            assert json.loads(response.body)["code"] == "too_many_connections"
        async with httpx.AsyncClient(base_url=server.url) as http:
            assert (await http.get("/healthz")).status_code == 503  # uvicorn counts them too
        await sockets[0].close()
        await until_a_websocket_opens(server)  # the closed one's place is free again


async def until_a_websocket_opens(server: ServerProcess) -> None:
    for _ in range(100):  # the server sees a close a moment after the client
        try:
            async with opened(server, PATHS[0]):
                return
        except InvalidStatus:
            await asyncio.sleep(0.05)
    pytest.fail("no WebSocket could be opened: closed ones did not free their places")


async def test_an_idle_websocket_is_closed_and_a_busy_one_is_not(server):
    await until_a_websocket_opens(server)
    async with (
        opened(server, PATHS[0]) as busy,
        opened(server, PATHS[0]) as idle,
        opened(server, PATHS[1]) as idle2,
    ):
        start = time.monotonic()
        while time.monotonic() - start < 1.5 * WS_IDLE_S:
            await busy.send(json.dumps({"id": 1, "op": "get", "session_id": "none"}))
            assert json.loads(await busy.recv())["status"] == 404
            await asyncio.sleep(WS_IDLE_S / 4)
        for ws in (idle, idle2):
            with pytest.raises(ConnectionClosed) as closed:
                await asyncio.wait_for(ws.recv(), 10 * WS_IDLE_S)
            assert closed.value.rcvd.code == 1000 and "idle" in closed.value.rcvd.reason
