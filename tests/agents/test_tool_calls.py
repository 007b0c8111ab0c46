"""Tool-call parsers: each format's well-formed calls, and every malformed one reported, not raised."""

from __future__ import annotations

import json

import pytest

from streamrl.agents.tool_calls import TOOL_PARSERS, ParsedReply, ToolCall, hermes, llama3, parse_tool_calls
from streamrl.algos.registry import UnknownAlgorithmError


def test_hermes_blocks_become_calls_and_the_text_around_them_the_content() -> None:
    text = ('Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 12, "b": 30}}\n</tool_call>\n'
            '<tool_call>{"name": "now", "arguments": "{}"}</tool_call>')
    got = hermes(text)
    assert got.errors == []
    assert got.tool_calls == [ToolCall("add", '{"a": 12, "b": 30}'), ToolCall("now", "{}")]
    assert got.content == "Let me add."
    assert TOOL_PARSERS.resolve("qwen") is hermes


def test_hermes_without_a_call_leaves_the_text_as_written() -> None:
    assert hermes("  42\n") == ParsedReply(content="  42\n")


@pytest.mark.parametrize(("text", "reason"), [
    ('<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>', "not valid JSON"),
    ('<tool_call>["add"]</tool_call>', "expected a JSON object"),
    ('<tool_call>{"arguments": {}}</tool_call>', '"name" must be a non-empty string'),
    ('<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>', '"arguments" must be a JSON object'),
    ('<tool_call>{"name": "add", "arguments": "{a: 1}"}</tool_call>', "is a string that is not JSON"),
    ('<tool_call>{"name": "add", "arguments": {"a": 1}}', "without </tool_call>"),
])
def test_a_malformed_hermes_call_is_an_error_and_stays_in_the_content(text: str, reason: str) -> None:
    got = hermes("ok " + text)
    assert got.tool_calls == [] and len(got.errors) == 1 and reason in got.errors[0], got.errors
    assert got.errors[0].startswith("tool call 1: ")
    assert text in got.content  # the agent sees what the model wrote


def test_a_malformed_call_next_to_a_good_one_keeps_the_good_one() -> None:
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{bad</tool_call>'
    got = hermes(text)
    assert got.tool_calls == [ToolCall("a", "{}")]
    assert len(got.errors) == 1 and got.errors[0].startswith("tool call 2: not valid JSON")
    assert got.content == "<tool_call>{bad</tool_call>"


def test_llama3_json_calls_with_and_without_the_python_tag() -> None:
    one = llama3('{"name": "add", "parameters": {"a": 1, "b": 2}}')
    assert one == ParsedReply(content="", tool_calls=[ToolCall("add", '{"a": 1, "b": 2}')])
    two = llama3('<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": "y"}}')
    assert [c.name for c in two.tool_calls] == ["a", "b"] and two.errors == []
    assert json.loads(two.tool_calls[1].arguments) == {"x": "y"}
    assert llama3("The answer is 3.") == ParsedReply(content="The answer is 3.")


@pytest.mark.parametrize(("text", "reason"), [
    ('{"name": "add", "parameters": {"a": 1}', "not valid JSON"),
    ('{"parameters": {}}', '"name" must be a non-empty string'),
    ('<|python_tag|>add(1, 2)', "not followed by a JSON object"),
])
def test_a_malformed_llama3_call_is_an_error_and_the_reply_is_kept(text: str, reason: str) -> None:
    got = llama3(text)
    assert len(got.errors) == 1 and reason in got.errors[0], got.errors
    assert got.content == text


def test_a_long_malformed_call_is_quoted_short() -> None:
    got = hermes("<tool_call>{" + "x" * 1000 + "</tool_call>")
    assert len(got.errors[0]) < 250 and got.errors[0].endswith("...")


def test_a_parser_from_a_module_and_its_failures_as_errors() -> None:
    got = parse_tool_calls("tests.agents.user_parsers:call_prefix", "thinking\nCALL clock")
    assert got.tool_calls == [ToolCall("clock", "{}")] and got.content == "thinking"
    failed = parse_tool_calls("tests.agents.user_parsers:raises", "text")
    assert failed.content == "text" and failed.errors == ["tool-call parser failed: RuntimeError: boom"]
    with pytest.raises(UnknownAlgorithmError, match=r"lacks the parameter\(s\) text"):
        parse_tool_calls("tests.agents.user_parsers:wrong_signature", "x")
    with pytest.raises(UnknownAlgorithmError, match=r"did you mean 'hermes'"):
        parse_tool_calls("hermez", "x")
