"""Tool calls in the text a policy generates, parsed per model family.

A parser is ``fn(text) -> ParsedReply``: the text outside any tool-call markup (``content``), the
well-formed calls (``tool_calls``, arguments as a JSON object's text, as OpenAI's wire format has
them) and, for each malformed call, what is wrong with it (``errors``). A malformed call is never
an exception: its raw text stays in ``content``, so the agent sees what the model wrote, and the
error is counted in the run's metrics. A parser is named in the config by its registered name or as
``module:function``:

- ``hermes`` (also ``qwen``): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks,
  anywhere in the text (Hermes 2 Pro, Qwen2.5, Qwen3).
- ``llama3``: the whole reply is one JSON call ``{"name": ..., "parameters": {...}}`` or several
  separated by ``;``, optionally after ``<|python_tag|>`` (Llama 3.1/3.2 JSON tool calling).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import msgspec

from streamrl.algos.registry import Registry


class ToolCall(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One well-formed call: the function's name and its arguments, a JSON object as text."""

    name: str
    arguments: str


class ParsedReply(msgspec.Struct, forbid_unknown_fields=True):
    content: str
    tool_calls: list[ToolCall] = msgspec.field(default_factory=list)
    errors: list[str] = msgspec.field(default_factory=list)  # one per malformed call


ToolParser = Callable[..., ParsedReply]
TOOL_PARSERS: Registry[ToolParser] = Registry("tool-call parser", ("text",))

MAX_ERROR_QUOTE = 120  # characters of a malformed call quoted in its error


def _call_from(obj: Any, args_key: str, where: str) -> ToolCall | str:
    """A ToolCall from a decoded JSON value, or the reason it is not one."""
    if not isinstance(obj, dict):
        return f"{where}: expected a JSON object with \"name\" and \"{args_key}\", got {type(obj).__name__}"
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return f"{where}: \"name\" must be a non-empty string"
    args = obj.get(args_key, {})
    if isinstance(args, str):  # some models write the arguments as a JSON string, as OpenAI sends them
        try:
            args = json.loads(args)
        except json.JSONDecodeError as exc:
            return f"{where}: \"{args_key}\" is a string that is not JSON ({exc.msg} at {exc.pos})"
    if not isinstance(args, dict):
        return f"{where}: \"{args_key}\" must be a JSON object, got {type(args).__name__}"
    return ToolCall(name=name, arguments=json.dumps(args, ensure_ascii=False))


def _quote(raw: str) -> str:
    raw = raw.strip()
    return raw if len(raw) <= MAX_ERROR_QUOTE else raw[:MAX_ERROR_QUOTE] + "..."


def _decode_call(raw: str, args_key: str, where: str) -> ToolCall | str:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as exc:
        return f"{where}: not valid JSON ({exc.msg} at character {exc.pos}): {_quote(raw)}"
    return _call_from(obj, args_key, where)


_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@TOOL_PARSERS.register("hermes")
def hermes(text: str) -> ParsedReply:
    """``<tool_call>{json}</tool_call>`` blocks; an unclosed ``<tool_call>`` is a malformed call."""
    calls: list[ToolCall] = []
    errors: list[str] = []
    kept: list[str] = []  # the content: text between the blocks, and the malformed blocks as written
    end = 0
    for n, m in enumerate(_HERMES.finditer(text), start=1):
        kept.append(text[end:m.start()])
        got = _decode_call(m.group(1), "arguments", f"tool call {n}")
        if isinstance(got, ToolCall):
            calls.append(got)
        else:
            errors.append(got)
            kept.append(m.group(0))
        end = m.end()
    rest = text[end:]
    if "<tool_call>" in rest:
        errors.append(f"tool call {len(calls) + len(errors) + 1}: <tool_call> without </tool_call>: "
                      f"{_quote(rest[rest.index('<tool_call>'):])}")
    kept.append(rest)
    return ParsedReply(content="".join(kept).strip() if calls else "".join(kept), tool_calls=calls, errors=errors)


TOOL_PARSERS.register("qwen")(hermes)

PYTHON_TAG = "<|python_tag|>"


@TOOL_PARSERS.register("llama3")
def llama3(text: str) -> ParsedReply:
    """A reply that is JSON calls (``{"name", "parameters"}``, ``;``-separated) after an optional
    ``<|python_tag|>``; any other reply is plain content."""
    body = text.strip()
    tagged = body.startswith(PYTHON_TAG)
    if tagged:
        body = body[len(PYTHON_TAG):].strip()
    if not body.startswith("{"):
        if tagged:
            return ParsedReply(content=text, errors=[f"tool call 1: {PYTHON_TAG} not followed by a JSON object: "
                                                     f"{_quote(body)}"])
        return ParsedReply(content=text)
    calls: list[ToolCall] = []
    errors: list[str] = []
    decoder = json.JSONDecoder()
    pos, n = 0, 0
    while pos < len(body):
        n += 1
        try:
            obj, stop = decoder.raw_decode(body, pos)
        except json.JSONDecodeError as exc:
            errors.append(f"tool call {n}: not valid JSON ({exc.msg} at character {exc.pos}): {_quote(body[pos:])}")
            break
        got = _call_from(obj, "parameters", f"tool call {n}")
        if isinstance(got, ToolCall):
            calls.append(got)
        else:
            errors.append(got)
        pos = stop
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
    if errors:  # the agent sees the reply as written next to what was wrong with it
        return ParsedReply(content=text, tool_calls=calls, errors=errors)
    return ParsedReply(content="", tool_calls=calls)


def parse_tool_calls(parser: str | ToolParser, text: str) -> ParsedReply:
    """``text`` through ``parser`` (a registered name, ``module:function``, or the function); a
    parser that raises or returns something else is reported as the reply's error, not raised."""
    fn = TOOL_PARSERS.resolve(parser) if isinstance(parser, str) else parser
    try:
        out = fn(text=text)
    except Exception as exc:  # a user's parser: its failure is this reply's, not the server's
        return ParsedReply(content=text, errors=[f"tool-call parser failed: {type(exc).__name__}: {exc}"])
    if not isinstance(out, ParsedReply):
        return ParsedReply(content=text, errors=[f"tool-call parser returned {type(out).__name__}, not ParsedReply"])
    return out
