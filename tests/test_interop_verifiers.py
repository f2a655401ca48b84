"""verifiers environments (classic API, verifiers 0.3.1 in its own venv and process) played as
`reflow/Verifiers-v0` by our episode runner and `agent-train`: its tools and rubric run unchanged, its
reward is the episode's, and a worker that dies makes the episode infra_error, never 0."""

import asyncio
import json
import os
import re
from pathlib import Path

import pytest
from interop_helpers import VERIFIERS, VERIFIERS_ENVS, side_venv
from run_helpers import SMALL_ROLLOUT, TINY_MODEL

import reflow
from reflow.env import format_hermes_call
from reflow.replay import ReplayStore
from reflow.rollout.episode import EpisodeRunner

pytestmark = [pytest.mark.interop, pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]
TESTS = Path(__file__).parent
shared_loop = pytest.mark.asyncio(loop_scope="module")  # one loop: its episodes share one worker process


@pytest.fixture(scope="session")
def vf_python() -> str:
    return str(side_venv("verifiers", *VERIFIERS))


@pytest.fixture(scope="session")
def vf_paths(tmp_path_factory) -> list[str]:
    folder = tmp_path_factory.mktemp("vf_envs")
    (folder / "toy_vf.py").write_text(VERIFIERS_ENVS)
    return [str(folder)]


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from reflow.models import build_tiny

    return AutoTokenizer.from_pretrained(build_tiny(tmp_path_factory.mktemp("tiny")))


def make(vf_python, vf_paths, **env_args):
    return reflow.make(
        "reflow/Verifiers-v0", env_id="toy_vf", env_args=env_args, python=vf_python, paths=vf_paths
    )


def adder(off_by: int = 0):
    """Call `add` on the question's numbers, then answer with the tool's result (plus `off_by`)."""

    def policy(messages, tools) -> str:
        results = [m["content"] for m in messages if m["role"] == "tool"]
        if results:
            return f"The answer is {int(results[-1]) + off_by}"
        a, b = map(int, re.findall(r"\d+", messages[-1]["content"])[:2])
        return format_hermes_call("add", {"a": a, "b": b})

    return policy


@shared_loop
async def test_a_tool_env_plays_with_its_tools_and_rubric(vf_python, vf_paths, tiny_tokenizer):
    runner = EpisodeRunner(None, tiny_tokenizer)
    env = make(vf_python, vf_paths)
    rec = await runner.run(env, seed=1, demo_policy=adder())
    assert rec.status == "ok" and rec.success and rec.reward == 1.0
    assert rec.env_id == "verifiers/toy_vf" and rec.termination == "no_tools_called"
    assert rec.messages[0] == {"role": "user", "content": "What is 10 + 7? Use the add tool."}
    assert [m["content"] for m in rec.messages if m["role"] == "tool"] == ["17"]  # verifiers ran the tool
    assert rec.reward_components["correct"] == 1.0 and rec.reward_components["add_calls"] == 1.0
    assert [t.name for t in env.unwrapped.tools] == ["add"]

    wrong = await runner.run(env, seed=2, demo_policy=adder(off_by=1))
    await env.close()
    assert wrong.status == "ok" and not wrong.success and wrong.reward == 0.0  # scored, not masked


@shared_loop
async def test_a_multi_turn_env_and_concurrent_episodes_share_one_worker(vf_python, vf_paths, tiny_tokenizer):
    runner = EpisodeRunner(None, tiny_tokenizer)
    replies = {0: ["ab", "cd"], 1: ["ab", "cde"], 2: ["a", "b"], 3: ["abc", "d"]}

    def scripted(seed):
        return lambda messages, tools: replies[seed][sum(m["role"] == "assistant" for m in messages)]

    envs = [make(vf_python, vf_paths, kind="echo") for _ in replies]
    recs = await asyncio.gather(
        *(runner.run(env, seed=s, demo_policy=scripted(s)) for s, env in zip(replies, envs, strict=True))
    )
    await asyncio.gather(*(env.close() for env in envs))
    assert [r.reward for r in recs] == [1.0, 0.0, 1.0, 1.0]  # the rubric: even total reply length
    assert all(r.status == "ok" and len(r.turns) == 2 for r in recs)
    assert recs[0].messages[2] == {"role": "user", "content": "Once more."}  # the env's own response
    assert len({id(env.unwrapped.worker.proc) for env in envs}) == 1  # one process served all four


@shared_loop
async def test_a_worker_that_dies_mid_episode_is_infra_error(vf_python, vf_paths, tiny_tokenizer):
    env = make(vf_python, vf_paths, kind="echo", tag="to-kill")  # its own worker

    def kill_then_reply(messages, tools):
        env.unwrapped.worker.proc.kill()
        return "ab"

    rec = await EpisodeRunner(None, tiny_tokenizer).run(env, seed=0, demo_policy=kill_then_reply)
    assert rec.status == "infra_error" and "verifiers worker" in rec.error and rec.reward == 0.0
    # the next episode starts a fresh worker
    again = await EpisodeRunner(None, tiny_tokenizer).run(env, seed=0, demo_policy=lambda m, t: "ab")
    await env.close()
    assert again.status == "ok" and again.turns and again.reward in (0.0, 1.0)


@shared_loop
async def test_a_worker_that_cannot_start_is_infra_error(vf_python, vf_paths, tiny_tokenizer, tmp_path):
    runner = EpisodeRunner(None, tiny_tokenizer)
    missing = reflow.make("reflow/Verifiers-v0", env_id="toy_vf", python=str(tmp_path / "no-python"))
    rec = await runner.run(missing, seed=0, demo_policy=lambda m, t: "x")
    assert rec.status == "infra_error" and rec.termination == "reset_failed"
    unknown = reflow.make("reflow/Verifiers-v0", env_id="no_such_vf_env", python=vf_python, paths=vf_paths)
    rec = await runner.run(unknown, seed=0, demo_policy=lambda m, t: "x")
    assert rec.status == "infra_error" and "no_such_vf_env" in rec.error


def test_agent_train_runs_steps_on_a_verifiers_env(tmp_path, monkeypatch, vf_python, vf_paths):
    import ray

    from reflow.config import load_config
    from reflow.recipes.agent_train import train

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    overrides = [
        "env.id=reflow/Verifiers-v0",
        f"env.kwargs={{env_id: toy_vf, env_args: {{kind: echo}}, python: '{vf_python}', paths: ['{vf_paths[0]}']}}",
        *TINY_MODEL,
        *SMALL_ROLLOUT,
        "train.steps=2",
        "eval.every=2",
        "eval.episodes=4",
        "eval.max_new_tokens=8",
        "resources.threads_per_slot=1",
        f"out_dir={tmp_path}",
        "run_name=vf",
    ]
    try:
        summary = train(load_config(None, overrides))
    finally:
        ray.shutdown()
    assert summary["steps"] == 2
    rows = [json.loads(line) for line in (tmp_path / "vf" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "step"] == [1, 2]
    with ReplayStore(tmp_path / "vf" / "replay.sqlite", "vf") as store:
        groups = [
            store.group(g.group_id) for g in store.replayable(current_version=99, tau_max=99, max_reuse=99)
        ]
        episodes = [ep for g in groups for ep in g.episodes]
    assert episodes and {ep.env_id for ep in episodes} == {"verifiers/toy_vf"}
    assert {ep.status for ep in episodes} <= {"ok", "truncated"} and {ep.reward for ep in episodes} <= {
        0.0,
        1.0,
    }
