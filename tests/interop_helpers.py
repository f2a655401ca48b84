"""Side venvs for the interop tests (openenv and verifiers do not co-install, with us or each other) and
servers run from them on loopback.

A venv is made on first use under `.venv/interop/<name>` (`python -m venv` + pip from the configured
index) and reused while its stamp matches the pinned packages, so later runs start at once. It is
made, never skipped: where it cannot be made, the test fails and says why.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
SIDE = Path(os.environ.get("REFLOW_INTEROP_VENVS", ROOT / ".venv" / "interop"))

# openenv 0.10.0 without gradio, huggingface_hub and openai (optional at runtime: the interop note, §1).
OPENENV = (
    ["--no-deps", "openenv==0.10.0"],
    [
        "fastapi>=0.116",
        "uvicorn>=0.24",
        "websockets>=15.0.1",
        "requests",
        "httpx>=0.28.1",
        "pydantic>=2",
        "pyyaml",
        "packaging",
        "typing_extensions",
        "fastmcp>=3,<4",
    ],
)
VERIFIERS = (["verifiers==0.3.1"],)


def side_venv(name: str, *installs: list[str]) -> Path:
    """The python of side venv `name`, made (or remade) when its stamp does not match `installs`."""
    venv = SIDE / name
    python = venv / "bin" / "python"
    stamp, want = venv / ".reflow-stamp", repr(installs)
    if python.exists() and stamp.exists() and stamp.read_text() == want:
        return python
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    for args in installs:
        out = subprocess.run(
            [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *args],
            capture_output=True,
            text=True,
        )
        assert out.returncode == 0, f"pip install {' '.join(args)} into {venv} failed:\n{out.stderr[-3000:]}"
    stamp.write_text(want)
    return python


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 60.0, path: str = "/health") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}:\n{proc.stdout.read()[-3000:]}")
        try:
            if httpx.get(url + path, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"the server at {url} did not become healthy in {timeout_s}s")


@contextmanager
def serve(cmd: list[str], url: str, cwd: Path, env: dict[str, str] | None = None, path: str = "/health"):
    """Run a server process until the block ends (killed if it does not stop when asked)."""
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_healthy(url, proc, path=path)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# A small env written with openenv's own API: guess a number 0-9 (the seed picks it), with hints.
OPENENV_GUESS_SERVER = '''
import sys
from typing import Any, Optional

import uvicorn
from pydantic import Field

from openenv.core.env_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class GuessAction(Action):
    """Guess the hidden number."""

    guess: int = Field(description="a number from 0 to 9")


class GuessObservation(Observation):
    prompt: str = ""


class GuessEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state = State(episode_id=None, step_count=0)
        self._target = 0

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **kw: Any):
        self._target = (seed or 0) % 10
        self._state = State(episode_id=episode_id, step_count=0)
        return GuessObservation(prompt="Guess a number from 0 to 9.", metadata={"tries": 0})

    def step(self, action: GuessAction, timeout_s=None, **kw: Any):
        self._state.step_count += 1
        n = self._state.step_count
        if action.guess == self._target:
            return GuessObservation(prompt="correct", done=True, reward=1.0, metadata={"tries": n, "success": True})
        hint = "higher" if action.guess < self._target else "lower"
        done = n >= 6
        return GuessObservation(prompt=hint, done=done, reward=0.0, metadata={"tries": n})

    @property
    def state(self):
        return self._state


class SayAction(Action):
    message: str = Field(description="what to say")


class SayObservation(Observation):
    text: str = ""


class ParityEnvironment(Environment):
    """One turn: reward 1 when the reply has an even number of characters (a signal for an untrained model)."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state = State(episode_id=None, step_count=0)

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **kw: Any):
        self._state = State(episode_id=episode_id, step_count=0)
        return SayObservation(text="Say something.")

    def step(self, action: SayAction, timeout_s=None, **kw: Any):
        self._state.step_count += 1
        even = len(action.message) % 2 == 0
        return SayObservation(text="ok", done=True, reward=float(even))

    @property
    def state(self):
        return self._state


from fastmcp import FastMCP
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation


class TaskObservation(Observation):
    prompt: str = ""


class SumEnvironment(MCPEnvironment):
    """An MCP env: tools `add` and `submit`; submitting the sum of the seed's two numbers scores 1."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        mcp = FastMCP("sum")

        @mcp.tool
        def add(a: int, b: int) -> int:
            """Add two integers."""
            return a + b

        @mcp.tool
        def submit(answer: int) -> str:
            """Submit the final answer."""
            return "submitted"

        super().__init__(mcp)
        self._state = State(episode_id=None, step_count=0)
        self._pair = (0, 0)

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **kw: Any):
        self._pair = ((seed or 0) % 7 + 1, (seed or 0) % 5 + 2)
        self._state = State(episode_id=episode_id, step_count=0)
        return TaskObservation(prompt=f"What is {self._pair[0]} + {self._pair[1]}? Submit it.")

    def _score(self, action, obs):
        self._state.step_count += 1
        if isinstance(action, CallToolAction) and action.tool_name == "submit":
            obs.done = True
            obs.reward = float(action.arguments.get("answer") == sum(self._pair))
        return obs

    def step(self, action, timeout_s=None, **kw: Any):
        return self._score(action, super().step(action, timeout_s=timeout_s, **kw))

    async def step_async(self, action, timeout_s=None, **kw: Any):  # what the /ws path calls
        return self._score(action, await super().step_async(action, timeout_s=timeout_s, **kw))

    def _step_impl(self, action, timeout_s=None, **kw: Any):
        raise ValueError("only MCP actions here")

    @property
    def state(self):
        return self._state


ENVS = {
    "guess": (GuessEnvironment, GuessAction, GuessObservation),
    "parity": (ParityEnvironment, SayAction, SayObservation),
    "sum": (SumEnvironment, CallToolAction, CallToolObservation),
}

if __name__ == "__main__":
    name, port, cap = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    env, action, obs = ENVS[name]
    app = create_app(env, action, obs, env_name=name, max_concurrent_envs=cap)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")
'''


# An unmodified OpenEnv client (GenericEnvClient, in the openenv venv) playing a served env: it sends the
# turns it is given as raw text actions and prints what came back, as JSON.
OPENENV_CLIENT = """
import asyncio, json, sys

from openenv import GenericEnvClient


async def main(spec):
    headers = {"Authorization": "Bearer " + spec["token"]} if spec.get("token") else None
    out = {}
    async with GenericEnvClient(base_url=spec["url"], headers=headers) as env:
        r = await env.reset(seed=spec["seed"], episode_id="ep-1")
        out["reset"] = {"observation": r.observation, "reward": r.reward, "done": r.done}
        out["steps"] = []
        for text in spec["texts"]:
            r = await env.step({"text": text})
            out["steps"].append({"observation": r.observation, "reward": r.reward, "done": r.done,
                                 "metadata": r.metadata})
            if r.done:
                break
        out["state"] = await env.state()
        errors = {}
        for name, action in (("bad_action", {"nope": 1}), ("after_done", {"content": "hi"})):
            try:
                await env.step(action)
            except RuntimeError as e:
                errors[name] = str(e)
        out["errors"] = errors
        out["state_after_errors"] = await env.state()  # the socket still works
    print(json.dumps(out))


asyncio.run(main(json.loads(sys.argv[1])))
"""

# Capacity and auth as an unmodified OpenEnv client meets them.
OPENENV_LIMITS_CLIENT = """
import asyncio, json, sys

from openenv import GenericEnvClient


async def main(spec):
    auth = {"Authorization": "Bearer " + spec["token"]}
    out = {}
    first = GenericEnvClient(base_url=spec["url"], headers=auth)
    await first.reset(seed=1)
    second = GenericEnvClient(base_url=spec["url"], headers=auth)
    try:
        await second.reset(seed=2)
    except Exception as e:
        out["over_capacity"] = f"{type(e).__name__}: {e}"
    await second.close()
    await first.close()
    await asyncio.sleep(0.3)  # the server ends the first session when its socket closes
    third = GenericEnvClient(base_url=spec["url"], headers=auth)
    out["after_close"] = (await third.reset(seed=3)).done
    await third.close()
    try:
        await GenericEnvClient(base_url=spec["url"], headers={"Authorization": "Bearer wrong"}).reset()
    except Exception as e:
        out["wrong_token"] = f"{type(e).__name__}: {e}"
    print(json.dumps(out))


asyncio.run(main(json.loads(sys.argv[1])))
"""


# Two small verifiers envs written with the classic API (verifiers 0.3.1): a ToolEnv with a rubric, and a
# MultiTurnEnv whose rubric rewards an even total reply length (a signal even an untrained model gets).
VERIFIERS_ENVS = '''
import verifiers as vf
from datasets import Dataset


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


def correct(completion, answer, **kwargs) -> float:
    replies = [m for m in completion if m["role"] == "assistant"]
    return 1.0 if replies and replies[-1].get("content", "").strip().endswith(answer) else 0.0


class EchoTwice(vf.MultiTurnEnv):
    async def env_response(self, messages, state, **kwargs):
        return [vf.UserMessage(content="Once more.")]


def even(completion, **kwargs) -> float:
    return float(sum(len(m.get("content") or "") for m in completion if m["role"] == "assistant") % 2 == 0)


def load_environment(kind: str = "tools", **kwargs):
    if kind == "tools":
        pairs = [(2, 3), (10, 7), (4, 4), (1, 8)]
        rows = [{"question": f"What is {a} + {b}? Use the add tool.", "answer": str(a + b)} for a, b in pairs]
        rubric = vf.Rubric(funcs=[correct], weights=[1.0])
        return vf.ToolEnv(dataset=Dataset.from_list(rows), tools=[add], rubric=rubric, max_turns=4)
    rows = [{"question": f"Say something ({i}).", "answer": ""} for i in range(4)]
    return EchoTwice(dataset=Dataset.from_list(rows), rubric=vf.Rubric(funcs=[even], weights=[1.0]), max_turns=2)
'''
