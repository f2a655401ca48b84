"""An unmodified OpenEnv client (`GenericEnvClient` from openenv 0.10.0, in its own venv) plays every
built-in env through `reflow serve-envs` (OpenEnv's `/ws` protocol under `/openenv/<env id>`), with our
bearer token; its error codes and capacity errors are OpenEnv's."""

import json
import subprocess

import httpx
import pytest
from interop_helpers import OPENENV, OPENENV_CLIENT, OPENENV_LIMITS_CLIENT, side_venv
from server_helpers import ServerProcess

import reflow
from reflow.env import play_episode, scripted_policy

pytestmark = [pytest.mark.interop, pytest.mark.filterwarnings("ignore::DeprecationWarning")]
ENVS = [
    "reflow/Calc-v0",
    "reflow/Guess-v0",
    "reflow/Math-v0",
    pytest.param("reflow/PyCode-v0", marks=pytest.mark.docker),
]


@pytest.fixture(scope="module")
def openenv_python():
    return side_venv("openenv", *OPENENV)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    kwargs = '{"reflow/PyCode-v0": {"sandbox": "docker"}}'  # the sandboxed tool, as served for real
    with ServerProcess(tmp_path_factory.mktemp("server"), "--env-kwargs", kwargs) as server:
        yield server


def run_client(python, script: str, spec: dict, tmp_path) -> dict:
    path = tmp_path / "client.py"
    path.write_text(script)
    out = subprocess.run(
        [str(python), str(path), json.dumps(spec)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.parametrize("env_id", ENVS)
async def test_generic_env_client_plays_a_builtin_env(server, openenv_python, tmp_path, env_id):
    seed = 3
    local = reflow.make(env_id, **({"sandbox": "subprocess"} if env_id == "reflow/PyCode-v0" else {}))
    want = await play_episode(local, scripted_policy(local, 0.0, seed), seed=seed)
    await local.close()
    texts = [r.raw_text for r in want.records]
    spec = {"url": f"{server.url}/openenv/{env_id}", "token": server.token, "seed": seed, "texts": texts}
    got = run_client(openenv_python, OPENENV_CLIENT, spec, tmp_path)

    reset = got["reset"]
    assert reset["done"] is False and reset["reward"] is None
    assert reset["observation"]["messages"] == want.messages[: len(reset["observation"]["messages"])]
    assert [t["function"]["name"] for t in reset["observation"]["tools"]] == [
        t.name for t in local.unwrapped.tools
    ]
    steps = got["steps"]
    assert len(steps) == len(texts) and steps[-1]["done"] and not any(s["done"] for s in steps[:-1])
    assert sum(s["reward"] for s in steps) == pytest.approx(want.reward) and want.success
    assert steps[-1]["metadata"] == {"status": "ok", "termination": want.termination, "success": True}
    assert got["state"] == {"episode_id": "ep-1", "step_count": len(texts), "env_id": env_id}
    # per-message errors keep the socket open; the codes are OpenEnv's
    assert "code: VALIDATION_ERROR" in got["errors"]["bad_action"]
    assert "code: VALIDATION_ERROR" in got["errors"]["after_done"]
    assert got["state_after_errors"]["step_count"] == len(texts)


def test_capacity_and_auth_as_an_openenv_client_sees_them(tmp_path, openenv_python):
    with ServerProcess(tmp_path, "--max-sessions", "1", "--env", "reflow/Guess-v0") as server:
        spec = {"url": f"{server.url}/openenv/reflow/Guess-v0", "token": server.token}
        got = run_client(openenv_python, OPENENV_LIMITS_CLIENT, spec, tmp_path)
        assert "code: CAPACITY_REACHED" in got["over_capacity"]
        assert got["after_close"] is False  # the slot came back when the first client closed
        assert got["wrong_token"].startswith("ConnectionError")
        with server.client() as http:
            base = "/openenv/reflow/Guess-v0"
            assert http.get(f"{base}/health").json() == {"status": "healthy"}
            assert http.get(f"{base}/metadata").json()["name"] == "reflow/Guess-v0"
            schema = http.get(f"{base}/schema").json()
            assert {"action", "observation", "state"} <= set(schema)
            assert "tool_calls" in schema["action"]["properties"]
            assert http.post(f"{base}/mcp", json={}).json()["error"]["code"] == -32600
            rpc = {"jsonrpc": "2.0", "method": "tools/list", "params": {}, "id": 1}
            assert http.post(f"{base}/mcp", json=rpc).json()["error"]["code"] == -32603
            assert http.get("/openenv/reflow/Calc-v0/health").status_code == 404  # not served here
            doc = http.get(f"{base}/openapi.json").json()  # its own document, paths under the prefix
            assert doc["servers"] == [{"url": base}] and doc["info"]["version"].startswith("1.")
            assert {path: set(ops) for path, ops in doc["paths"].items()} == {
                "/health": {"get"},
                "/metadata": {"get"},
                "/schema": {"get"},
                "/mcp": {"post"},
            }
            for path, ops in doc["paths"].items():
                for method in ops:
                    assert http.request(method, base + path, json={}).status_code == 200, path
            schemas = doc["components"]["schemas"]  # /schema's, their references resolved here
            assert set(schemas["ReflowAction"]["properties"]) == set(schema["action"]["properties"])
            assert schemas["ReflowAction"]["properties"]["tool_calls"]["items"]["$ref"] == (
                "#/components/schemas/ActionToolCall"
            )
            assert schemas["ActionToolCall"] == schema["action"]["$defs"]["ActionToolCall"]
            assert http.get("/openenv/reflow/Calc-v0/openapi.json").status_code == 404
        assert httpx.get(f"{server.url}{base}/health").status_code == 401  # behind the token
        assert httpx.get(f"{server.url}{base}/openapi.json").status_code == 401


# OpenEnv's own runtime validator (what `openenv validate --url` runs), as a user would call it.
OPENENV_VALIDATE = """
import json, sys

from openenv.cli._validation import validate_running_environment

print(json.dumps(validate_running_environment(sys.argv[1])))
"""


def test_openenvs_own_validator_passes_every_required_check(tmp_path, openenv_python):
    # the validator sends no credentials: a server without a token, on loopback (LoopbackOnly)
    with ServerProcess(tmp_path, "--env", "reflow/Calc-v0", token=None) as server:
        script = tmp_path / "validate.py"
        script.write_text(OPENENV_VALIDATE)
        url = f"{server.url}/openenv/reflow/Calc-v0"
        out = subprocess.run(
            [str(openenv_python), str(script), url], capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr[-3000:]
        report = json.loads(out.stdout.splitlines()[-1])
    required = {c["id"]: c for c in report["criteria"] if c["required"]}
    assert {
        "openapi_version_available",
        "health_endpoint",
        "metadata_endpoint",
        "schema_endpoint",
        "mcp_endpoint",
        "mode_endpoint_consistency",
    } <= set(required)
    assert [c["id"] for c in required.values() if not c["passed"]] == []
    assert report["passed"] is True
    # no stateless /reset, /step, /state: OpenEnv's production mode, of its 1.x HTTP profile
    assert report["mode"] == "production" and report["standard_profile"] == "openenv-http/1.x"


def test_the_interop_adapters_are_never_served():
    from reflow.server.sessions import served_env_ids
    from reflow.server.settings import ServerSettings

    served = served_env_ids(ServerSettings(no_auth=True))
    assert "reflow/Calc-v0" in served  # an adapter served would let any client call any URL or program
    assert "reflow/OpenEnv-v0" not in served and "reflow/Verifiers-v0" not in served


async def test_raw_frames_get_openenv_error_codes_and_the_socket_stays_open(server):
    from websockets.asyncio.client import connect
    from websockets.exceptions import InvalidStatus

    url = server.url.replace("http://", "ws://") + "/openenv/reflow/Guess-v0/ws"
    with pytest.raises(InvalidStatus, match="403"):
        await connect(url)  # no token: refused at the handshake
    async with connect(url, additional_headers=server.headers) as ws:
        replies = []
        for frame in ["not json", json.dumps({"type": "bogus"}), json.dumps({"type": "step", "data": {}})]:
            await ws.send(frame)
            replies.append(json.loads(await ws.recv()))
        assert [r["data"]["code"] for r in replies] == ["INVALID_JSON", "UNKNOWN_TYPE", "VALIDATION_ERROR"]
        await ws.send(json.dumps({"type": "reset", "data": {"seed": 5, "episode_id": "x"}}))
        reset = json.loads(await ws.recv())
        assert reset["type"] == "observation" and reset["data"]["observation"]["messages"]
        await ws.send(json.dumps({"type": "state"}))
        assert json.loads(await ws.recv())["data"]["episode_id"] == "x"
