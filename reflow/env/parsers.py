"""Tool-call parsers: from the model's raw text to an `AssistantTurn`.

Parsers are registered by name, because the tool-call syntax belongs to the model's chat template, not
to the environment. Hermes/Qwen (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`) comes first.
A parser never raises on model output: an unusable call is kept with `parse_error` set, and the env
answers it with an error message, so the model can learn from it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from reflow.env.core import AssistantTurn
from reflow.env.tools import ToolCall

if TYPE_CHECKING:
    from reflow.env.tools import AnyTool

ParseFn = Callable[[str, str], tuple[str, list[ToolCall]]]
"""(text, finish_reason) -> (content without the call blocks, tool calls)."""

_PARSERS: dict[str, ParseFn] = {}

CUT_OFF_ERROR = "tool call cut off by the token limit before </tool_call>"


def register_parser(name: str) -> Callable[[ParseFn], ParseFn]:
    """Decorator: make a parse function available as `parse_assistant(..., parser=name)`."""

    def deco(fn: ParseFn) -> ParseFn:
        _PARSERS[name] = fn
        return fn

    return deco


def get_parser(name: str) -> ParseFn:
    try:
        return _PARSERS[name]
    except KeyError:
        raise KeyError(f"unknown tool-call parser {name!r}; registered: {sorted(_PARSERS)}") from None


_THINK = re.compile(r"^\s*<think>(.*?)</think>\s*", re.DOTALL)


def split_reasoning(text: str) -> tuple[str | None, str]:
    """Separate a leading <think>...</think> block (Qwen3 and DeepSeek style) from the answer."""
    m = _THINK.match(text)
    if not m:
        return None, text
    return m.group(1).strip(), text[m.end() :]


def _call_from_json(raw: str, index: int) -> ToolCall:
    call_id = f"call_{index}"
    try:
        obj: Any = json.loads(raw)
    except json.JSONDecodeError as e:
        return ToolCall(None, {}, raw, call_id, f"tool call is not valid JSON: {e.msg} at char {e.pos}")
    except RecursionError:
        return ToolCall(None, {}, raw, call_id, "tool call is not valid JSON: nested too deeply")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return ToolCall(None, {}, raw, call_id, 'tool call must be a JSON object with a string "name"')
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models emit the arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            return ToolCall(obj["name"], {}, raw, call_id, f"tool call arguments are not valid JSON: {e.msg}")
    if not isinstance(args, dict):
        return ToolCall(obj["name"], {}, raw, call_id, '"arguments" must be a JSON object')
    return ToolCall(obj["name"], args, raw, call_id)


_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


@register_parser("hermes")
def parse_hermes(text: str, finish_reason: str) -> tuple[str, list[ToolCall]]:
    """Hermes / Qwen2.5 / Qwen3 style: one JSON object per <tool_call>...</tool_call> block."""
    # str.find, not the regex `<tool_call>(.*?)</tool_call>`: the regex scans to the end of the text
    # from every unclosed opening tag, quadratic in the text's length (a megabyte took minutes).
    calls: list[ToolCall] = []
    kept, at = [], 0
    while (start := text.find(_OPEN, at)) != -1:
        end = text.find(_CLOSE, start + len(_OPEN))
        if end == -1:  # no closing tag after this one, so none after any later one either
            break
        kept.append(text[at:start])
        calls.append(_call_from_json(text[start + len(_OPEN) : end].strip(), len(calls)))
        at = end + len(_CLOSE)
    kept.append(text[at:])
    content = "".join(kept)
    opened = content.rfind(_OPEN)
    if opened != -1:  # an opening tag with no closing one: the call was cut off
        raw = content[opened + len(_OPEN) :].strip()
        error = CUT_OFF_ERROR if finish_reason == "length" else "tool call has no closing </tool_call> tag"
        calls.append(ToolCall(None, {}, raw, f"call_{len(calls)}", error))
        content = content[:opened]
    return content.strip(), calls


def parse_assistant(
    text: str,
    *,
    parser: str = "hermes",
    finish_reason: str = "stop",
    tools: list[AnyTool] | None = None,
) -> AssistantTurn:
    """Parse raw model text into an AssistantTurn; with `tools`, also check names and arguments."""
    reasoning, rest = split_reasoning(text)
    content, calls = get_parser(parser)(rest, finish_reason)
    if tools is not None:
        from reflow.env.tools import validate_calls

        validate_calls(calls, tools)
    return AssistantTurn(content, calls, reasoning, finish_reason, raw_text=text)


def format_hermes_call(name: str, arguments: dict[str, Any]) -> str:
    """Render one call the way Hermes/Qwen models write it (used by scripted policies)."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"
