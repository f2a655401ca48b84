"""Tools: plain Python functions turned into OpenAI function schemas, with validated arguments.

`ToolCall` (a call parsed from the model's text) and `ToolResult` (its outcome) are the records;
`Tool.from_function(fn)` reads the signature (type hints, defaults) and the Google-style docstring
("Args:" section) and builds both the JSON schema the model sees and a pydantic model that checks the
arguments the model sends. A tool signals a mistake of the agent (bad input, a failing program) by
raising `ToolError`; any other exception is a bug in the env and is not hidden from the caller.
"""

from __future__ import annotations

import copy
import inspect
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pydantic


@dataclass
class ToolCall:
    """One tool call parsed from the model's text. `parse_error` is set when the call is unusable."""

    name: str | None
    arguments: dict[str, Any]
    raw: str
    id: str = "call_0"
    parse_error: str | None = None

    def to_message_call(self) -> dict[str, Any]:
        """The OpenAI `tool_calls` entry for this call (arguments as a JSON string)."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name or "", "arguments": json.dumps(self.arguments)},
        }


@dataclass
class ToolResult:
    """The outcome of one tool call, as recorded in the trajectory.

    `ok` is False when the call could not run as asked (malformed, bad arguments, a ToolError); a
    program that ran and exited non-zero is still ok, with its `exit_code`.
    """

    call_id: str
    name: str | None
    content: str
    ok: bool = True
    exit_code: int | None = None
    latency_s: float = 0.0
    truncated: bool = False


class ToolError(Exception):
    """A tool call failed because of what the agent asked for; the message goes back to the model."""


def _parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """Split a Google-style docstring into the summary and {arg: description}."""
    if not doc:
        return "", {}
    doc = inspect.cleandoc(doc)
    parts = re.split(r"^\s*(?:Args|Arguments|Parameters):\s*$", doc, maxsplit=1, flags=re.MULTILINE)
    summary = " ".join(parts[0].strip().split())
    args: dict[str, str] = {}
    if len(parts) == 2:
        current = None
        for line in parts[1].splitlines():
            if re.match(r"^\s*(Returns|Raises|Yields|Examples?):", line):
                break
            m = re.match(r"^\s{0,8}(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$", line)
            if m:
                current = m.group(1)
                args[current] = m.group(2).strip()
            elif current and line.strip():
                args[current] += " " + line.strip()
    return summary, args


def _strip_titles(schema: Any) -> Any:
    """pydantic adds "title" everywhere; OpenAI tool schemas don't carry them."""
    if isinstance(schema, dict):
        return {k: _strip_titles(v) for k, v in schema.items() if k != "title"}
    if isinstance(schema, list):
        return [_strip_titles(v) for v in schema]
    return schema


@dataclass
class Tool:
    """A callable tool with its OpenAI schema and argument validator."""

    name: str
    description: str
    fn: Callable[..., Any]
    args_model: type[pydantic.BaseModel]
    _parameters: dict[str, Any] | None = field(default=None, init=False, repr=False, compare=False)
    """The JSON-schema parameters, built on first use: pydantic's schema generation costs ~0.5 ms and
    every reset lists the env's tools (an env server's whole step costs about as much)."""

    @classmethod
    def from_function(cls, fn: Callable[..., Any], name: str | None = None) -> Tool:
        """Build a tool from a (sync or async) function or bound method with type hints."""
        summary, arg_docs = _parse_docstring(fn.__doc__)
        fields: dict[str, Any] = {}
        for pname, param in inspect.signature(fn).parameters.items():
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                raise TypeError(f"tool {fn.__name__}: *args/**kwargs are not allowed in a tool signature")
            if param.annotation is inspect.Parameter.empty:
                raise TypeError(f"tool {fn.__name__}: parameter {pname!r} needs a type hint")
            default = ... if param.default is inspect.Parameter.empty else param.default
            fields[pname] = (param.annotation, pydantic.Field(default, description=arg_docs.get(pname)))
        tool_name = name or fn.__name__
        model = pydantic.create_model(
            f"{tool_name}_args",
            __config__=pydantic.ConfigDict(extra="forbid", strict=False),
            **fields,
        )
        return cls(name=tool_name, description=summary, fn=fn, args_model=model)

    @property
    def schema(self) -> dict[str, Any]:
        """The OpenAI function-tool schema (a fresh copy: callers may change it)."""
        if self._parameters is None:
            params = _strip_titles(self.args_model.model_json_schema())
            params.setdefault("properties", {})
            params.setdefault("required", [])
            params.pop("additionalProperties", None)
            self._parameters = params
        params = copy.deepcopy(self._parameters)
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": params},
        }

    def validate(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """Check the model's arguments; raises ToolError with a short, model-readable message."""
        try:
            parsed = self.args_model.model_validate(arguments)
        except pydantic.ValidationError as e:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in err['loc']) or 'arguments'}: {err['msg']}" for err in e.errors()
            )
            raise ToolError(f"bad arguments for {self.name}: {problems}") from None
        return {k: getattr(parsed, k) for k in type(parsed).model_fields}

    async def __call__(self, call: ToolCall) -> ToolResult:
        """Run one parsed call. Agent mistakes become a failed ToolResult; env bugs propagate."""
        start = time.perf_counter()
        try:
            if call.parse_error:
                raise ToolError(call.parse_error)
            kwargs = self.validate(call.arguments)
            out = self.fn(**kwargs)
            if inspect.isawaitable(out):
                out = await out
        except ToolError as e:
            return _failed(call, e, start)
        if isinstance(out, ToolResult):
            out.call_id, out.name, out.latency_s = call.id, call.name, time.perf_counter() - start
            return out
        return ToolResult(call.id, call.name, str(out), latency_s=time.perf_counter() - start)


class SchemaTool:
    """A tool known here only by its JSON Schema, that runs where its env does (a hosted env server, an
    OpenEnv server, a verifiers env): names and required or extra argument keys are checked here, and
    calling it here is a bug. `forbid_extra`: None follows the schema (`additionalProperties: false`);
    True refuses extra keys whatever it says (our own server's schemas leave that key out, see
    `Tool.schema`, although their tools forbid extras). It offers what an env's tool list is used for
    (`name`, `description`, `schema`, `validate`, a call), not `Tool`'s function and argument model."""

    def __init__(
        self, name: str, description: str, parameters: dict[str, Any], *, forbid_extra: bool | None = None
    ) -> None:
        self.name = name
        self.description = description
        self.parameters = parameters
        self.forbid_extra = (
            parameters.get("additionalProperties") is False if forbid_extra is None else forbid_extra
        )

    @classmethod
    def from_openai(cls, schema: dict[str, Any], *, forbid_extra: bool | None = None) -> SchemaTool:
        """From an OpenAI function-tool schema (`{"type": "function", "function": {...}}`)."""
        fn = schema.get("function", {})
        return cls(
            fn.get("name", ""),
            fn.get("description", ""),
            fn.get("parameters") or {},
            forbid_extra=forbid_extra,
        )

    @property
    def schema(self) -> dict[str, Any]:
        fn = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": fn}

    def validate(self, arguments: dict[str, Any]) -> dict[str, Any]:
        props = self.parameters.get("properties")
        problems = [f"{k}: Field required" for k in self.parameters.get("required", []) if k not in arguments]
        if isinstance(props, dict) and self.forbid_extra:
            problems += [f"{k}: Extra inputs are not permitted" for k in arguments if k not in props]
        if problems:
            raise ToolError(f"bad arguments for {self.name}: {'; '.join(problems)}")
        return dict(arguments)

    async def __call__(self, call: ToolCall) -> ToolResult:
        """Agent mistakes become a failed ToolResult, as for `Tool`; a valid call here is a bug."""
        start = time.perf_counter()
        try:
            if call.parse_error:
                raise ToolError(call.parse_error)
            self.validate(call.arguments)
        except ToolError as e:
            return _failed(call, e, start)
        raise RuntimeError("a remote tool runs where its env does, through that env's step")


AnyTool = Tool | SchemaTool
"""What an env's `tools` list holds: tools that run here and tools that run where their env does."""


def _failed(call: ToolCall, error: ToolError, start: float) -> ToolResult:
    return ToolResult(call.id, call.name, f"Error: {error}", ok=False, latency_s=time.perf_counter() - start)


def validate_calls(calls: list[ToolCall], tools: list[AnyTool]) -> None:
    """Mark unknown tools and bad arguments on the calls (sets `parse_error`, never raises)."""
    by_name = {t.name: t for t in tools}
    for call in calls:
        if call.parse_error:
            continue
        tool = by_name.get(call.name or "")
        if tool is None:
            known = ", ".join(sorted(by_name)) or "none"
            call.parse_error = f"unknown tool {call.name!r}; available tools: {known}"
            continue
        try:
            tool.validate(call.arguments)
        except ToolError as e:
            call.parse_error = str(e)
