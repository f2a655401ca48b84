"""An interrupted `reflow agent-train` (Ctrl-C, or SIGTERM from a scheduler) leaves none of its rollout
workers' sandbox containers behind: the workers are killed, not closed, so the driver removes them."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from run_helpers import SMALL_ROLLOUT, TINY_MODEL

from reflow.sandbox.reaper import POOL_LABEL, list_sandboxes

TESTS = Path(__file__).parent
ROOT = TESTS.parent

pytestmark = [pytest.mark.slow, pytest.mark.docker, pytest.mark.security]


def containers(client, pool: str) -> list:
    return [c for c in list_sandboxes(client) if (c.labels or {}).get(POOL_LABEL) == pool]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_an_interrupted_run_removes_its_workers_sandboxes(tmp_path, sig):
    from reflow.sandbox.docker_sandbox import shared_client

    client = shared_client()
    pool = f"tests-run-{secrets.token_hex(4)}"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
        "RAY_AUTH_MODE": "disabled",
    }
    env.pop("REFLOW_SANDBOX_RUN", None)
    cmd = [
        *(sys.executable, "-m", "reflow.cli", "agent-train"),
        *TINY_MODEL,
        *SMALL_ROLLOUT,
        "env.plugins=[sandbox_envs:register]",
        "env.id=test/SandboxHold-v0",
        f"env.kwargs={{pool: {pool}}}",
        "train.steps=1000",
        "eval.every=1000",
        "eval.episodes=2",
        "eval.max_new_tokens=8",
        "resources.threads_per_slot=1",
        f"out_dir={tmp_path}",
        "run_name=r",
    ]
    # A process started in the background by a shell without job control (`make test &`, a CI
    # runner's script) inherits SIGINT ignored, and so would the driver: Python then never turns
    # Ctrl-C into KeyboardInterrupt. The driver must start as a terminal's would, with SIGINT at its
    # default (an ignored signal stays ignored across exec; a handled one is reset to the default).
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
    finally:
        signal.signal(signal.SIGINT, before)
    try:
        deadline = time.monotonic() + 240
        while not containers(client, pool) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.5)
        assert proc.poll() is None and containers(client, pool), proc.stdout.read().decode()[-3000:]
        time.sleep(2)  # episodes under way
        proc.send_signal(sig)  # to the driver alone: its workers hear nothing
        output = proc.communicate(timeout=120)[0].decode()
        assert proc.returncode == 130 and "interrupted" in output, output[-3000:]
        left = containers(client, pool)
        assert left == [], [c.labels for c in left]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for c in containers(client, pool):
            c.remove(force=True)
