import os
from pathlib import Path

import pytest
from fake_envs import register_test_envs

import reflow  # noqa: F401  (registers the built-in envs)


@pytest.fixture(scope="session", autouse=True)
def _test_envs() -> None:
    register_test_envs()


@pytest.fixture
def ray_env(monkeypatch):
    """Ray workers import the test envs: they inherit PYTHONPATH from the driver."""
    import ray

    tests = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    yield
    ray.shutdown()


# ---- Sandboxes: tests marked `docker` need an engine and the sandbox image, tests marked
# `bwrap` need bubblewrap. On a laptop without them those tests skip with the reason; with
# REFLOW_REQUIRE_DOCKER=1 (CI provisions both) a missing engine, image or bwrap fails the run instead.


def pytest_configure(config):
    config.addinivalue_line("markers", "bwrap: needs bubblewrap (the process sandbox); CI installs it")


def pytest_collection_modifyitems(config, items):
    from reflow.sandbox.factory import backend_problem

    required = os.environ.get("REFLOW_REQUIRE_DOCKER") == "1"
    for marker, kind in (("docker", "docker"), ("bwrap", "process")):
        group = [item for item in items if item.get_closest_marker(marker) is not None]
        problem = backend_problem(kind) if group else None
        if problem is None:
            continue
        if required:
            raise pytest.UsageError(f"REFLOW_REQUIRE_DOCKER=1 but the {kind} sandbox cannot run: {problem}")
        for item in group:
            item.add_marker(pytest.mark.skip(reason=f"{kind} sandbox unavailable: {problem}"))
