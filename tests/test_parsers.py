"""Tool-call parsing: every malformed case becomes a flagged call, never an exception."""

import json
import random
import re
import time

import pytest

from reflow.env import Tool, parse_assistant
from reflow.env.parsers import CUT_OFF_ERROR, get_parser, register_parser, split_reasoning


def add(a: int, b: int = 0) -> int:
    """Add two integers.

    Args:
        a: first.
        b: second.
    """
    return a + b


TOOLS = [Tool.from_function(add)]


def call(obj) -> str:
    return f"<tool_call>\n{json.dumps(obj)}\n</tool_call>"


def test_single_and_multiple_calls_with_content():
    text = (
        "Let me add.\n"
        + call({"name": "add", "arguments": {"a": 1, "b": 2}})
        + call({"name": "add", "arguments": {"a": 5}})
    )
    turn = parse_assistant(text, tools=TOOLS)
    assert turn.content == "Let me add."
    assert [(c.name, c.arguments, c.parse_error) for c in turn.tool_calls] == [
        ("add", {"a": 1, "b": 2}, None),
        ("add", {"a": 5}, None),
    ]
    assert [c.id for c in turn.tool_calls] == ["call_0", "call_1"]
    assert turn.raw_text == text
    msg = turn.to_message()
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"a": 1, "b": 2}


def test_reasoning_is_split_from_content():
    turn = parse_assistant("<think>\n2+2 is 4\n</think>\nThe answer is 4.")
    assert turn.reasoning == "2+2 is 4"
    assert turn.content == "The answer is 4."
    assert split_reasoning("no think here") == (None, "no think here")


def test_invalid_json_is_flagged():
    turn = parse_assistant('<tool_call>\n{"name": "add", "arguments": {"a": 1\n</tool_call>', tools=TOOLS)
    (c,) = turn.tool_calls
    assert c.parse_error.startswith("tool call is not valid JSON")
    assert c.name is None


@pytest.mark.parametrize(
    "body, needle",
    [
        ("[1, 2]", 'string "name"'),
        ('{"arguments": {}}', 'string "name"'),
        ('{"name": "add", "arguments": [1]}', '"arguments" must be a JSON object'),
        ('{"name": "add", "arguments": "{not json"}', "arguments are not valid JSON"),
    ],
)
def test_structurally_wrong_calls_are_flagged(body, needle):
    (c,) = parse_assistant(f"<tool_call>{body}</tool_call>", tools=TOOLS).tool_calls
    assert needle in c.parse_error


def test_arguments_given_as_json_string_are_accepted():
    (c,) = parse_assistant(call({"name": "add", "arguments": json.dumps({"a": 3})}), tools=TOOLS).tool_calls
    assert c.parse_error is None and c.arguments == {"a": 3}


def test_unknown_tool_is_flagged_with_the_available_names():
    (c,) = parse_assistant(call({"name": "mul", "arguments": {}}), tools=TOOLS).tool_calls
    assert c.parse_error == "unknown tool 'mul'; available tools: add"


@pytest.mark.parametrize(
    "args, needle",
    [
        ({}, "a: Field required"),
        ({"a": "x"}, "a: Input should be a valid integer"),
        ({"a": 1, "c": 2}, "c: Extra inputs"),
    ],
)
def test_bad_arguments_are_flagged(args, needle):
    (c,) = parse_assistant(call({"name": "add", "arguments": args}), tools=TOOLS).tool_calls
    assert c.parse_error.startswith("bad arguments for add:")
    assert needle in c.parse_error


def test_call_cut_off_by_the_token_limit():
    turn = parse_assistant('ok <tool_call>\n{"name": "add", "argu', finish_reason="length", tools=TOOLS)
    (c,) = turn.tool_calls
    assert c.parse_error == CUT_OFF_ERROR
    assert c.raw == '{"name": "add", "argu'
    assert turn.content == "ok"
    # the same text with a normal stop is a different (clearer) error
    (c2,) = parse_assistant('<tool_call>{"name": "add"', finish_reason="stop").tool_calls
    assert "no closing </tool_call>" in c2.parse_error


def test_without_tools_only_syntax_is_checked():
    (c,) = parse_assistant(call({"name": "anything", "arguments": {"x": 1}})).tool_calls
    assert c.parse_error is None


def test_parser_never_raises_on_garbage():
    rng = random.Random(0)
    alphabet = [
        "<tool_call>",
        "</tool_call>",
        "{",
        "}",
        '"name"',
        '"arguments"',
        ":",
        ",",
        '"add"',
        "1",
        "<think>",
        "</think>",
        " ",
        "\n",
        "[",
        "]",
    ]
    for _ in range(2000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        turn = parse_assistant(text, finish_reason=rng.choice(["stop", "length"]), tools=TOOLS)
        for c in turn.tool_calls:
            assert c.parse_error is None or isinstance(c.parse_error, str)
            if c.parse_error is None:
                assert c.name == "add" and isinstance(c.arguments, dict)


def _hermes_by_regex(text: str) -> tuple[str, list[tuple[str, str | None]]]:
    """What the hermes parser found with the regex it used before it was made linear: the reference."""
    block = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
    calls = [(m.group(1).strip(), None) for m in block.finditer(text)]
    content = block.sub("", text)
    opened = content.rfind("<tool_call>")
    if opened != -1:
        calls.append((content[opened + len("<tool_call>") :].strip(), "cut"))
        content = content[:opened]
    return content.strip(), calls


def test_the_hermes_parser_finds_what_the_regex_found():
    rng = random.Random(1)
    pieces = ["<tool_call>", "</tool_call>", "<tool_", "call>", "</tool", "x", " ", '{"name": "add"}', "\n"]
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        content, calls = get_parser("hermes")(text, "stop")
        expected_content, expected = _hermes_by_regex(text)
        assert content == expected_content, text
        assert [(c.raw, "cut" if c.parse_error and "closing" in c.parse_error else None) for c in calls] == [
            (raw, cut) for raw, cut in expected
        ], text


def test_the_hermes_parser_is_linear_in_unclosed_tags():
    text = "<tool_call>" * ((1 << 20) // len("<tool_call>"))  # a megabyte; quadratic, this took minutes
    start = time.perf_counter()
    turn = parse_assistant(text, tools=TOOLS)
    assert time.perf_counter() - start < 0.5
    (cut,) = turn.tool_calls
    assert "no closing </tool_call>" in cut.parse_error


def test_a_deeply_nested_call_is_a_parse_error():
    (c,) = parse_assistant("<tool_call>" + "[" * 100_000 + "</tool_call>", tools=TOOLS).tool_calls
    assert c.parse_error is not None and "JSON" in c.parse_error


def test_parser_registry():
    @register_parser("test-bracket")
    def parse_bracket(text, finish_reason):
        from reflow.env import ToolCall

        if text.startswith("[add]"):
            return "", [ToolCall("add", {"a": 1}, text)]
        return text, []

    assert get_parser("test-bracket") is parse_bracket
    assert parse_assistant("[add]", parser="test-bracket", tools=TOOLS).tool_calls[0].name == "add"
    with pytest.raises(KeyError, match="unknown tool-call parser"):
        parse_assistant("x", parser="nope")
