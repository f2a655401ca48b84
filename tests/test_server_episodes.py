"""Whole episodes through a real env server: every built-in env, the episode runner, a server that dies."""

from __future__ import annotations

import pytest
from fake_envs import BUILTIN_ENVS
from scripted_engine import ScriptedEngine
from server_helpers import ServerProcess, remote_kwargs

import reflow
from reflow.env import InfraError, play_episode, scripted_policy
from reflow.rollout.episode import EpisodeRunner
from reflow.server import RemoteEnv

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
SEEDS = range(4)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # PyCode runs its code in a host subprocess here; tests/test_server_reaper.py uses a real sandbox.
    kwargs = '{"reflow/PyCode-v0": {"sandbox": "subprocess"}}'
    args = ("--env-kwargs", kwargs, "--allow-host-code")
    with ServerProcess(tmp_path_factory.mktemp("server"), *args) as server:
        yield server


def _summary(result):
    return (result.status, result.reward, result.success, result.turns, result.messages)


@pytest.mark.parametrize("env_id", BUILTIN_ENVS)
async def test_every_builtin_env_plays_the_same_through_the_server(server, env_id):
    local_kwargs = {"sandbox": "subprocess"} if env_id == "reflow/PyCode-v0" else {}
    for seed in SEEDS:
        error_rate = 0.3 if seed % 2 else 0.0  # slips: malformed calls and wrong answers travel too
        remote = reflow.make("reflow/Remote-v0", **remote_kwargs(server, env_id))
        local = reflow.make(env_id, **local_kwargs)
        try:
            got = await play_episode(remote, scripted_policy(remote, error_rate, seed), seed=seed)
            want = await play_episode(local, scripted_policy(local, error_rate, seed), seed=seed)
        finally:
            await remote.close()
            await local.close()
        assert got.status in ("ok", "truncated") and got.env_id == env_id
        if error_rate == 0.0:
            assert got.success and got.status == "ok"
        assert _summary(got) == _summary(want)


async def test_an_explicit_task_and_the_scripted_policy(server):
    local = reflow.make("reflow/Guess-v0")
    task = local.pick_task(11)
    remote = reflow.make("reflow/Remote-v0", **remote_kwargs(server, "reflow/Guess-v0"))
    result = await play_episode(remote, scripted_policy(remote, 0.0, 1), task=task, seed=99)
    await remote.close()
    assert result.success and result.task_id == task["id"]
    assert remote.unwrapped.session_id is None  # close() deleted the session


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from reflow.models import build_tiny

    return AutoTokenizer.from_pretrained(build_tiny(tmp_path_factory.mktemp("tiny")))


async def _demo_texts(env_id: str, seed: int) -> list[str]:
    env = reflow.make(env_id)
    result = await play_episode(env, scripted_policy(env, 0.0, seed), seed=seed)
    return [r.raw_text for r in result.records]


async def test_episode_runner_plays_a_remote_env(server, tiny_tokenizer):
    seed = 3
    texts = await _demo_texts("reflow/Calc-v0", seed)
    runner = EpisodeRunner(ScriptedEngine(tiny_tokenizer, texts), tiny_tokenizer)
    env = reflow.make("reflow/Remote-v0", **remote_kwargs(server, "reflow/Calc-v0"))
    rec = await runner.run(env, seed=seed)
    await env.close()
    assert (rec.status, rec.success, rec.n_turns) == ("ok", True, len(texts))
    assert rec.env_id == "reflow/Calc-v0" and rec.turns[0].tool_results[0]["ok"] is True


def _killing_policy(env, server: ServerProcess, on_turn: int):
    """The env's scripted policy, except that it kills the server just before turn `on_turn`."""
    demo, calls = scripted_policy(env, 0.0, 0), []

    def policy(messages, tools):
        calls.append(1)
        if len(calls) == on_turn:
            server.kill()
        return demo(messages, tools)

    return policy


def _long_guess_seed() -> int:
    env = reflow.make("reflow/Guess-v0")
    return next(s for s in range(100) if env.pick_task(s)["high"] >= 256)


async def test_a_server_killed_mid_episode_is_an_infra_error(tmp_path):
    seed = _long_guess_seed()
    with ServerProcess(tmp_path) as server:
        env = reflow.make("reflow/Remote-v0", **remote_kwargs(server, "reflow/Guess-v0", retries=2))
        result = await play_episode(env, _killing_policy(env, server, 3), seed=seed)
        await env.close()
    assert (result.status, result.turns) == ("infra_error", 3)
    assert "env server did not answer" in result.error and "ConnectError" in result.error

    # Without the standard wrappers the client raises InfraError itself.
    with ServerProcess(tmp_path) as server:
        bare = RemoteEnv(**remote_kwargs(server, "reflow/Guess-v0", retries=1, backoff_s=0.01))
        await bare.reset(seed=seed)
        server.kill()
        turn = reflow.env.parse_assistant("a guess", tools=bare.tools)
        with pytest.raises(InfraError, match="env server did not answer"):
            await bare.step(turn)
        await bare.close()


async def test_the_episode_runner_marks_a_killed_server_infra_error(tmp_path, tiny_tokenizer):
    seed = _long_guess_seed()
    with ServerProcess(tmp_path) as server:
        env = reflow.make("reflow/Remote-v0", **remote_kwargs(server, "reflow/Guess-v0", retries=2))
        runner = EpisodeRunner(None, tiny_tokenizer)
        rec = await runner.run(env, seed=seed, demo_policy=_killing_policy(env, server, 2))
        await env.close()
    assert rec.status == "infra_error" and rec.n_turns == 2
    assert "env server did not answer" in rec.error
