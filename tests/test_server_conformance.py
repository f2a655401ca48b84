"""The env server does what its OpenAPI document says, on a real server with auth.

Targeted cases first (strict integers, every answered status documented, `Allow` naming every method of
a path), then the `schemathesis run` command with every check it has, all four phases (examples,
coverage, fuzzing, and stateful runs that follow the document's links: create -> step / get / delete).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from server_helpers import TESTS, ServerProcess

pytest.importorskip("schemathesis")

ENVS = ["reflow/Calc-v0", "test/Echo-v0"]
SCHEMATHESIS = str(Path(sys.executable).parent / "schemathesis")
# Schema-valid data may also meet a closed session (410) and, on create, a task the env refuses (422);
# schemathesis_hooks.py checks that such a 422 is never the server's own validation.
CONFIG = """\
[checks.positive_data_acceptance]
expected-statuses = ["2xx", "3xx", "401", "403", "404", "409", "410", "422", "429", "5xx"]
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    args = ["--max-sessions", "1000", "--step-timeout", "5", "--idle-timeout", "5"]
    for env_id in ENVS:
        args += ["--env", env_id]
    with ServerProcess(tmp_path_factory.mktemp("conformance"), *args) as server:
        yield server


@pytest.fixture
def http(server):
    with server.client() as client:
        yield client


@pytest.fixture(scope="module")
def doc(server):
    with server.client() as client:
        return client.get("/openapi.json").json()


def _session(http) -> str:
    r = http.post("/v1/sessions", json={"env_id": "test/Echo-v0", "seed": 0})
    assert r.status_code == 201, r.text
    return r.json()["session_id"]


def _turn(text: str = "hi") -> dict:
    return {"content": text, "tool_calls": []}


def _invalid(r, field: str) -> None:
    body = r.json()
    assert (r.status_code, body["error_kind"], body["code"]) == (422, "agent", "invalid_request"), body
    assert field in body["message"], body


# ---- strict types -----------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [False, True, "3", 1.5])
def test_create_refuses_a_seed_that_is_not_an_integer(http, seed):
    _invalid(http.post("/v1/sessions", json={"env_id": "test/Echo-v0", "seed": seed}), "seed")


@pytest.mark.parametrize("deadline", [True, "5"])
def test_create_refuses_a_deadline_that_is_not_a_number(http, deadline):
    _invalid(http.post("/v1/sessions", json={"env_id": "test/Echo-v0", "deadline_s": deadline}), "deadline_s")


@pytest.mark.parametrize("index", [False, "0", 0.5])
def test_step_refuses_a_turn_index_that_is_not_an_integer(http, index):
    sid = _session(http)
    _invalid(http.post(f"/v1/sessions/{sid}/step", json={"turn_index": index, "turn": _turn()}), "turn_index")
    assert http.get(f"/v1/sessions/{sid}").json()["turns"] == 0  # nothing was played


def test_integers_written_as_whole_floats_are_integers(http):
    # JSON Schema's integer includes 3.0, so the document allows it and the server must accept it.
    r = http.post("/v1/sessions", json={"env_id": "test/Echo-v0", "seed": 3.0, "deadline_s": 30})
    assert r.status_code == 201, r.text
    sid = r.json()["session_id"]
    r = http.post(f"/v1/sessions/{sid}/step", json={"turn_index": 0.0, "turn": _turn()})
    assert r.status_code == 200 and r.json()["turn_index"] == 0, r.text


# ---- every answer documented ------------------------------------------------------------------------
def _documented(doc, method: str, path: str, status: int) -> dict:
    responses = doc["paths"][path][method.lower()]["responses"]
    assert str(status) in responses, f"{method} {path} answers {status}; documented: {sorted(responses)}"
    return responses[str(status)]


def test_the_statuses_the_server_answers_are_documented_with_the_error_body(http, doc):
    sid = _session(http)
    assert http.delete(f"/v1/sessions/{sid}").status_code == 200
    answered = [
        ("GET", "/v1/sessions/{session_id}", http.get(f"/v1/sessions/{sid}")),
        ("POST", "/v1/sessions/{session_id}/step", http.post(f"/v1/sessions/{sid}/step", json={"turn_index": 0, "turn": _turn()})),
        ("POST", "/v1/sessions", http.post("/v1/sessions", json={"env_id": "reflow/Calc-v0", "task": {"q": 1}})),
        ("GET", "/v1/sessions/{session_id}", http.get("/v1/sessions/" + "x" * 65)),
        ("DELETE", "/v1/sessions/{session_id}", http.delete("/v1/sessions/" + "x" * 65)),
    ]  # fmt: skip
    assert [r.status_code for *_, r in answered] == [410, 410, 422, 422, 422]
    assert answered[2][2].json()["code"] == "bad_task"  # the env's verdict on the task
    statuses = [(method, path, r.status_code) for method, path, r in answered]
    # A create whose session is closed while its env starts (a shutdown) answers 410 too.
    for method, path, status in [*statuses, ("POST", "/v1/sessions", 410)]:
        response = _documented(doc, method, path, status)
        assert response["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorBody"}


def test_every_error_response_names_the_error_model_and_its_headers(doc):
    error_kind = doc["components"]["schemas"]["ErrorBody"]["properties"]["error_kind"]
    assert sorted(error_kind["enum"]) == ["agent", "env", "infra"]
    for path, operations in doc["paths"].items():
        for method, operation in operations.items():
            responses = operation["responses"]
            assert {"400", "413"} <= set(responses), (method, path)  # the body limit runs before any route
            if path != "/healthz":
                assert {"401", "403"} <= set(responses), (method, path)
                assert responses["401"]["headers"]["WWW-Authenticate"]["required"] is True
            for status, response in responses.items():
                if int(status) >= 400:
                    assert response["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorBody")
    create = doc["paths"]["/v1/sessions"]["post"]["responses"]
    assert create["429"]["headers"]["Retry-After"]["required"] is True
    assert set(create["201"]["links"]) == {"step_session", "extend_session", "get_session", "delete_session"}


# ---- Allow ------------------------------------------------------------------------------------------
def _allow(r) -> set[str]:
    return {m.strip() for m in r.headers["allow"].split(",")}


def test_options_and_405_name_every_method_of_the_path(http):
    sid = _session(http)
    for path, methods in [
        (f"/v1/sessions/{sid}", {"GET", "DELETE", "OPTIONS"}),
        (f"/v1/sessions/{sid}/step", {"POST", "OPTIONS"}),
        (f"/v1/sessions/{sid}/extend", {"POST", "OPTIONS"}),
        ("/v1/sessions", {"POST", "OPTIONS"}),
        ("/healthz", {"GET", "OPTIONS"}),
    ]:
        r = http.options(path)
        assert r.status_code == 204 and _allow(r) == methods, (path, r.status_code, r.headers)
        for wrong in {"GET", "PUT", "PATCH", "POST", "DELETE"} - methods:
            r = http.request(wrong, path)
            assert r.status_code == 405 and _allow(r) == methods, (wrong, path, r.headers)
            assert r.json()["code"] == "method_not_allowed"


# ---- schemathesis, every check ----------------------------------------------------------------------
def test_schemathesis_finds_nothing_with_every_check(server, tmp_path):
    config = tmp_path / "schemathesis.toml"
    config.write_text(CONFIG)
    cmd = [
        SCHEMATHESIS,
        "--config-file", str(config),
        "run", server.url + "/openapi.json",
        "--header", f"Authorization: Bearer {server.token}",
        "--checks", "all",
        "--phases", "examples,coverage,fuzzing,stateful",
        "--max-examples", "15",
        "--seed", "1",
        "--workers", "1",
        "--generation-database", "none",
        "--request-timeout", "30",
        "--no-color",
    ]  # fmt: skip
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "schemathesis_hooks", "PYTHONPATH": str(TESTS)}
    start = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    took = time.monotonic() - start
    report = out.stdout + out.stderr
    print(f"schemathesis, every check: {took:.1f}s\n" + report[-1500:])
    assert out.returncode == 0, report[-8000:]
    with server.client() as client:
        assert client.get("/healthz").json()["status"] == "ok"
