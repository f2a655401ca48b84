"""The opt-in env checker behind `reflow envs check ID`.

It drives a registered env the way rollout workers and the env server will: seeded resets, a valid turn
(from the env's scripted policy when it has one), each kind of malformed tool call, a whole episode,
JSON round trips of everything returned, tool schemas, and the reset/step/close ordering rules.
"""

from __future__ import annotations

import json
import math
import random
import re
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any

from reflow.env.core import EPISODE_STATUSES, AssistantTurn, Env, ResetNeeded, StepResult
from reflow.env.parsers import CUT_OFF_ERROR, parse_assistant
from reflow.env.play import has_demo, play_episode, scripted_policy
from reflow.env.registration import make

_TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


@dataclass
class Check:
    name: str
    passed: bool
    detail: str = ""


def check_tool_schema(schema: Any) -> None:
    """Raise AssertionError unless `schema` is a valid OpenAI function-tool schema."""
    assert isinstance(schema, dict) and schema.get("type") == "function", (
        "tool schema must have type 'function'"
    )
    fn = schema.get("function")
    assert isinstance(fn, dict), "tool schema lacks 'function'"
    assert isinstance(fn.get("name"), str) and _TOOL_NAME.match(fn["name"]), (
        f"bad tool name {fn.get('name')!r}"
    )
    assert isinstance(fn.get("description"), str) and fn["description"], (
        f"tool {fn['name']} has no description"
    )
    params = fn.get("parameters")
    assert isinstance(params, dict) and params.get("type") == "object", (
        f"tool {fn['name']}: parameters must be an object"
    )
    props = params.get("properties", {})
    assert isinstance(props, dict), f"tool {fn['name']}: properties must be a dict"
    missing = set(params.get("required", [])) - set(props)
    assert not missing, f"tool {fn['name']}: required names unknown properties {sorted(missing)}"
    json.dumps(schema)


def _json_roundtrip(obj: Any, what: str) -> None:
    data = asdict(obj) if hasattr(obj, "__dataclass_fields__") else obj
    try:
        assert json.loads(json.dumps(data)) == data, f"{what} changes in a JSON round trip"
    except TypeError as e:
        raise AssertionError(f"{what} is not JSON-serialisable: {e}") from None


def _check_step_result(result: StepResult, what: str) -> None:
    assert isinstance(result, StepResult), f"{what}: step returned {type(result).__name__}, not StepResult"
    assert isinstance(result.reward, (int, float)) and math.isfinite(result.reward), (
        f"{what}: reward not finite"
    )
    assert isinstance(result.terminated, bool) and isinstance(result.truncated, bool), (
        f"{what}: flags not bool"
    )
    _json_roundtrip(result, what)


def _malformed_turns(env: Env) -> dict[str, AssistantTurn]:
    tools = env.unwrapped.tools
    name = tools[0].name if tools else "no_such_tool"
    texts = {
        "invalid JSON": ('<tool_call>\n{"name": "' + name + '", "arguments": {\n</tool_call>', "stop"),
        "unknown tool": ('<tool_call>\n{"name": "no_such_tool_zz", "arguments": {}}\n</tool_call>', "stop"),
        "bad arguments": (
            '<tool_call>\n{"name": "' + name + '", "arguments": {"__bogus__": [1]}}\n</tool_call>',
            "stop",
        ),
        "cut off by the token limit": ('<tool_call>\n{"name": "' + name + '", "argum', "length"),
    }
    return {k: parse_assistant(t, finish_reason=fr, tools=tools) for k, (t, fr) in texts.items()}


async def _run(checks: list[Check], name: str, fn: Callable[[], Awaitable[str | None]]) -> None:
    try:
        detail = await fn()
        checks.append(Check(name, True, detail or ""))
    except Exception as e:
        checks.append(Check(name, False, f"{type(e).__name__}: {e}"))


async def check_env(env_id: str, seed: int = 0, **kwargs: Any) -> list[Check]:
    """Run every check on a fresh instance of `env_id`; returns one Check per item."""
    checks: list[Check] = []
    env = make(env_id, **kwargs)

    async def step_before_reset() -> str:
        try:
            await env.step(AssistantTurn("hi"))
        except ResetNeeded as e:
            return str(e)
        raise AssertionError("step() before reset() did not raise ResetNeeded")

    async def reset_obs() -> str:
        obs = await env.reset(seed=seed)
        _json_roundtrip(obs, "observation")
        assert obs.messages and all(isinstance(m.get("content"), str) for m in obs.messages), "bad messages"
        for schema in obs.tools:
            check_tool_schema(schema)
        again = await env.reset(seed=seed)
        assert again.messages == obs.messages, "reset with the same seed gave different messages"
        return f"{len(obs.messages)} messages, {len(obs.tools)} tools"

    async def valid_step() -> str:
        obs = await env.reset(seed=seed)
        if has_demo(env):
            text = env.demo(env.unwrapped.task, obs.messages, random.Random(seed), 0.0)
        else:
            text = "I am not sure."
        turn = parse_assistant(text, tools=env.unwrapped.tools)
        assert not any(c.parse_error for c in turn.tool_calls), "the scripted turn did not parse"
        result = await env.step(turn)
        _check_step_result(result, "valid step")
        return f"reward={result.reward} terminated={result.terminated}"

    async def malformed(kind: str, turn: AssistantTurn) -> str:
        await env.reset(seed=seed)
        assert turn.tool_calls and turn.tool_calls[0].parse_error, f"{kind}: parser did not flag the call"
        if kind == "cut off by the token limit":
            assert turn.tool_calls[0].parse_error == CUT_OFF_ERROR
        result = await env.step(turn)
        _check_step_result(result, kind)
        assert result.info.get("status") != "env_error", f"{kind}: env errored: {result.info.get('error')}"
        if env.unwrapped.tools:
            errors = [m for m in result.messages if m["role"] == "tool" and "Error" in m["content"]]
            assert errors, f"{kind}: no error message was sent back to the model"
            return errors[0]["content"][:80]
        return "no tools: answered as text"

    async def full_episode() -> str:
        policy = scripted_policy(env, 0.0, seed) if has_demo(env) else (lambda m, t: "I give up.")
        res = await play_episode(env, policy, seed=seed)
        assert res.status in EPISODE_STATUSES, f"unknown status {res.status!r}"
        assert res.status not in ("env_error", "infra_error"), f"episode ended with {res.status}: {res.error}"
        _json_roundtrip(res.to_dict(), "episode record")
        return f"status={res.status} reward={res.reward} turns={res.turns}"

    async def step_after_done() -> str:
        try:
            await env.step(AssistantTurn("again"))
        except ResetNeeded:
            return "ResetNeeded"
        raise AssertionError("step() after the episode ended did not raise ResetNeeded")

    async def close_twice() -> str:
        await env.close()
        await env.close()
        return "ok"

    await _run(checks, "step before reset is refused", step_before_reset)
    await _run(checks, "reset: JSON observation, valid tool schemas, seeded", reset_obs)
    await _run(checks, "step with a valid turn", valid_step)
    for kind, turn in _malformed_turns(env).items():
        await _run(checks, f"malformed tool call: {kind}", lambda k=kind, t=turn: malformed(k, t))
    await _run(checks, "scripted episode runs to the end", full_episode)
    await _run(checks, "step after the episode ended is refused", step_after_done)
    await _run(checks, "close is idempotent", close_twice)
    return checks
