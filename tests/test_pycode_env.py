"""PyCode-v0 and its code runner: limits of run_python, the task bank, grading and whole episodes."""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
import tracemalloc

import gymnasium
import pytest
from gymnasium.utils.env_checker import check_env
from reflow_envs.pycode.env import PyCodeEnv, build_task, extract_code, grade
from reflow_envs.pycode.problems import FAMILIES

import reflow
from reflow.env import parse_assistant, play_episode, scripted_policy
from reflow.sandbox.host_subprocess import run_python


def _dead(pid: int) -> bool:
    """Gone, or a zombie: dead but not reaped (in a container, PID 1 may never reap orphans)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


# ---- run_python ----------------------------------------------------------------------------------------


async def test_run_python_reports_stdout_stderr_and_exit_code():
    ok = await run_python("import sys\nprint('hello')\nprint(sys.stdin.read().upper())", stdin="abc")
    assert (ok.stdout, ok.stderr, ok.exit_code) == ("hello\nABC\n", "", 0)
    assert not ok.timed_out and not ok.truncated and ok.latency_s > 0
    failed = await run_python("print('before')\nraise ValueError('boom')")
    assert failed.exit_code == 1 and failed.stdout == "before\n"
    assert 'File "main.py", line 2' in failed.stderr and failed.stderr.endswith("ValueError: boom\n")
    assert (await run_python("import sys; sys.exit(7)")).exit_code == 7


async def test_run_python_minimal_environment_and_temporary_directory(monkeypatch):
    monkeypatch.setenv("REFLOW_TEST_SECRET", "x")
    code = "import os\nprint(os.getcwd())\nprint(os.environ.get('REFLOW_TEST_SECRET'), hash('abc'))"
    first, second = await run_python(code), await run_python(code)
    cwd, rest = first.stdout.splitlines()
    assert cwd != os.getcwd() and not os.path.exists(cwd)  # a fresh directory, deleted afterwards
    assert rest.startswith("None ") and rest == second.stdout.splitlines()[1]  # PYTHONHASHSEED=0


async def test_run_python_kills_an_infinite_loop_quickly():
    start = time.monotonic()
    result = await run_python("print('started', flush=True)\nwhile True:\n    pass", timeout_s=0.5)
    assert time.monotonic() - start < 3.0
    assert result.timed_out and result.exit_code == -9 and result.stdout == "started\n"


async def test_run_python_truncates_a_flood_of_output_with_bounded_memory():
    code = "import sys\nchunk = 'x' * (1 << 20)\nfor _ in range(50):\n    sys.stdout.write(chunk)\nsys.stderr.write('e' * 100000)"
    tracemalloc.start()
    try:
        start = time.monotonic()
        result = await run_python(code, output_limit=1000)
        elapsed = time.monotonic() - start
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert result.exit_code == 0 and not result.timed_out  # drained to the end, never blocked
    assert result.truncated and result.stdout == "x" * 1000 and result.stderr == "e" * 1000
    assert elapsed < 10.0 and peak < 8 * 1024 * 1024  # 50 MB went by without being kept


async def test_run_python_contains_a_memory_bomb():
    result = await run_python("x = bytearray(2 * 1024**3)\nprint('allocated')", memory_mb=256)
    assert result.exit_code == 1 and "MemoryError" in result.stderr and result.stdout == ""
    small = await run_python("x = bytearray(50 * 1024**2)\nprint(len(x))", memory_mb=256)
    assert small.stdout == "52428800\n"  # the limit bites at the cap, not before


async def test_run_python_kills_forked_children_with_the_group():
    code = (
        "import os, time\npids = []\nfor _ in range(20):\n    pid = os.fork()\n    if pid == 0:\n"
        "        time.sleep(60)\n        os._exit(0)\n    pids.append(pid)\nprint(*pids, flush=True)\nwhile True:\n    pass"
    )
    result = await run_python(code, timeout_s=1.0)
    assert result.timed_out
    pids = [int(p) for p in result.stdout.split()]
    assert len(pids) == 20
    await asyncio.sleep(0.2)
    assert all(_dead(pid) for pid in pids)


async def test_cancelling_run_python_kills_the_process(tmp_path):
    pid_file = tmp_path / "pid"
    code = f"import os\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\nwhile True:\n    pass"
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(run_python(code, timeout_s=30.0), 1.0)
    await asyncio.sleep(0.2)
    assert _dead(int(pid_file.read_text()))


# ---- the task bank and grading ---------------------------------------------------------------------------


def _passes(source: str, name: str, tests: list) -> list[bool]:
    namespace: dict = {}
    exec(source, namespace)
    out = []
    for args, expected in tests:
        try:
            got = namespace[name](*json.loads(json.dumps(args)))
            out.append(json.dumps(got, sort_keys=True) == json.dumps(expected, sort_keys=True))
        except Exception:
            out.append(False)
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_reference_passes_and_every_buggy_version_fails(family):
    for seed in range(40):
        task = build_task(family, random.Random(seed))
        assert json.loads(json.dumps(task)) == task
        assert all(_passes(task["solution"], task["function_name"], task["tests"])), (seed, task["solution"])
        assert 1 <= len(task["buggy_solutions"]) <= 2
        for buggy in task["buggy_solutions"]:
            assert not all(_passes(buggy, task["function_name"], task["tests"])), (seed, buggy)


async def test_grading_in_a_subprocess_agrees_for_every_family():
    tasks = [build_task(family, random.Random(1)) for family in sorted(FAMILIES)]
    args = [(t["solution"], t["function_name"], t["tests"]) for t in tasks]
    args += [(b, t["function_name"], t["tests"]) for t in tasks for b in t["buggy_solutions"]]
    grades = await asyncio.gather(*(grade(*a) for a in args))
    for (code, _, tests), g in zip(args, grades, strict=True):
        is_reference = any(code == t["solution"] for t in tasks)
        assert g.total == len(tests) and (g.passed == g.total) == is_reference, (code, g)


async def test_grading_resists_prints_fake_equality_and_crashes():
    tests = [[[1], 2], [[5], 6]]
    noisy = "import sys\nprint('x' * 100000)\nprint('{\"passed\": 2, \"total\": 2}')\ndef f(x):\n    print(x)\n    return x + 1"
    assert (await grade(noisy, "f", tests)).passed == 2
    liar = "class Yes:\n    def __eq__(self, other):\n        return True\ndef f(x):\n    return Yes()"
    assert (await grade(liar, "f", tests)).passed == 0
    assert (await grade("def f(x):\n    return True if x == 1 else 6", "f", [[[1], 1], [[5], 6]])).passed == 1
    exits = await grade("import os\nos._exit(0)", "f", tests)
    assert exits.passed == 0 and not exits.timed_out
    assert "NameError" in (await grade("def g(x):\n    return x", "f", tests)).error


def test_generate_task_is_seeded_and_varied():
    env = PyCodeEnv()
    assert env.generate_task(random.Random(5)) == env.generate_task(random.Random(5))
    tasks = [env.generate_task(random.Random(seed)) for seed in range(200)]
    assert len({t["family"] for t in tasks}) == len(FAMILIES) >= 10
    assert len({t["prompt"] for t in tasks}) > 150
    for task in tasks[:20]:
        assert set(env.required_task_keys) <= set(task)
        assert f"def {task['function_name']}(" in task["prompt"] and "Example:" in task["prompt"]


def test_extract_code_takes_the_last_python_block():
    text = "First:\n```python\ndef f(): return 1\n```\nBetter:\n```py\ndef f(): return 2\n```\n```\nnot code\n```"
    assert extract_code(text) == "def f(): return 2\n"
    assert extract_code("no code here, just def f(): pass") is None


# ---- whole episodes --------------------------------------------------------------------------------------


async def _success_rate(error_rate: float, seeds: range) -> float:
    wins = 0
    for seed in seeds:
        env = reflow.make("reflow/PyCode-v0")
        result = await play_episode(env, scripted_policy(env, error_rate, seed), seed=seed)
        assert result.status == "ok" or result.termination == "max_turns", result
        wins += result.success
    return wins / len(seeds)


async def test_scripted_policy_solves_every_task_without_errors():
    env = reflow.make("reflow/PyCode-v0")
    for seed in range(10):
        result = await play_episode(env, scripted_policy(env, 0.0, seed), seed=seed)
        assert result.success and result.reward == 1.0 and result.turns == 2, result
        assert (
            result.info["termination"] == "answered"
            and result.info["reward_components"]["passed_fraction"] == 1.0
        )
        assert result.info["tests_passed"] == result.info["tests_total"] > 0


async def test_scripted_policy_errors_lower_the_success_rate():
    assert await _success_rate(0.5, range(30)) <= 0.75


async def test_a_failing_program_is_a_normal_tool_result():
    env = reflow.make("reflow/PyCode-v0")
    await env.reset(seed=0)
    call = (
        '<tool_call>{"name": "run_python", "arguments": {"code": "print(1)\\nraise KeyError(3)"}}</tool_call>'
    )
    step = await env.step(parse_assistant(call, tools=env.unwrapped.tools))
    assert not step.done and step.messages[0]["role"] == "tool"
    assert "exit code: 1" in step.messages[0]["content"] and "KeyError: 3" in step.messages[0]["content"]
    assert step.info["tool_results"][0]["exit_code"] == 1 and step.info["tool_results"][0]["ok"]


async def test_an_answer_without_code_gets_no_reward():
    env = reflow.make("reflow/PyCode-v0")
    await env.reset(seed=1)
    step = await env.step(parse_assistant("I would use a loop: def f(x): return x"))
    assert step.terminated and step.reward == 0.0
    assert (
        step.info["termination"] == "no_code" and not step.info["success"] and step.info["tests_passed"] == 0
    )


async def test_an_answer_that_loops_forever_ends_within_the_timeout():
    task = build_task("add_k", random.Random(0))
    env = reflow.make("reflow/PyCode-v0", tasks=[task], timeout_s=1.0)
    await env.reset(seed=0)
    start = time.monotonic()
    step = await env.step(parse_assistant("```python\ndef add_k(x):\n    while True:\n        pass\n```"))
    assert time.monotonic() - start < 5.0
    assert (
        step.terminated
        and step.reward == 0.0
        and step.info["timed_out"]
        and step.info["termination"] == "answered"
    )


async def test_partial_solutions_report_the_passed_fraction():
    task = build_task("clamp", random.Random(0))
    env = reflow.make("reflow/PyCode-v0", tasks=[task])
    await env.reset(seed=0)
    step = await env.step(parse_assistant(f"```python\n{task['buggy_solutions'][0]}```"))
    fraction = step.info["reward_components"]["passed_fraction"]
    assert step.reward == 0.0 and 0.0 < fraction < 1.0
    assert fraction == step.info["tests_passed"] / step.info["tests_total"]


def test_gymnasium_env_checker_passes():
    env = gymnasium.make("reflow/PyCode-v0")
    try:
        check_env(env.unwrapped)
        messages, info = env.reset(seed=3)
        assert messages[-1]["role"] == "user" and info["tools"][0]["function"]["name"] == "run_python"
    finally:
        env.close()
