"""Session lifecycle on a real server: the idle reaper (sandboxes included) and graceful shutdown."""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import httpx
import pytest
from sandbox_helpers import BACKENDS
from server_helpers import TOKEN, ServerProcess, remote_kwargs

import reflow
from reflow.env import parse_assistant, play_episode, scripted_policy
from reflow.server.schemas import TRANSITIONS, InvalidTransition, check_transition

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "1 + 1"}}</tool_call>'


def test_serve_envs_refuses_to_start_open_to_the_network(tmp_path, monkeypatch, capsys):
    from reflow.server.cli import main

    def refused(argv: list[str], text: str) -> None:  # a usage error: exit code 2, one line on stderr
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("reflow: error: ") and text in err and err.count("\n") == 1, err

    monkeypatch.delenv("REFLOW_SERVER_TOKEN", raising=False)
    refused(["--port", "0"], "no token")
    refused(["--no-auth", "--host", "0.0.0.0"], "only on a loopback host")
    short = tmp_path / "short"
    short.write_text("abc")
    short.chmod(0o600)
    refused(["--token-file", str(short)], "at least 16 characters")
    monkeypatch.setenv("REFLOW_SERVER_TOKEN", "too short")
    refused(["--port", "0"], "at least 16")


def test_the_state_table_allows_only_its_moves():
    assert check_transition("ready", "stepping") == "stepping"
    for state, allowed in TRANSITIONS.items():
        for new in TRANSITIONS:
            if new not in allowed:
                with pytest.raises(InvalidTransition):
                    check_transition(state, new)
    assert TRANSITIONS["closed"] == frozenset()


async def test_the_reaper_closes_idle_sessions(tmp_path):
    with ServerProcess(tmp_path, "--idle-timeout", "1") as server, server.client() as http:
        env = reflow.make("reflow/Remote-v0", **remote_kwargs(server, "reflow/Calc-v0"))
        await env.reset(seed=0)
        first = await env.step(parse_assistant(CALL))
        ended = http.post("/v1/sessions", json={"env_id": "reflow/Math-v0", "seed": 0}).json()["session_id"]
        turn = {"content": "\\boxed{0}", "tool_calls": [], "finish_reason": "stop"}
        assert (
            http.post(f"/v1/sessions/{ended}/step", json={"turn_index": 0, "turn": turn}).json()["state"]
            == "done"
        )
        assert http.get("/v1/capacity").json()["live_sessions"] == 1  # a finished episode holds no env
        await asyncio.sleep(1.8)
        assert http.get("/v1/capacity").json()["live_sessions"] == 0
        for sid in (env.unwrapped.session_id, ended):
            body = http.get(f"/v1/sessions/{sid}").json()
            assert (body["code"], body["error_kind"]) == ("session_closed", "agent") and "idle" in body[
                "message"
            ]
        # the client's next step: the session is gone, so the episode is an infra error
        second = await env.step(parse_assistant(CALL))
        await env.close()
    assert not first.done and second.info["status"] == "infra_error" and "(idle)" in second.info["error"]


class ThreadServer:
    """uvicorn in a thread of this process, so a test can look at this process's sandbox pools."""

    def __init__(self, settings) -> None:
        import uvicorn

        from reflow.server.app import create_app
        from reflow.server.cli import bind

        self.sock = bind("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(create_app(settings), log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> ThreadServer:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@pytest.mark.parametrize("kind", BACKENDS)
async def test_reaping_and_ending_release_the_sandbox(kind):
    from reflow.sandbox import shared_pool
    from reflow.server.settings import ServerSettings

    settings = ServerSettings(
        token=TOKEN,
        idle_timeout_s=0.6,
        reaper_interval_s=0.1,
        env_ids=["reflow/PyCode-v0"],
        env_kwargs={"reflow/PyCode-v0": {"sandbox": kind}},
        allow_uncapped_sandbox=True,  # this test is about releasing sandboxes, wherever they run
    )
    with ThreadServer(settings) as server:
        pool = shared_pool(kind)  # the pool the server's PyCode envs draw from
        env = reflow.make("reflow/Remote-v0", url=server.url, env_id="reflow/PyCode-v0", token=TOKEN)
        policy = scripted_policy(env, 0.0, 0)
        obs = await env.reset(seed=0)
        assert obs.info["sandbox"] == kind
        text = policy(obs.messages, obs.tools)
        result = await env.step(parse_assistant(text, tools=env.unwrapped.tools))
        assert result.messages[0]["content"].startswith("exit code: 0")
        assert pool.snapshot()["leased"] == 1
        for _ in range(40):  # the reaper runs every 0.1 s and closes the session after 0.6 s idle
            await asyncio.sleep(0.1)
            if pool.snapshot()["leased"] == 0:
                break
        assert pool.snapshot()["leased"] == 0
        await env.close()

        # a whole episode: the sandbox goes back as soon as the answer is graded
        env = reflow.make("reflow/Remote-v0", url=server.url, env_id="reflow/PyCode-v0", token=TOKEN)
        played = await play_episode(env, scripted_policy(env, 0.0, 1), seed=1)
        assert played.success and pool.snapshot()["leased"] == 0
        await env.close()


def test_graceful_shutdown_finishes_the_step_in_flight_and_releases_sessions(tmp_path):
    server = ServerProcess(
        tmp_path, "--env-kwargs", '{"test/Slow-v0": {"step_s": 1.0}}', "--log-level", "info"
    ).start()
    http = server.client()
    busy = http.post("/v1/sessions", json={"env_id": "test/Slow-v0"}).json()["session_id"]
    idle = http.post("/v1/sessions", json={"env_id": "reflow/Calc-v0", "seed": 0}).json()["session_id"]
    answer = {}

    def step() -> None:
        body = {"turn_index": 0, "turn": {"content": "hi"}}
        with server.client() as own:
            answer["r"] = own.post(f"/v1/sessions/{busy}/step", json=body)

    stepping = threading.Thread(target=step)
    stepping.start()
    time.sleep(0.4)  # the step is running on the server now
    server.terminate()
    stepping.join(30)
    assert server.wait(30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once it has stopped
    r = answer["r"]
    assert r.status_code == 200 and r.json()["result"]["messages"] == [{"role": "user", "content": "ok"}]
    logs = server.logs()
    assert "shutdown: released 2 live sessions" in logs, logs
    with pytest.raises(httpx.ConnectError):
        http.get(f"/v1/sessions/{idle}")
    http.close()
    server.stop()
