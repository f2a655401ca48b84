"""Property-based API fuzzing: schemathesis cases from the server's own OpenAPI document, on a real server.

Valid and invalid requests to every operation, with the right token, a wrong one or none; half of the
cases that name a session name a live one, so steps reach real envs with generated turns. No case may
get a 5xx or an error without `error_kind`, and every answer must match the documented schema.
"""

from __future__ import annotations

import random
from collections import Counter

import httpx
import pytest
from server_helpers import ServerProcess

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

CASES = 800
ENVS = ["reflow/Calc-v0", "reflow/Guess-v0", "reflow/Math-v0", "test/Echo-v0"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # Generated creates pile up sessions: room for them, and a reaper that clears them out.
    args = [
        "--max-sessions",
        "1000",
        "--max-body-bytes",
        "65536",
        "--step-timeout",
        "5",
        "--idle-timeout",
        "5",
    ]
    for env_id in ENVS:
        args += ["--env", env_id]
    with ServerProcess(tmp_path_factory.mktemp("fuzz"), *args) as server:
        yield server


class LiveSessions:
    """A few real sessions for generated steps to land on; replaced when they end."""

    def __init__(self, http: httpx.Client) -> None:
        self.http, self.ids = http, []
        self.rng = random.Random(0)

    def pick(self) -> tuple[str, int]:
        """A ready session and the turn index its next step must carry."""
        states = {sid: self.http.get(f"/v1/sessions/{sid}").json() for sid in self.ids}
        self.ids = [sid for sid, s in states.items() if s.get("state") == "ready"]
        while len(self.ids) < 3:
            env_id = self.rng.choice(ENVS)
            r = self.http.post("/v1/sessions", json={"env_id": env_id, "seed": self.rng.randrange(1000)})
            assert r.status_code == 201, r.text
            self.ids.append(r.json()["session_id"])
            states[self.ids[-1]] = r.json()
        sid = self.rng.choice(self.ids)
        return sid, states[sid]["turns"]


def test_fuzzing_the_api_finds_no_server_error(server):
    doc = httpx.get(server.url + "/openapi.json", headers=server.headers).json()
    schema = schemathesis.openapi.from_dict(doc)
    strategy = st.one_of(
        schema.as_strategy(GenerationMode.POSITIVE), schema.as_strategy(GenerationMode.NEGATIVE)
    )
    checks = [
        not_a_server_error,
        status_code_conformance,
        content_type_conformance,
        response_schema_conformance,
    ]
    wrong = {"Authorization": "Bearer " + "w" * 24}
    seen: Counter[tuple[str, int]] = Counter()
    import requests

    session = requests.Session()
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=30) as http:
        live = LiveSessions(http)

        @settings(
            max_examples=CASES,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=strategy, auth=st.sampled_from(["right"] * 8 + ["none", "wrong"]), real=st.booleans())
        def run(case, auth, real):
            if "session_id" in (case.path_parameters or {}) and real:
                case.path_parameters["session_id"], turns = live.pick()
                if isinstance(case.body, dict) and isinstance(case.body.get("turn_index"), int):
                    case.body["turn_index"] = turns  # so that a generated turn reaches the env
            headers = {"right": server.headers, "wrong": wrong, "none": {}}[auth]
            response = case.call(base_url=server.url, headers=headers, session=session, timeout=30)
            seen[(case.operation.label, response.status_code)] += 1
            assert response.status_code < 500, (case.operation.label, response.status_code, response.text)
            if response.status_code >= 400:
                body = response.json()
                assert body["error_kind"] in ("agent", "env", "infra") and body["message"], body
            if auth != "right" and case.operation.path != "/healthz":
                assert response.status_code in (401, 403), response.text
            case.validate_response(response, checks=checks)

        run()
        assert http.get("/healthz").json()["status"] == "ok"  # and the server is still up
    total = sum(seen.values())
    print(f"fuzz: {total} cases; (operation, status) counts: {dict(sorted(seen.items()))}")
    assert total >= 500
    assert any(status == 200 and "step" in op for op, status in seen)  # generated turns reached real envs
