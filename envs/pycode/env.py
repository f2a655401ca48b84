"""PyCode-v0: write a Python function that passes hidden tests.

The agent can try code with the `run_python` tool as often as it likes; a failing program is a normal
result it sees, not an error. Its final answer is the last ```python block of a reply without a tool
call. The env runs the hidden tests on that code in a child process and compares the results outside
it, as canonical JSON, so a solution cannot pass by printing or by a custom `__eq__`.
Reward: 1 if every test passes, else 0 (the passed fraction is reported as a component).

Where code runs is chosen per env with `sandbox=`: "docker" (a container from a warm pool, reset
between episodes), "process" (bubblewrap namespaces, weaker), "subprocess" (`reflow.sandbox.host_subprocess`:
a host subprocess with rlimits, not a sandbox), or "auto", the default: the strongest that works here.
The env reaches the sandboxes through `reflow.sandbox.code_runner` (it imports only the public API of
`reflow.env` and `reflow.sandbox`); a runner object can also be passed in. The agent's runs and the hidden tests of an
episode share one sandbox, which goes back to the pool when the answer is graded or the env resets.
"""

from __future__ import annotations

import copy
import json
import random
import re
import secrets
from dataclasses import dataclass
from typing import Any

from reflow_envs.pycode.problems import FAMILIES

from reflow.env import (
    AssistantTurn,
    InfraError,
    Message,
    Observation,
    StepResult,
    Task,
    Tool,
    ToolEnv,
    ToolResult,
    format_hermes_call,
)
from reflow.sandbox import CodeRunner, ExecResult, RunnerError, SubprocessRunner, code_runner, describe_run

SYSTEM_PROMPT = (
    "You write Python functions that must pass hidden tests. You can run any Python program with the "
    "run_python tool and see its exit code, stdout and stderr. When you are done, reply without a tool "
    "call and give the complete function in a single ```python code block."
)
OUTPUT_LIMIT = 4096
PROBE_MARK = "\n# try the example\n"

_CODE_BLOCK = re.compile(r"```[ \t]*(?:python3?|py)[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)

# Runs in the child. The nonce and the test inputs come on stdin, so they are not in the program text;
# the solution's own prints go to /dev/null and only the harness writes to the saved stdout.
HARNESS = r"""
import json, os, sys


def _main():
    nonce = sys.stdin.readline().strip()
    spec = json.loads(sys.stdin.readline())
    write, dumps, out = os.write, json.dumps, os.dup(1)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)

    def emit(record):
        write(out, (nonce + " " + dumps(record) + "\n").encode())

    namespace = {"__name__": "__solution__"}  # an `if __name__ == "__main__":` demo block stays off
    try:
        exec(compile(spec["code"], "solution.py", "exec"), namespace)
        fn = namespace.get(spec["function_name"])
        if not callable(fn):
            raise NameError(f"the code defines no function {spec['function_name']!r}")
    except BaseException as e:
        emit({"error": f"{type(e).__name__}: {e}"[:300]})
        return
    for i, args in enumerate(spec["args"]):
        try:
            got = dumps(fn(*args))
        except BaseException as e:
            emit({"i": i, "error": f"{type(e).__name__}: {e}"[:300]})
        else:
            emit({"i": i, "got": got if len(got) <= 10000 else None})


_main()
"""


@dataclass
class Grade:
    passed: int
    total: int
    timed_out: bool
    error: str | None = None


def extract_code(text: str) -> str | None:
    """The content of the last ```python block in `text`, or None."""
    blocks = [b for b in _CODE_BLOCK.findall(text) if b.strip()]
    return blocks[-1] if blocks else None


def _matches(answer: str | None, expected: Any) -> bool:
    """Compare as canonical JSON, which is strict: 1, 1.0 and true all differ."""
    if answer is None:
        return False
    try:
        return json.dumps(json.loads(answer), sort_keys=True) == json.dumps(expected, sort_keys=True)
    except (TypeError, ValueError):
        return False


async def grade(
    code: str,
    function_name: str,
    tests: list[list[Any]],
    timeout_s: float = 5.0,
    runner: CodeRunner | None = None,
) -> Grade:
    """Run `tests` ([args, expected] pairs) on `function_name` from `code` in a child process.

    `runner` says where (a sandbox from `code_runner`); a host subprocess by default. Raises
    `RunnerError` when the runner cannot run the harness at all.
    """
    nonce = secrets.token_hex(8)
    spec = {"code": code, "function_name": function_name, "args": [args for args, _ in tests]}
    result = await (runner or SubprocessRunner()).run_python(
        HARNESS, stdin=f"{nonce}\n{json.dumps(spec)}\n", timeout_s=timeout_s, output_limit=1 << 20
    )
    got: dict[int, str | None] = {}
    error = None
    for line in result.stdout.splitlines():
        if not line.startswith(nonce + " "):
            continue
        try:
            record = json.loads(line[len(nonce) + 1 :])
        except ValueError:  # a line cut off by the output limit
            continue
        if not isinstance(record, dict):
            continue
        if "i" in record:
            got[record["i"]] = record.get("got")
        else:
            error = record.get("error")
    passed = sum(_matches(got.get(i), expected) for i, (_, expected) in enumerate(tests))
    if error is None and result.timed_out:
        error = f"timed out after {timeout_s:g}s"
    return Grade(passed, len(tests), result.timed_out, error)


def format_exec(result: ExecResult, timeout_s: float) -> str:
    """What the model sees of a run: how it ended, then stdout and stderr."""
    return describe_run(
        exit_code=result.exit_code,
        stdout=result.stdout,
        stderr=result.stderr,
        truncated=result.truncated,
        timed_out=result.timed_out,
        timeout_s=timeout_s,
        output_limit=OUTPUT_LIMIT,
    )


def build_task(family: str, rng: random.Random) -> Task:
    """One task of the named problem family, drawn from `rng`."""
    problem = FAMILIES[family](rng)
    tests = [[args, problem.ref(*copy.deepcopy(args))] for args in problem.inputs]
    example_args, example_out = tests[-1]
    call = f"{problem.name}({', '.join(map(repr, example_args))})"
    prompt = (
        f"Write a Python function `{problem.signature}`.\n\n{problem.description}\n\n"
        f"Example: `{call}` returns `{example_out!r}`.\n\n"
        "Give the complete function in a ```python code block."
    )
    return {
        "id": f"pycode-{family}-{rng.getrandbits(40):010x}",
        "family": family,
        "prompt": prompt,
        "function_name": problem.name,
        "solution": problem.solution,
        "buggy_solutions": problem.buggy,
        "tests": tests,
        "example": [example_args, example_out],
    }


class PyCodeEnv(ToolEnv):
    required_task_keys = ("id", "prompt", "function_name", "tests")

    def __init__(
        self,
        tasks: list[Task] | str | None = None,
        timeout_s: float = 5.0,
        sandbox: str | CodeRunner | None = "auto",
    ) -> None:
        """`sandbox`: "docker", "process", "subprocess", "auto" (the best available) or a runner object."""
        super().__init__(tasks)
        self.timeout_s = timeout_s
        self.runner: CodeRunner = (
            sandbox if sandbox is not None and not isinstance(sandbox, str) else code_runner(sandbox)
        )
        self.tools = [Tool.from_function(self.run_python)]

    async def run_python(self, code: str) -> ToolResult:
        """Run a Python program and return its exit code, stdout and stderr.

        Args:
            code: the complete program; print what you want to see. It runs for a few seconds at most.
        """
        try:
            result = await self.runner.run_python(code, timeout_s=self.timeout_s, output_limit=OUTPUT_LIMIT)
        except RunnerError as e:  # the sandbox failed, not the agent: masked in training, not scored
            raise InfraError(f"run_python: {e}") from e
        content = format_exec(result, self.timeout_s)
        return ToolResult("", "run_python", content, exit_code=result.exit_code, truncated=result.truncated)

    async def close(self) -> None:
        await self.runner.close()

    def generate_task(self, rng: random.Random) -> Task:
        return build_task(rng.choice(sorted(FAMILIES)), rng)

    async def _reset(self, task: Task) -> Observation:
        await self.runner.end_episode()  # the last episode's sandbox goes back to be reset
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": task["prompt"]},
        ]
        info = {
            "family": task.get("family"),
            "function_name": task["function_name"],
            "sandbox": self.runner.kind,
        }
        return Observation(messages, info=info)

    async def answer(self, turn: AssistantTurn) -> StepResult:
        code = extract_code(turn.content)
        tests = self.task["tests"]
        if code is None:
            result = Grade(0, len(tests), False)
        else:
            try:
                result = await grade(code, self.task["function_name"], tests, self.timeout_s, self.runner)
            except RunnerError as e:
                raise InfraError(f"cannot grade the answer: {e}") from e
            finally:
                await self.runner.end_episode()
        success = result.total > 0 and result.passed == result.total
        return StepResult.final(
            success,
            termination="answered" if code is not None else "no_code",
            components={"passed_fraction": result.passed / max(result.total, 1)},
            tests_passed=result.passed,
            tests_total=result.total,
            timed_out=result.timed_out,
            solution_error=result.error,
        )

    def demo(self, task: Task, messages: list[Message], rng: random.Random, error_rate: float = 0.0) -> str:
        """Try a candidate on the example with run_python, then submit it; slips with `error_rate`.

        A slip is a buggy candidate or a malformed call; after a wrong output the demo fixes a buggy
        candidate only half of the time, and the submission itself can slip to a buggy version.
        """
        args, expected = task.get("example") or task["tests"][0]
        buggy = task.get("buggy_solutions") or [f"def {task['function_name']}(*args):\n    return None\n"]
        last = messages[-1]
        if last["role"] != "tool" or last["content"].startswith("Error"):  # first try, or a malformed call
            candidate = task["solution"]
            malformed = False
            if rng.random() < error_rate:
                malformed = rng.random() < 0.5
                candidate = candidate if malformed else rng.choice(buggy)
            probe = (
                f"{candidate}{PROBE_MARK}print(repr({task['function_name']}({', '.join(map(repr, args))})))\n"
            )
            call = format_hermes_call("run_python", {"code": probe})
            if malformed:
                call = re.sub(r"\}\s*\n</tool_call>", "\n</tool_call>", call, count=1)
            return "Let me try it on the example first.\n" + call
        tried = next(m for m in reversed(messages) if m["role"] == "assistant" and m.get("tool_calls"))
        candidate = json.loads(tried["tool_calls"][-1]["function"]["arguments"])["code"].split(PROBE_MARK)[0]
        if f"stdout:\n{expected!r}\n" not in last["content"]:
            if rng.random() < 0.5:
                candidate = task["solution"]
        elif rng.random() < error_rate:
            candidate = rng.choice(buggy)
        return f"Here is my solution.\n```python\n{candidate}```"
