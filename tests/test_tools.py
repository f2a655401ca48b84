"""Tools from plain functions: OpenAI schemas, argument validation, agent errors vs env bugs."""

import asyncio

import pytest

from reflow.env import Tool, ToolCall, ToolError, ToolResult
from reflow.env.checker import check_tool_schema


def search(query: str, limit: int = 5, exact: bool = False) -> str:
    """Search the notes.

    Args:
        query: the words to look for,
            across several lines.
        limit: how many hits to return.
        exact (bool): match whole words only.

    Returns:
        The hits.
    """
    if not query:
        raise ToolError("empty query")
    return f"{query}:{limit}:{exact}"


async def slow_upper(text: str) -> str:
    """Upper-case text, slowly."""
    await asyncio.sleep(0.01)
    return text.upper()


def buggy(x: int) -> str:
    """A tool with a bug."""
    raise RuntimeError("bug in the env")


def test_schema_from_function():
    schema = Tool.from_function(search).schema
    check_tool_schema(schema)
    fn = schema["function"]
    assert fn["name"] == "search"
    assert fn["description"] == "Search the notes."
    props = fn["parameters"]["properties"]
    assert props["query"] == {"type": "string", "description": "the words to look for, across several lines."}
    assert props["limit"]["type"] == "integer" and props["limit"]["default"] == 5
    assert props["exact"]["description"] == "match whole words only."
    assert fn["parameters"]["required"] == ["query"]


def test_untyped_parameters_are_refused():
    def untyped(x):
        """No hints."""

    with pytest.raises(TypeError, match="needs a type hint"):
        Tool.from_function(untyped)


async def test_call_validates_and_runs_sync_and_async():
    result = await Tool.from_function(search)(
        ToolCall("search", {"query": "cat", "limit": "3"}, "", "call_7")
    )
    assert isinstance(result, ToolResult)
    assert (result.ok, result.content, result.call_id, result.name) == (
        True,
        "cat:3:False",
        "call_7",
        "search",
    )
    assert result.latency_s >= 0
    result = await Tool.from_function(slow_upper)(ToolCall("slow_upper", {"text": "hi"}, ""))
    assert result.content == "HI" and result.latency_s >= 0.01


async def test_agent_errors_become_failed_results():
    tool = Tool.from_function(search)
    bad_type = await tool(ToolCall("search", {"query": "x", "limit": "many"}, ""))
    assert not bad_type.ok and bad_type.content.startswith("Error: bad arguments for search: limit")
    raised = await tool(ToolCall("search", {"query": ""}, ""))
    assert not raised.ok and raised.content == "Error: empty query"


async def test_env_bugs_propagate():
    with pytest.raises(RuntimeError, match="bug in the env"):
        await Tool.from_function(buggy)(ToolCall("buggy", {"x": 1}, ""))


def test_a_schema_tool_checks_required_keys_and_extras_as_its_schema_or_caller_says():
    from reflow.env import SchemaTool, ToolError

    params = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    open_tool = SchemaTool("f", "d", params)  # no additionalProperties: extras are allowed
    assert open_tool.validate({"x": 1, "y": 2}) == {"x": 1, "y": 2}
    with pytest.raises(ToolError, match="x: Field required"):
        open_tool.validate({})
    strict = SchemaTool("f", "d", {**params, "additionalProperties": False})
    with pytest.raises(ToolError, match="y: Extra inputs are not permitted"):
        strict.validate({"x": 1, "y": 2})
    served = SchemaTool.from_openai(open_tool.schema, forbid_extra=True)  # our server's tools forbid extras
    assert served.schema == open_tool.schema
    with pytest.raises(ToolError, match="y: Extra inputs"):
        served.validate({"x": 1, "y": 2})
