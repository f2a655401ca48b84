"""PyCode-v0 on each place code can run (docker, process, subprocess), chosen per env."""

from __future__ import annotations

import random

import pytest
from reflow_envs.pycode.env import PyCodeEnv, build_task, grade

import reflow
from reflow.env import InfraError, format_hermes_call, parse_assistant, play_episode, scripted_policy
from reflow.sandbox.code_runner import RunnerError, SubprocessRunner, code_runner

KINDS = [
    pytest.param("docker", marks=pytest.mark.docker, id="docker"),
    pytest.param("process", marks=pytest.mark.bwrap, id="process"),
    pytest.param("subprocess", id="subprocess"),
]


def call(code: str) -> str:
    return format_hermes_call("run_python", {"code": code})


@pytest.mark.parametrize("kind", KINDS)
async def test_scripted_episodes_succeed_on_every_backend(kind):
    env = reflow.make("reflow/PyCode-v0", sandbox=kind)
    try:
        assert env.unwrapped.runner.kind == kind
        for seed in range(4):
            result = await play_episode(env, scripted_policy(env, 0.0, seed), seed=seed)
            assert result.success and result.turns == 2, result
    finally:
        await env.close()


@pytest.mark.parametrize("kind", KINDS)
async def test_tool_results_and_timeouts_look_the_same_everywhere(kind):
    task = build_task("add_k", random.Random(0))
    env = reflow.make("reflow/PyCode-v0", tasks=[task], sandbox=kind, timeout_s=1.0)
    try:
        obs = await env.reset(seed=0)
        assert obs.info["sandbox"] == kind
        step = await env.step(parse_assistant(call("print(1)\nraise KeyError(3)"), tools=env.unwrapped.tools))
        content = step.messages[0]["content"]
        assert content.startswith("exit code: 1\nstdout:\n1\nstderr:\nTraceback") and "KeyError: 3" in content
        loop = await env.step(parse_assistant(call("while True:\n    pass"), tools=env.unwrapped.tools))
        assert loop.messages[0]["content"].startswith("timed out after 1s (killed)")
        final = await env.step(parse_assistant(f"```python\n{task['solution']}```"))
        assert final.terminated and final.reward == 1.0
    finally:
        await env.close()


@pytest.mark.docker
async def test_the_agent_cannot_tamper_with_grading_in_its_sandbox():
    task = build_task("add_k", random.Random(0))
    env = reflow.make("reflow/PyCode-v0", tasks=[task], sandbox="docker")
    try:
        await env.reset(seed=0)
        # Modules in the work dir would break the harness if the work dir were on its sys.path.
        plant = call(
            "for name in ('json.py', 'sitecustomize.py', 'os.py'):\n"
            "    open(name, 'w').write('raise SystemExit(0)')\nprint('planted')"
        )
        step = await env.step(parse_assistant(plant, tools=env.unwrapped.tools))
        assert "planted" in step.messages[0]["content"]
        final = await env.step(parse_assistant(f"```python\n{task['solution']}```"))
        assert final.reward == 1.0 and final.info["tests_passed"] == final.info["tests_total"]
    finally:
        await env.close()


def test_the_default_is_the_best_available_and_unknown_kinds_are_refused():
    from reflow.sandbox import best_backend

    env = PyCodeEnv()
    assert env.runner.kind == best_backend()
    with pytest.raises(ValueError, match="unknown sandbox kind"):
        PyCodeEnv(sandbox="vm")


def test_a_runner_object_can_be_passed_in():
    runner = SubprocessRunner()
    assert PyCodeEnv(sandbox=runner).runner is runner


async def test_grading_goes_through_the_given_runner():
    class Failing(SubprocessRunner):
        async def run_python(self, *args, **kwargs):
            raise RunnerError("no sandbox")

    with pytest.raises(RunnerError):
        await grade("def f(x):\n    return x", "f", [[[1], 1]], runner=Failing())
    env = PyCodeEnv(sandbox=Failing(), tasks=[build_task("add_k", random.Random(0))])
    await env.reset(seed=0)
    with pytest.raises(InfraError, match="no sandbox"):
        await env.step(parse_assistant(call("print(1)"), tools=env.tools))
    # through the standard wrappers: the episode ends as infra_error (masked in training), not a tool error
    wrapped = reflow.make(
        "reflow/PyCode-v0", sandbox=Failing(), tasks=[build_task("add_k", random.Random(0))]
    )
    await wrapped.reset(seed=0)
    step = await wrapped.step(parse_assistant(call("print(1)"), tools=wrapped.unwrapped.tools))
    assert step.truncated and step.info["status"] == "infra_error" and "no sandbox" in step.info["error"]


@pytest.mark.docker
def test_asking_for_docker_gives_docker():
    assert code_runner("docker").kind == "docker"
