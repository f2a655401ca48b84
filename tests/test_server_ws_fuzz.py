"""Property-based fuzzing of both WebSocket protocols (`/v1/ws` and OpenEnv's `/ws`) at the frame level,
on a real server: text and binary frames of any bytes, JSON of any shape, frames shaped like the protocol
with fuzzed fields (on a live session too), deep nesting, frames over the body limit and over twice it.

Every frame gets a well-formed answer (ours: never a 500; OpenEnv's: an error, observation or state
frame) or a close with a code the protocol names (1000 after OpenEnv's `close`, 1009 for a frame too
big to read); after each example a fresh client is served; and the server never logs a crashed handler.
"""

from __future__ import annotations

import json

import pytest
from server_helpers import ServerProcess

from reflow.server.routes.ws import OPS

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from websockets.exceptions import ConnectionClosed  # noqa: E402
from websockets.sync.client import connect  # noqa: E402

pytestmark = [pytest.mark.security, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

LIMIT = 4096
EXAMPLES = 150  # per protocol
LIVE = "$LIVE"  # stands for the id of a live session in a generated frame
ENV_ID = "reflow/Calc-v0"
OPENENV_PATH = f"/openenv/{ENV_ID}/ws"
CRASH_SIGNS = ("Exception in ASGI application", "the WebSocket request")  # uvicorn's, then ws.py's

scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=16), st.just(LIVE))
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)
tool_calls = st.lists(
    st.fixed_dictionaries(
        {"name": st.sampled_from(["calculator", "nope", ""])},
        optional={
            "arguments": st.dictionaries(st.sampled_from(["expression", "x"]), json_values, max_size=2)
        },
    ),
    max_size=3,
)
turns = st.fixed_dictionaries(
    {},
    optional={
        "content": st.text(max_size=40) | st.just("<tool_call>" * 50),
        "tool_calls": tool_calls | json_values,
        "raw_text": st.text(max_size=20),
        "text": st.text(max_size=40) | st.just("<tool_call>" * 80),
    },
)
# Frames whatever the protocol: anything at all, deep nesting, and frames over the limit.
any_frame = st.one_of(
    st.text(max_size=64),
    st.binary(max_size=64),
    json_values.map(json.dumps),
    st.integers(1, 5000).map(lambda n: "[" * n),
    st.integers(1, 400).map(lambda n: '{"a":' * n + "1" + "}" * n),
    st.sampled_from([LIMIT + 1, 2 * LIMIT + 1]).map(lambda n: "x" * n),
    st.just(json.dumps({"pad": "é" * (LIMIT // 2 + 1)}, ensure_ascii=False)),  # under the limit in chars
)
our_frames = st.fixed_dictionaries(
    {"op": st.sampled_from([*OPS, "launch"])},
    optional={
        "id": json_values,
        "session_id": st.just(LIVE) | st.text(max_size=70) | json_values,
        "body": st.one_of(
            json_values,
            st.fixed_dictionaries(
                {"env_id": st.sampled_from([ENV_ID, "acme/Nope-v0", ""])},
                optional={"seed": json_values, "deadline_s": json_values, "task": json_values},
            ),
            st.fixed_dictionaries(
                {"turn_index": st.integers(-1, 2) | json_values, "turn": turns | json_values}
            ),
            st.fixed_dictionaries({"seconds": st.floats(allow_nan=True) | json_values}),
        ),
    },
).map(json.dumps)
openenv_frames = st.fixed_dictionaries(
    {"type": st.sampled_from(["reset", "step", "state", "close", "mcp", "bogus"])},
    optional={
        "data": st.one_of(json_values, turns, st.fixed_dictionaries({}, optional={"seed": json_values}))
    },
).map(json.dumps)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    args = ["--env", ENV_ID, "--max-body-bytes", str(LIMIT), "--max-sessions", "2000", "--idle-timeout", "5"]
    with ServerProcess(tmp_path_factory.mktemp("wsfuzz"), *args) as server:
        yield server
        logs = server.logs()
    assert not [sign for sign in CRASH_SIGNS if sign in logs], logs[-3000:]


def opened(server: ServerProcess, path: str):
    url = server.url.replace("http://", "ws://", 1) + path
    return connect(url, additional_headers=server.headers, max_size=None, open_timeout=30)


def exchange(ws, frame: str | bytes) -> dict | int:
    """The answer to one frame (parsed), or the close code if the server closed the socket instead."""
    try:
        ws.send(frame)
        return json.loads(ws.recv(timeout=30))
    except ConnectionClosed as e:
        assert e.rcvd is not None, f"the server dropped the socket without a close frame: {e}"
        return e.rcvd.code


def check_ours(reply: dict | int) -> bool:
    """Whether the socket is still open after this answer (a failed check raises)."""
    if isinstance(reply, int):
        assert reply == 1009, reply  # only a frame too big to read closes our socket
        return False
    assert set(reply) >= {"id", "status", "body"} and 200 <= reply["status"] < 500, reply
    if reply["status"] >= 400:
        assert reply["body"]["error_kind"] in ("agent", "env", "infra") and reply["body"]["message"], reply
    return True


def check_openenv(reply: dict | int) -> bool:
    if isinstance(reply, int):
        assert reply in (1000, 1009), reply  # its `close`, or a frame too big to read
        return False
    assert reply.get("type") in ("error", "observation", "state"), reply
    if reply["type"] == "error":
        assert reply["data"]["code"] and isinstance(reply["data"]["message"], str), reply
        return reply["data"]["code"] != "CAPACITY_REACHED"
    return True


FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)


@FUZZ
@given(live=st.booleans(), frames=st.lists(our_frames | any_frame, min_size=1, max_size=4))
def test_our_socket_answers_every_frame(server, live, frames):
    with opened(server, "/v1/ws") as ws:
        sid = "no-session"
        if live:
            created = exchange(ws, json.dumps({"id": 0, "op": "create", "body": {"env_id": ENV_ID}}))
            sid = created["body"]["session_id"]
        for frame in frames:
            if isinstance(frame, str):
                frame = frame.replace(json.dumps(LIVE), json.dumps(sid))
            if not check_ours(exchange(ws, frame)):
                break
    with opened(server, "/v1/ws") as fresh:  # and the next client is served
        assert exchange(fresh, json.dumps({"id": 1, "op": "get", "session_id": "none"}))["status"] == 404


@FUZZ
@given(reset=st.booleans(), frames=st.lists(openenv_frames | any_frame, min_size=1, max_size=4))
def test_openenv_socket_answers_every_frame(server, reset, frames):
    with opened(server, OPENENV_PATH) as ws:
        if reset:
            assert exchange(ws, json.dumps({"type": "reset", "data": {"seed": 0}}))["type"] == "observation"
        for frame in frames:
            if not check_openenv(exchange(ws, frame)):
                break
    with opened(server, OPENENV_PATH) as fresh:
        assert exchange(fresh, json.dumps({"type": "state"}))["type"] == "state"
