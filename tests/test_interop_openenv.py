"""An unmodified OpenEnv server (openenv 0.10.0, in its own venv, an env written with its API) played as
`reflow/OpenEnv-v0` (and as `openenv/<name>`) by our episode runner and `agent-train`; its failures are
infra_error, never 0."""

import asyncio
import json
import os
import re
from pathlib import Path

import pytest
from interop_helpers import OPENENV, OPENENV_GUESS_SERVER, free_port, serve, side_venv
from run_helpers import SMALL_ROLLOUT, TINY_MODEL

import reflow
from reflow.env import format_hermes_call
from reflow.replay import ReplayStore
from reflow.rollout.episode import EpisodeRunner

pytestmark = [pytest.mark.interop, pytest.mark.filterwarnings("ignore::DeprecationWarning")]
TESTS = Path(__file__).parent


@pytest.fixture(scope="session")
def openenv_python() -> Path:
    return side_venv("openenv", *OPENENV)


@pytest.fixture(scope="session")
def server_script(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("openenv") / "openenv_server.py"
    path.write_text(OPENENV_GUESS_SERVER)
    return path


def start(python: Path, script: Path, env: str, capacity: int):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    return url, serve([str(python), str(script), env, str(port), str(capacity)], url, script.parent)


@pytest.fixture(scope="module")
def guess_server(openenv_python, server_script):
    url, server = start(openenv_python, server_script, "guess", capacity=2)
    with server:
        yield url


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from reflow.models import build_tiny

    return AutoTokenizer.from_pretrained(build_tiny(tmp_path_factory.mktemp("tiny")))


def bisect(messages, tools) -> str:
    """Bisection on the guess env, read back from the episode's own messages (hints are tool results)."""
    lo, hi, last = 0, 9, None
    for msg in messages:
        if msg["role"] == "assistant" and msg.get("tool_calls"):
            last = json.loads(msg["tool_calls"][0]["function"]["arguments"]).get("guess")
        elif msg["role"] == "tool" and isinstance(last, int):
            lo, hi = (last + 1, hi) if msg["content"] == "higher" else (lo, last - 1)
    return format_hermes_call("act", {"guess": (lo + hi) // 2})


def bisect_steps(target: int) -> int:
    lo, hi, n = 0, 9, 0
    while True:
        n, guess = n + 1, (lo + hi) // 2
        if guess == target:
            return n
        lo, hi = (guess + 1, hi) if guess < target else (lo, guess - 1)


async def test_episode_runner_plays_an_openenv_server_with_tools_rewards_and_metadata(
    guess_server, tiny_tokenizer
):
    runner = EpisodeRunner(None, tiny_tokenizer)
    env = reflow.make("reflow/OpenEnv-v0", url=guess_server, name="guess")
    rec = await runner.run(env, seed=7, demo_policy=bisect)
    await env.close()
    assert rec.status == "ok" and rec.success and rec.reward == 1.0
    assert rec.env_id == "openenv/guess" and rec.task_id == "seed-7"
    assert len(rec.turns) == bisect_steps(7)
    assert rec.messages[0] == {"role": "user", "content": "Guess a number from 0 to 9."}
    hints = [m["content"] for m in rec.messages if m["role"] == "tool"]
    assert hints[-1] == "correct" and set(hints[:-1]) <= {"higher", "lower"}
    # the action's JSON Schema is the `act` tool the model sees
    (tool,) = env.unwrapped.tools
    assert tool.schema["function"]["parameters"]["properties"]["guess"]["type"] == "integer"
    assert "metadata" not in tool.schema["function"]["parameters"]["properties"]


async def test_an_openenv_namespace_id_plays_the_named_env_of_the_server(guess_server, tiny_tokenizer):
    """`openenv/<name>` is reflow/OpenEnv-v0 with name=<name>: the same episode, the same record id."""
    runner = EpisodeRunner(None, tiny_tokenizer)
    by_id = reflow.make("openenv/guess", url=guess_server)
    by_kwarg = reflow.make("reflow/OpenEnv-v0", url=guess_server, name="guess")
    recs = [await runner.run(env, seed=5, demo_policy=bisect) for env in (by_id, by_kwarg)]
    await by_id.close()
    await by_kwarg.close()
    assert by_id.unwrapped.name == "guess" and by_id.unwrapped.url == guess_server
    assert [(r.env_id, r.status, r.success, len(r.turns)) for r in recs] == [
        ("openenv/guess", "ok", True, bisect_steps(5))
    ] * 2
    assert recs[0].messages == recs[1].messages


async def test_more_episodes_than_the_servers_capacity_wait_for_a_slot(guess_server, tiny_tokenizer):
    runner = EpisodeRunner(None, tiny_tokenizer)
    envs = [reflow.make("reflow/OpenEnv-v0", url=guess_server, name="guess") for _ in range(5)]
    recs = await asyncio.gather(
        *(runner.run(env, seed=s, demo_policy=bisect) for s, env in zip(range(3, 8), envs, strict=True))
    )
    await asyncio.gather(*(env.close() for env in envs))
    assert [r.status for r in recs] == ["ok"] * 5  # capacity 2: the others queued, none failed
    assert [len(r.turns) for r in recs] == [bisect_steps(s) for s in range(3, 8)]


async def test_an_action_the_server_rejects_goes_back_to_the_model(guess_server):
    from reflow.env import parse_assistant

    env = reflow.make("reflow/OpenEnv-v0", url=guess_server, name="guess")
    await env.reset(seed=2)
    tools = env.unwrapped.tools
    bad = await env.step(parse_assistant(format_hermes_call("act", {"guess": "two"}), tools=tools))
    assert not bad.done and bad.reward == 0.0
    assert bad.messages[0]["role"] == "tool" and "rejected" in bad.messages[0]["content"]
    assert bad.info["tool_results"][0]["ok"] is False
    good = await env.step(parse_assistant(format_hermes_call("act", {"guess": 2}), tools=tools))
    assert good.done and good.reward == 1.0 and good.info["success"]
    await env.close()


async def test_an_mcp_env_offers_its_own_tools(openenv_python, server_script, tiny_tokenizer):
    def solve(messages, tools) -> str:
        results = [m["content"] for m in messages if m["role"] == "tool"]
        if results:
            return format_hermes_call("submit", {"answer": int(results[-1])})
        a, b = map(int, re.findall(r"\d+", messages[0]["content"])[:2])
        return format_hermes_call("add", {"a": a, "b": b})

    url, server = start(openenv_python, server_script, "sum", capacity=2)
    with server:
        env = reflow.make("reflow/OpenEnv-v0", url=url, name="sum")
        rec = await EpisodeRunner(None, tiny_tokenizer).run(env, seed=4, demo_policy=solve)
        await env.close()
    assert [t.name for t in env.unwrapped.tools] == ["add", "submit"]  # listed by the server, not `act`
    assert env.unwrapped.tools[0].schema["function"]["parameters"]["required"] == ["a", "b"]
    assert rec.messages[0]["content"] == "What is 5 + 6? Submit it."
    assert [m["content"] for m in rec.messages if m["role"] == "tool"] == ["11", "submitted"]
    assert rec.status == "ok" and rec.success and rec.reward == 1.0 and len(rec.turns) == 2


async def test_refused_connection_is_infra_error(tiny_tokenizer):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    rec = await EpisodeRunner(None, tiny_tokenizer).run(
        reflow.make("reflow/OpenEnv-v0", url=url, name="gone"), seed=1, demo_policy=bisect
    )
    assert rec.status == "infra_error" and rec.termination == "reset_failed" and "GET /schema" in rec.error


async def test_server_killed_mid_episode_ends_it_as_infra_error(
    openenv_python, server_script, tiny_tokenizer
):
    url, server = start(openenv_python, server_script, "guess", capacity=1)
    with server as proc:
        calls = []

        def kill_on_second_turn(messages, tools):
            calls.append(1)
            if len(calls) == 2:
                proc.kill()
                proc.wait()
            return bisect(messages, tools)

        env = reflow.make("reflow/OpenEnv-v0", url=url, name="guess")
        rec = await EpisodeRunner(None, tiny_tokenizer).run(env, seed=9, demo_policy=kill_on_second_turn)
        assert rec.status == "infra_error" and "connection to the server was lost" in rec.error
        assert len(rec.turns) == 2 and rec.reward == 0.0
        # the next episode cannot even connect: infra_error again, not a zero-reward episode
        again = await EpisodeRunner(None, tiny_tokenizer).run(env, seed=9, demo_policy=bisect)
        assert again.status == "infra_error" and again.termination == "reset_failed"
        await env.close()


@pytest.mark.slow
def test_agent_train_runs_steps_on_an_openenv_server(tmp_path, monkeypatch, openenv_python, server_script):
    import ray

    from reflow.config import load_config
    from reflow.recipes.agent_train import train

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    url, server = start(openenv_python, server_script, "parity", capacity=8)
    overrides = [
        "env.id=reflow/OpenEnv-v0",
        f"env.kwargs={{url: '{url}', name: parity}}",
        *TINY_MODEL,
        *SMALL_ROLLOUT,
        "train.steps=2",
        "eval.every=2",
        "eval.episodes=4",
        "eval.max_new_tokens=8",
        "resources.threads_per_slot=1",
        f"out_dir={tmp_path}",
        "run_name=openenv",
    ]
    try:
        with server:
            summary = train(load_config(None, overrides))
    finally:
        ray.shutdown()
    assert summary["steps"] == 2
    rows = [json.loads(line) for line in (tmp_path / "openenv" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["kind"] == "step"]
    assert [s["step"] for s in steps] == [1, 2]
    assert any(s["trained_tokens"] > 0 for s in steps), "parity rewards from the OpenEnv server spread"
    with ReplayStore(tmp_path / "openenv" / "replay.sqlite", "openenv") as store:
        groups = [
            store.group(g.group_id) for g in store.replayable(current_version=99, tau_max=99, max_reuse=99)
        ]
        episodes = [ep for g in groups for ep in g.episodes]
    assert episodes and {ep.env_id for ep in episodes} == {"openenv/parity"}
    # a reply cut at max_new_tokens is "truncated" (never shown to the env); nothing failed
    statuses = {ep.status for ep in episodes}
    assert (
        "ok" in statuses and statuses <= {"ok", "truncated"} and {ep.reward for ep in episodes} <= {0.0, 1.0}
    )
