"""The built-in envs: checker, Gymnasium's check_env, scripted policies, task generators, JSONL tasks."""

import asyncio
import random
import warnings
from collections import Counter

import gymnasium
import pytest
from fake_envs import BUILTIN_ENVS
from gymnasium.utils.env_checker import check_env as gym_check_env
from reflow_envs.calc.env import safe_eval

import reflow
from reflow.env import (
    AssistantTurn,
    ToolCall,
    ToolError,
    env_ids,
    load_tasks,
    play_episode,
    scripted_policy,
    write_tasks,
)
from reflow.env.checker import check_env

QUICK_ENVS = [e for e in BUILTIN_ENVS if e != "reflow/PyCode-v0"]  # PyCode has its own test module


def test_all_four_builtin_envs_are_registered():
    from reflow.env.registration import discovery_errors

    assert discovery_errors == []
    # reflow/Remote-v0 is registered too: the client of an env server (reflow serve-envs), not an env;
    # so are the adapters to OpenEnv servers and verifiers envs.
    proxies = ["reflow/OpenEnv-v0", "reflow/Remote-v0", "reflow/Verifiers-v0"]
    assert [e for e in env_ids() if e.startswith("reflow/")] == sorted([*BUILTIN_ENVS, *proxies])


@pytest.mark.parametrize("env_id", BUILTIN_ENVS)
async def test_reflow_checker_passes(env_id):
    checks = await check_env(env_id)
    failed = [(c.name, c.detail) for c in checks if not c.passed]
    assert not failed
    assert len(checks) == 10


@pytest.mark.parametrize("env_id", BUILTIN_ENVS)
def test_gymnasium_check_env_passes_without_warnings(env_id):
    env = gymnasium.make(env_id)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gym_check_env(env.unwrapped)
    env.close()


async def _success(env_id, error_rate, n=60):
    env = reflow.make(env_id)
    results = [await play_episode(env, scripted_policy(env, error_rate, s), seed=s) for s in range(n)]
    return results


@pytest.mark.parametrize("env_id", QUICK_ENVS)
async def test_scripted_policy_is_perfect_without_errors_and_worse_with_them(env_id):
    clean = await _success(env_id, 0.0)
    assert all(r.success and r.status == "ok" for r in clean)
    noisy = await _success(env_id, 0.5)
    assert sum(r.success for r in noisy) < len(noisy)
    # slips show up as parse errors or extra turns, and the episode still ends properly
    assert all(r.status in ("ok", "truncated") for r in noisy)


@pytest.mark.parametrize("env_id", QUICK_ENVS)
def test_task_generator_is_seeded_and_varied(env_id):
    env = reflow.make(env_id)
    a = [env.generate_task(random.Random(s)) for s in range(50)]
    b = [env.generate_task(random.Random(s)) for s in range(50)]
    assert a == b
    assert len({t["id"] for t in a}) == 50


def test_calc_episode_lengths_have_a_long_tail():
    env = reflow.make("reflow/Calc-v0")
    steps = Counter(len(env.generate_task(random.Random(s))["steps"]) for s in range(2000))
    assert set(steps) == {1, 2, 3, 4, 5, 6}
    assert steps[1] > steps[3] > steps[6] > 50
    results = asyncio.run(_success("reflow/Calc-v0", 0.0, n=200))
    turns = Counter(r.turns for r in results)
    assert min(turns) == 2 and max(turns) == 7  # n calculator calls + the answer


def _quantile(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _generated_chars(result):
    # what the policy wrote: answer text plus each tool call's name and arguments
    calls = [c["function"] for m in result.messages for c in m.get("tool_calls") or []]
    said = sum(len(m["content"]) for m in result.messages if m["role"] == "assistant")
    return said + sum(len(c["name"]) + len(c["arguments"]) for c in calls)


def test_longtail_episode_lengths_are_heavy_tailed_and_the_scripted_policy_solves_every_task():
    results = asyncio.run(_success("reflow/LongTail-v0", 0.0, n=1000))
    assert all(r.success and r.status == "ok" for r in results)
    turns = [r.turns for r in results]  # k lookups + the answer
    p50, p99 = _quantile(turns, 0.5), _quantile(turns, 0.99)
    assert p50 <= 4 and p99 >= 30 and p99 / p50 >= 10, (p50, p99)
    chars = [_generated_chars(r) for r in results]
    assert _quantile(chars, 0.99) / _quantile(chars, 0.5) >= 10
    assert max(turns) <= 65


def test_longtail_kwargs_bound_the_trail_and_are_checked():
    env = reflow.make("reflow/LongTail-v0", min_hops=3, max_hops=5)
    hops = Counter(len(env.generate_task(random.Random(s))["trail"]) for s in range(300))
    assert set(hops) == {3, 4, 5} and hops[3] > hops[5]
    light = reflow.make("reflow/LongTail-v0", exponent=3.0)
    heavy = reflow.make("reflow/LongTail-v0", exponent=1.0)
    mean = lambda e: sum(len(e.generate_task(random.Random(s))["trail"]) for s in range(300)) / 300  # noqa: E731
    assert mean(heavy) > 2 * mean(light)
    with pytest.raises(ValueError, match="min_hops"):
        reflow.make("reflow/LongTail-v0", min_hops=9, max_hops=2)
    with pytest.raises(ValueError, match="exponent"):
        reflow.make("reflow/LongTail-v0", exponent=0)


async def test_longtail_lookup_walks_the_trail_and_refuses_unknown_keys():
    from reflow.env import format_hermes_call, parse_assistant

    env = reflow.make("reflow/LongTail-v0")
    task = {"id": "t", "trail": ["abcd", "efgh"], "answer": 42}
    obs = await env.reset(task=task)
    assert "starts at key abcd" in obs.messages[-1]["content"]

    async def lookup(key):
        turn = parse_assistant(format_hermes_call("lookup", {"key": key}), tools=env.unwrapped.tools)
        return (await env.step(turn)).messages[0]["content"]

    assert await lookup("zzzz") == "Error: no entry for key 'zzzz'"
    assert await lookup("\x00" * 100_000) == f"Error: no entry for key {chr(0) * 32!r} (cut)"
    assert await lookup("abcd") == "next key: efgh"
    assert await lookup("efgh") == "value: 42"
    done = await env.step(parse_assistant("\\boxed{42}"))
    assert (done.reward, done.info["success"], done.info["reward_components"]["hops_done"]) == (
        1.0,
        True,
        1.0,
    )


def test_calc_step_range_selects_a_curriculum_and_rejects_bad_ranges():
    env = reflow.make("reflow/Calc-v0", min_steps=2, max_steps=3)
    steps = Counter(len(env.generate_task(random.Random(s))["steps"]) for s in range(500))
    assert set(steps) == {2, 3} and steps[2] > steps[3]
    with pytest.raises(ValueError, match="min_steps"):
        reflow.make("reflow/Calc-v0", min_steps=4, max_steps=2)


async def test_calc_partial_credit_scores_the_steps_done_right_in_order():
    from reflow.env import format_hermes_call, parse_assistant

    task = {"id": "t", "question": "q", "answer": 14, "start": 5, "steps": [["+", 2], ["*", 2]]}

    async def play(expressions, answer, **kwargs):
        env = reflow.make("reflow/Calc-v0", **kwargs)
        await env.reset(task=task)
        for e in expressions:
            await env.step(parse_assistant(format_hermes_call("calculator", {"expression": e})))
        return await env.step(parse_assistant(f"\\boxed{{{answer}}}"))

    right = await play(["5 + 2", "7 * 2"], 14, partial_credit=0.5)
    assert (right.reward, right.info["success"]) == (1.0, True)
    half = await play(["5 + 2", "7 * 3"], 21, partial_credit=0.5)  # first step right, second wrong
    assert (half.reward, half.info["success"]) == (0.25, False)
    assert half.info["reward_components"]["steps_right"] == 0.5
    late = await play(["5 * 2", "7 * 2"], 14.5, partial_credit=0.5)  # a right value after a wrong one
    assert late.reward == 0.0
    default = await play(["5 + 2", "7 * 3"], 21)  # off by default: reward 1 or 0
    assert default.reward == 0.0
    with pytest.raises(ValueError, match="partial_credit"):
        reflow.make("reflow/Calc-v0", partial_credit=1.5)


def test_guess_lengths_vary_with_the_range_and_slips_cost_turns():
    results = asyncio.run(_success("reflow/Guess-v0", 0.0, n=100))
    turns = [r.turns for r in results]
    assert min(turns) <= 4 and max(turns) >= 9
    noisy = asyncio.run(_success("reflow/Guess-v0", 0.5, n=100))
    assert sum(r.turns for r in noisy) > 1.1 * sum(turns)
    assert any(r.status == "truncated" for r in noisy)


async def test_calc_grades_the_boxed_answer():
    env = reflow.make("reflow/Calc-v0")
    task = {"id": "t1", "question": "Ava has 2 coins. She gets 3 more. How many?", "answer": 5}
    from reflow.env import parse_assistant

    await env.reset(task=task)
    right = await env.step(parse_assistant("So \\boxed{5}."))
    assert (right.reward, right.terminated, right.info["success"]) == (1.0, True, True)
    await env.reset(task=task)
    wrong = await env.step(parse_assistant("It is 5."))
    assert (wrong.reward, wrong.info["termination"]) == (0.0, "no_answer")


@pytest.mark.parametrize(
    "expr",
    [
        *["__import__('os').system('true')", "9**9**9", "1/0", "a + 1", "(1,2)", "1" * 300],
        *["1e6**64", "1e999", "1e999 - 1e999", "(-8) ** 0.5", "1e308 * 10"],  # overflow, inf, NaN, complex
    ],
)
def test_calculator_refuses_unsafe_or_bad_expressions(expr):
    with pytest.raises(ToolError):
        safe_eval(expr)


async def test_an_arithmetic_error_is_a_tool_error_and_the_episode_goes_on():
    env = reflow.make("reflow/Calc-v0")
    await env.reset(seed=0)
    call = ToolCall("calculator", {"expression": "1e6**64"}, "", "call_0")
    step = await env.step(AssistantTurn("", [call]))
    assert step.messages[0]["content"] == "Error: result out of range"
    assert not (step.terminated or step.truncated) and "status" not in step.info
    await env.close()


def test_calculator_evaluates():
    assert safe_eval("(3 + 4) * 2 - 10 / 4") == 11.5
    assert safe_eval("2^10") == 1024


async def test_tasks_from_jsonl(tmp_path):
    env = reflow.make("reflow/Math-v0")
    tasks = [env.generate_task(random.Random(s)) for s in range(5)]
    path = tmp_path / "tasks.jsonl"
    assert write_tasks(path, tasks) == 5
    from_file = reflow.make("reflow/Math-v0", tasks=str(path))
    obs = await from_file.reset(seed=7)
    assert obs.info["task_id"] == tasks[7 % 5]["id"]
    assert obs.messages[-1]["content"] == tasks[2]["question"]


def test_bad_jsonl_is_reported_with_its_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"id": 1, "question": "q", "answer": 1}\n{oops\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        load_tasks(path)
    path.write_text('{"id": 1}\n')
    with pytest.raises(ValueError, match="lacks required keys"):
        reflow.make("reflow/Calc-v0", tasks=str(path))


@pytest.mark.parametrize(
    "text, finish_reason, error_start",
    [
        (
            '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"</tool_call>',
            "stop",
            "Error: tool call is not valid JSON",
        ),
        (
            '<tool_call>{"name": "calc", "arguments": {"expression": "1+1"}}</tool_call>',
            "stop",
            "Error: unknown tool 'calc'",
        ),
        (
            '<tool_call>{"name": "calculator", "arguments": {"expr": "1+1"}}</tool_call>',
            "stop",
            "Error: bad arguments for calculator",
        ),
        (
            '<tool_call>{"name": "calculator", "arguments": {"expression": "1+',
            "length",
            "Error: tool call cut off by the token limit",
        ),
        (
            '<tool_call>{"name": "calculator", "arguments": {"expression": "1/0"}}</tool_call>',
            "stop",
            "Error: division by zero",
        ),
    ],
)
async def test_malformed_calls_reach_the_model_as_errors_and_the_episode_goes_on(
    text, finish_reason, error_start
):
    from reflow.env import parse_assistant

    env = reflow.make("reflow/Calc-v0")
    await env.reset(seed=0)
    result = await env.step(parse_assistant(text, finish_reason=finish_reason, tools=env.unwrapped.tools))
    assert not result.done and result.reward == 0.0
    (msg,) = result.messages
    assert msg["role"] == "tool" and msg["content"].startswith(error_start)
    assert result.info["tool_results"][0]["ok"] is False
    ok = await env.step(
        parse_assistant('<tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call>')
    )
    assert ok.messages[0]["content"] == "6"
