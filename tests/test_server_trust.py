"""Who and what the env server trusts, against a hostile client: it never runs model code on the host
(nor in bubblewrap sandboxes no cgroup bounds) unless told to, with --no-auth it answers only loopback pages, clients set only the env kwargs the
operator declared (and values in their ranges), it serves only the envs it lists, and its errors carry
no server detail. Real servers on loopback."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
import warnings

import httpx
import pytest
from fake_envs import BUILTIN_ENVS
from server_helpers import ServerProcess
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

import reflow
from reflow.sandbox import factory

pytestmark = [pytest.mark.security, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

EVIL = "http://evil.example"
CRASHY = '{"test/Crashy-v0": {"crash_reset": true}}'
KWARGS = (
    "--allow-client-kwarg", "test/Slow-v0:step_s=float:0..2",
    "--allow-client-kwarg", "test/Echo-v0:tasks=tasks",
    "--allow-client-kwarg", "test/Echo-v0:greeting=choice:hi,hello",
    "--allow-client-kwarg", "test/Crashy-v0:crash_reset=bool",
    "--allow-client-kwarg", "test/Crashy-v0:crash_on=int:1..3",
    "--allow-client-kwarg", "test/Crashy-v0:leak_path=bool",
)  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """An open (--no-auth) server on loopback, as a developer runs one."""
    envs = ("reflow/Calc-v0", "test/Slow-v0", "test/Echo-v0", "test/Crashy-v0")
    args = [a for env_id in envs for a in ("--env", env_id)]
    with ServerProcess(
        tmp_path_factory.mktemp("trust"), *args, *KWARGS, "--env-kwargs", CRASHY, token=None
    ) as server:
        yield server


def no_sandbox(monkeypatch) -> None:
    """Neither Docker nor bubblewrap works here, as on a host with the engine down."""
    monkeypatch.setattr(
        factory, "backend_problem", lambda kind: "unavailable" if kind != "subprocess" else None
    )
    monkeypatch.delenv("REFLOW_SANDBOX", raising=False)


def serve_envs(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`reflow serve-envs ARGS` in a child process that must exit by itself."""
    cmd = [sys.executable, "-m", "reflow.server.cli", "--no-auth", "--port", "0", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)


# ---- model code on the host --------------------------------------------------------------------------
def test_serve_envs_refuses_an_env_that_would_run_model_code_on_the_host(monkeypatch):
    import os

    out = serve_envs(
        "--env",
        "reflow/Calc-v0",
        "--env",
        "reflow/PyCode-v0",
        env={**os.environ, "REFLOW_SANDBOX": "subprocess"},
    )
    lines = out.stderr.splitlines()
    assert out.returncode == 1 and "listening" not in out.stdout, (out.stdout, out.stderr)
    assert len(lines) == 1 and lines[0].startswith("reflow: error: "), out.stderr
    assert "reflow/PyCode-v0" in lines[0] and "--allow-host-code" in lines[0]


def test_the_app_refuses_host_code_when_the_sandbox_probes_fail(monkeypatch):
    from reflow.server.app import create_app
    from reflow.server.settings import ServerSettings

    no_sandbox(monkeypatch)
    with pytest.raises(Exception, match=r"reflow/PyCode-v0.*allow.host.code"):
        create_app(ServerSettings(no_auth=True, env_ids=["reflow/PyCode-v0"]))
    create_app(ServerSettings(no_auth=True, env_ids=["reflow/Calc-v0"]))  # no model code: served
    create_app(ServerSettings(no_auth=True, env_ids=["reflow/PyCode-v0"], allow_host_code=True))


def test_with_allow_host_code_it_serves_and_logs_every_backend(tmp_path, monkeypatch):
    monkeypatch.setenv("REFLOW_SANDBOX", "subprocess")
    args = (
        "--env",
        "reflow/Calc-v0",
        "--env",
        "reflow/PyCode-v0",
        "--allow-host-code",
        "--log-level",
        "info",
    )
    with ServerProcess(tmp_path, *args) as server, server.client() as http:
        r = http.post("/v1/sessions", json={"env_id": "reflow/PyCode-v0", "seed": 0})
        assert r.status_code == 201 and r.json()["observation"]["info"]["sandbox"] == "subprocess"
        logs = server.logs()
    warning = next(line for line in logs.splitlines() if "WARNING" in line and "reflow/PyCode-v0" in line)
    assert "host" in warning, logs
    assert re.search(r"reflow/Calc-v0: runs no model code", logs), logs


UNCAPPED = "no cgroup for the process sandbox (cgroup.procs: Permission denied)"


def no_cgroup(monkeypatch) -> None:
    """Bubblewrap is the backend, and no cgroup can be made for its sandboxes, as for a non-root user
    on a host that delegates none."""
    from reflow.sandbox import cgroup

    monkeypatch.setenv("REFLOW_SANDBOX", "process")
    monkeypatch.setattr(cgroup, "cgroup_problem", lambda: UNCAPPED)


def test_serve_envs_refuses_bubblewrap_sandboxes_that_no_cgroup_bounds(monkeypatch, capsys):
    import uvicorn

    from reflow.server.cli import main

    started = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: started.append(sockets))
    no_cgroup(monkeypatch)
    assert main(["--no-auth", "--port", "0", "--env", "reflow/Calc-v0", "--env", "reflow/PyCode-v0"]) == 1
    out, err = capsys.readouterr()
    assert not started and "listening" not in out, out
    assert err.count("\n") == 1 and err.startswith("reflow: error: "), err
    assert "reflow/PyCode-v0" in err and "reflow/Calc-v0" not in err, err
    assert UNCAPPED in err and "--allow-uncapped-sandbox" in err, err


async def test_uncapped_sandboxes_are_served_when_allowed_and_the_reason_logged(monkeypatch, caplog):
    from reflow.server.app import build_catalog, create_app
    from reflow.server.settings import ServerSettings

    no_cgroup(monkeypatch)
    with pytest.raises(Exception, match=r"reflow/PyCode-v0.*--allow-uncapped-sandbox"):
        create_app(ServerSettings(no_auth=True, env_ids=["reflow/PyCode-v0"]))
    allowed = ServerSettings(no_auth=True, env_ids=["reflow/PyCode-v0"], allow_uncapped_sandbox=True)
    create_app(allowed)
    with caplog.at_level("INFO", logger="reflow.server.app"):
        assert [e["env_id"] for e in await build_catalog(["reflow/PyCode-v0"], allowed)] == [
            "reflow/PyCode-v0"
        ]
    assert any(r.levelname == "WARNING" and UNCAPPED in r.getMessage() for r in caplog.records), caplog.text
    monkeypatch.setattr("reflow.sandbox.cgroup.cgroup_problem", lambda: None)  # a cgroup per sandbox
    create_app(ServerSettings(no_auth=True, env_ids=["reflow/PyCode-v0"]))


def test_a_client_can_never_choose_the_sandbox(capsys):
    from reflow.server.cli import main

    assert main(["--no-auth", "--allow-client-kwarg", "reflow/PyCode-v0:sandbox=choice:docker"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "sandbox" in err and "operator" in err, err


def test_agent_train_warns_in_one_line_when_the_env_runs_on_the_host(monkeypatch):
    from reflow.sandbox.env_backend import host_code_warning

    no_sandbox(monkeypatch)
    line = host_code_warning("reflow/PyCode-v0", {})
    assert line is not None and "\n" not in line and "host" in line and "reflow/PyCode-v0" in line
    assert host_code_warning("reflow/Calc-v0", {}) is None
    assert host_code_warning("reflow/PyCode-v0", {"sandbox": "docker"}) is None  # fails loudly instead


# ---- --no-auth answers loopback pages only -------------------------------------------------------------
def ws_url(server: ServerProcess, path: str) -> str:
    return server.url.replace("http://", "ws://", 1) + path


@pytest.mark.parametrize("path", ["/v1/ws", "/openenv/reflow/Calc-v0/ws"])
async def test_a_foreign_origin_is_refused_at_the_handshake(server, path):
    with pytest.raises(InvalidStatus, match="403"):
        async with connect(ws_url(server, path), origin=EVIL):
            pass
    async with connect(ws_url(server, path), origin=server.url):  # the server's own origin
        pass
    async with connect(ws_url(server, path)):  # no Origin: not a browser
        pass


def test_a_foreign_host_is_refused(server):
    r = httpx.get(server.url + "/v1/envs", headers={"Host": "evil.example"})
    assert r.status_code == 403 and r.json()["code"] == "forbidden_host", r.text
    r = httpx.post(server.url + "/v1/sessions", json={"env_id": "reflow/Calc-v0"}, headers={"Origin": EVIL})
    assert r.status_code == 403 and r.json()["code"] == "forbidden_origin", r.text
    port = server.url.rsplit(":", 1)[1]
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", "[::1]"):
        assert httpx.get(server.url + "/v1/envs", headers={"Host": host}).status_code == 200, host


# ---- client kwargs -----------------------------------------------------------------------------------
def create(server: ServerProcess, env_id: str, **kwargs) -> httpx.Response:
    body = {"env_id": env_id, "seed": 0, "env_kwargs": kwargs}
    r = httpx.post(server.url + "/v1/sessions", json=body, timeout=30)
    if r.status_code == 201:
        httpx.delete(f"{server.url}/v1/sessions/{r.json()['session_id']}")
    return r


def test_client_kwargs_are_held_to_their_declared_values(server):
    assert create(server, "test/Slow-v0", step_s=0.01).status_code == 201
    for bad in (5.0, -1, "0.1", True, None):
        r = create(server, "test/Slow-v0", step_s=bad)
        assert r.status_code == 422 and r.json()["code"] == "bad_env_kwargs", (bad, r.text)
        assert "step_s" in r.json()["message"]
    assert create(server, "test/Echo-v0", step_s=0.01).status_code == 403  # allowed on another env only
    assert create(server, "reflow/Calc-v0", max_steps=2).status_code == 403
    hi = create(server, "test/Echo-v0", greeting="hi")
    assert hi.status_code == 201 and hi.json()["observation"]["messages"][0]["content"] == "hi"
    assert create(server, "test/Echo-v0", greeting="/etc/passwd").status_code == 422


def test_tasks_are_data_never_a_path(server):
    tasks = [{"id": "mine-1"}, {"id": "mine-2"}]
    assert create(server, "test/Echo-v0", tasks=tasks).status_code == 201
    for bad in ("/etc/passwd", ["/etc/passwd"], {"id": "x"}, [{"id": "ok"}, 3], []):
        r = create(server, "test/Echo-v0", tasks=bad)
        assert r.status_code == 422 and r.json()["code"] == "bad_env_kwargs", (bad, r.text)


@pytest.mark.parametrize(
    "rule, text",
    [
        ("step_s", "ENV_ID:NAME=TYPE"),
        ("test/Slow-v0:step_s", "ENV_ID:NAME=TYPE"),
        ("test/Slow-v0:step_s=float", "a range"),
        ("test/Slow-v0:step_s=float:2..1", "a range"),
        ("test/Slow-v0:step_s=str", "unknown type"),
        ("test/Slow-v0:nope=bool", "no parameter 'nope'"),
        ("test/Echo-v0:tasks=choice:a,b", "tasks=tasks"),
        ("test/Echo-v0:greeting=tasks", "only for the tasks kwarg"),
        ("reflow/Calc-v0:max_turns=int:1..3", "no parameter 'max_turns'"),
        ("test/Parity-v0:seed=int:1..3", "not served"),
    ],
)
def test_a_bad_client_kwarg_rule_is_a_usage_error(capsys, rule, text):
    from reflow.server.cli import main

    argv = ["--no-auth", "--env", "test/Slow-v0", "--env", "test/Echo-v0", "--env", "reflow/Calc-v0"]
    assert main([*argv, "--allow-client-kwarg", rule]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and text in err, err


async def test_idle_envs_are_capped_across_kwargs_values():
    from reflow.server.envpool import EnvPool

    pool = EnvPool(size=32, idle_s=60, max_total=2)
    envs = [reflow.make("test/Echo-v0", greeting=f"g{i}") for i in range(3)]
    for i, env in enumerate(envs):  # each distinct value is its own key: the cap holds across them
        await pool.give_back("test/Echo-v0", {"greeting": f"g{i}"}, env)
    assert len(pool) == 2 and len(pool.idle) == 2
    assert [env.unwrapped.closed for env in envs] == [1, 0, 0]  # the longest idle went first
    assert pool.take("test/Echo-v0", {"greeting": "g2"}) is envs[2]
    assert len(pool.idle) == 1  # an emptied key is dropped, so distinct values leave nothing behind
    await pool.close()


# ---- what the server serves, and what its errors say --------------------------------------------------
def test_only_listed_envs_are_served():
    from reflow.env import register
    from reflow.server.sessions import served_env_ids
    from reflow.server.settings import ServerSettings

    register("thirdparty/Proxy-v0", entry_point="fake_envs:EchoEnv")  # an installed plugin's env
    served = served_env_ids(ServerSettings(no_auth=True))
    assert sorted(served) == sorted(BUILTIN_ENVS)
    assert served_env_ids(ServerSettings(no_auth=True, env_ids=["thirdparty/Proxy-v0"])) == [
        "thirdparty/Proxy-v0"
    ]


def test_an_unlisted_registered_env_is_not_served(tmp_path):
    with ServerProcess(tmp_path, envs=None) as server, server.client() as http:
        assert sorted(e["env_id"] for e in http.get("/v1/envs").json()["envs"]) == sorted(BUILTIN_ENVS)
        r = http.post("/v1/sessions", json={"env_id": "test/Echo-v0"})
        assert r.status_code == 404 and r.json()["code"] == "env_not_found"


def test_a_reset_error_names_an_error_id_not_the_cause(server):
    r = create(server, "test/Crashy-v0")
    body = r.json()
    assert r.status_code == 500 and body["code"] == "reset_failed", body
    assert "database" not in body["message"] and "Crashy" not in body["message"], body
    error_id = re.search(r"error id ([0-9a-f]{8,})", body["message"]).group(1)
    logged = [line for line in server.logs().splitlines() if error_id in line]
    assert any("database of tasks is gone" in line for line in logged), server.logs()


async def test_a_step_error_names_an_error_id_not_the_cause(server):
    import fake_envs

    from reflow.env import parse_assistant

    host_path = fake_envs.__file__  # the env's error names a file of the server's host
    crashing = {"crash_reset": False, "crash_on": 1, "leak_path": True}
    local = reflow.make("test/Crashy-v0", **crashing)
    await local.reset(seed=0)
    result = await local.step(parse_assistant("hi"))
    assert host_path in result.info["error"]  # played locally, the user gets the text
    await local.close()

    body = {"env_id": "test/Crashy-v0", "seed": 0, "env_kwargs": crashing}
    session_id = httpx.post(server.url + "/v1/sessions", json=body, timeout=30).json()["session_id"]
    turn = {"turn_index": 0, "turn": dataclasses.asdict(parse_assistant("hi"))}
    over_http = httpx.post(f"{server.url}/v1/sessions/{session_id}/step", json=turn, timeout=30).json()
    remote = reflow.make("reflow/Remote-v0", url=server.url, env_id="test/Crashy-v0", env_kwargs=crashing)
    await remote.reset(seed=0)
    over_ws = await remote.step(parse_assistant("hi"))
    await remote.close()
    for info in (over_http["result"]["info"], over_ws.info):
        assert info["status"] == "env_error" and info["termination"] == "env_error", info
        text = json.dumps(info)
        assert host_path not in text and "FileNotFoundError" not in text and "No such file" not in text, info
        error_id = re.search(r"error id ([0-9a-f]{8,})", info["error"]).group(1)
        logged = [line for line in server.logs().splitlines() if error_id in line]
        assert any(host_path in line for line in logged), server.logs()


def test_the_readme_says_how_to_host_the_server_safely():
    """Tenancy said plainly, and every flag that bounds the server or relaxes a refusal documented where
    an operator looks before exposing it."""
    import argparse
    from pathlib import Path

    from reflow.server.cli import add_parser

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    section = readme.split("### Hosting the env server safely", 1)[1].split("\n## ", 1)[0]
    assert "One token, one tenant" in section and "TLS" in section
    sub = argparse.ArgumentParser().add_subparsers()
    add_parser(sub)
    flags = [f for action in sub.choices["serve-envs"]._actions for f in action.option_strings]
    guarding = [f for f in flags if f.startswith(("--allow-", "--max-", "--no-auth", "--ssl-"))]
    guarding += [f for f in flags if f.endswith("-timeout") or "deadline" in f]
    assert "--allow-uncapped-sandbox" in guarding
    assert [f for f in guarding if not re.search(rf"`{re.escape(f)}[`\s]", section)] == []


# ---- the client ---------------------------------------------------------------------------------------
def test_the_client_warns_once_when_its_token_would_travel_in_the_clear(monkeypatch):
    from reflow.server import client

    monkeypatch.setattr(client, "_warned_hosts", set(), raising=False)
    token = "t" * 20
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            client.RemoteEnv("http://10.1.2.3:8765", "reflow/Calc-v0", token=token)
        client.RemoteEnv("http://127.0.0.1:8765", "reflow/Calc-v0", token=token)
        client.RemoteEnv("http://localhost:8765", "reflow/Calc-v0", token=token)
        client.RemoteEnv("https://envs.example:443", "reflow/Calc-v0", token=token)
        client.RemoteEnv("http://10.1.2.3:8765", "reflow/Calc-v0")  # no token to leak
    texts = [str(w.message) for w in caught if "plain http" in str(w.message)]
    assert len(texts) == 1 and "10.1.2.3" in texts[0] and token not in texts[0], texts


def test_agent_train_prints_the_warning_before_the_run_starts(tmp_path, monkeypatch, capsys):
    import types

    from reflow import cli

    started = []
    fake_train = types.ModuleType("reflow.recipes.agent_train")
    fake_train.train = lambda config, **kwargs: started.append(config.env.id)
    fake_cluster = types.ModuleType("reflow.runtime.cluster")
    fake_cluster.start_ray = lambda config: None
    monkeypatch.setitem(sys.modules, "reflow.recipes.agent_train", fake_train)
    monkeypatch.setitem(sys.modules, "reflow.runtime.cluster", fake_cluster)
    monkeypatch.setenv("REFLOW_SANDBOX", "subprocess")
    assert cli.main(["agent-train", "env.id=reflow/PyCode-v0", f"out_dir={tmp_path}"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "unsandboxed" in line]
    assert started == ["reflow/PyCode-v0"] and len(lines) == 1, lines
    assert "reflow/PyCode-v0" in lines[0] and "REFLOW_SANDBOX=subprocess" in lines[0]
