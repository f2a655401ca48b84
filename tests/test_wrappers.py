"""Episode guards: env crashes are contained, limits end episodes with the right status."""

import time

import pytest

import reflow
from reflow.env import AssistantTurn, EnvError, ResetNeeded, play_episode


def say(text):
    return lambda messages, tools: text


async def test_env_whose_step_raises_is_contained():
    env = reflow.make("test/Crashy-v0", crash_on=2)
    await env.reset(seed=0)
    first = await env.step(AssistantTurn("one"))
    assert not first.done
    crashed = await env.step(AssistantTurn("two"))
    assert crashed.truncated and not crashed.terminated and crashed.reward == 0.0
    assert crashed.info["status"] == "env_error"
    assert crashed.info["error"] == "ZeroDivisionError: the env divided by zero"
    with pytest.raises(ResetNeeded):
        await env.step(AssistantTurn("three"))
    # the next episode on the same env is unaffected
    await env.reset(seed=1)
    assert not (await env.step(AssistantTurn("again"))).done


async def test_play_episode_marks_env_error():
    env = reflow.make("test/Crashy-v0", crash_on=1)
    result = await play_episode(env, say("hi"), seed=0)
    assert (result.status, result.turns, result.reward) == ("env_error", 1, 0.0)
    assert "ZeroDivisionError" in result.error


async def test_reset_failure_raises_a_clear_env_error():
    env = reflow.make("test/Crashy-v0", crash_reset=True)
    with pytest.raises(EnvError, match="reset failed: KeyError"):
        await env.reset(seed=0)
    result = await play_episode(env, say("hi"), seed=0)
    assert result.status == "env_error" and "KeyError" in result.error


async def test_bad_task_is_a_value_error():
    env = reflow.make("reflow/Calc-v0")
    with pytest.raises(ValueError, match="lacks required keys"):
        await env.reset(task={"id": "x", "question": "?"})


async def test_policy_failure_is_infra_error_not_a_zero_score():
    env = reflow.make("test/Echo-v0")

    def broken(messages, tools):
        raise ConnectionError("engine went away")

    result = await play_episode(env, broken, seed=0)
    assert result.status == "infra_error" and "engine went away" in result.error


async def test_turn_limit_truncates():
    env = reflow.make("test/Echo-v0", max_turns=3)
    result = await play_episode(env, say("again"), seed=0)
    assert (result.status, result.turns) == ("truncated", 3)
    assert result.termination == "max_turns"


async def test_deadline_cancels_a_slow_step():
    env = reflow.make("test/Slow-v0", step_s=30.0, deadline_s=0.3)
    start = time.monotonic()
    result = await play_episode(env, say("hi"), seed=0)
    assert time.monotonic() - start < 5
    assert result.status == "timeout" and result.termination == "deadline"


async def test_deadline_counts_policy_time_too():
    env = reflow.make("test/Slow-v0", deadline_s=0.2)
    await env.reset(seed=0)
    assert not (await env.step(AssistantTurn("quick"))).done
    time.sleep(0.25)  # a slow policy
    late = await env.step(AssistantTurn("late"))
    assert late.truncated and late.info["status"] == "timeout"


async def test_deadline_covers_reset():
    env = reflow.make("test/Slow-v0", reset_s=30.0, deadline_s=0.2)
    result = await play_episode(env, say("hi"), seed=0)
    assert result.status == "timeout"


async def test_order_is_enforced_and_close_is_idempotent():
    env = reflow.make("test/Echo-v0")
    with pytest.raises(ResetNeeded, match="before reset"):
        await env.step(AssistantTurn("x"))
    await env.reset(seed=0)
    await env.close()
    await env.close()
    assert env.unwrapped.closed == 1
    with pytest.raises(ResetNeeded, match="closed"):
        await env.reset(seed=0)


async def test_wrappers_forward_env_methods():
    env = reflow.make("reflow/Calc-v0")
    import random

    task = env.generate_task(random.Random(3))
    assert task == env.unwrapped.generate_task(random.Random(3))
    obs = await env.reset(task=task)
    assert env.task is task and obs.info["task_id"] == task["id"]
    assert env.demo(task, obs.messages, random.Random(0)).startswith("<tool_call>")


async def test_a_malformed_call_costs_its_step_the_penalty():
    from reflow.env import format_hermes_call, parse_assistant
    from reflow.env.wrappers import MalformedCallPenalty

    task = {"id": "t", "question": "q", "answer": 7, "start": 5, "steps": [["+", 2]]}
    env = MalformedCallPenalty(reflow.make("reflow/Calc-v0"), 0.25)
    await env.reset(task=task)
    bad_call = '<tool_call>{"name": "calculator", "arguments": "5 + 2"}}</tool_call>'
    broken = parse_assistant(bad_call)
    assert broken.tool_calls and broken.tool_calls[0].parse_error  # the parser rejects it
    well_formed = parse_assistant(format_hermes_call("calculator", {"expression": "5 + 2"}))
    rewards = [(await env.step(turn)).reward for turn in (broken, well_formed, broken)]
    final = await env.step(parse_assistant("\\boxed{7}"))
    # each broken call's step costs 0.25; success and the answer's reward are the env's own
    assert rewards == [-0.25, 0.0, -0.25] and (final.reward, final.info["success"]) == (1.0, True)
    assert "malformed_calls" not in final.info["reward_components"]
    # two broken calls in one turn cost twice
    await env.reset(task=task)
    twice = parse_assistant(bad_call + bad_call)
    assert len(twice.tool_calls) == 2
    assert (await env.step(twice)).reward == -0.5
    with pytest.raises(ValueError, match="penalty"):
        MalformedCallPenalty(reflow.make("reflow/Calc-v0"), 0.0)
