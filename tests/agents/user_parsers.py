"""Tool-call parsers a test names as module:function."""

from __future__ import annotations

from streamrl.agents.tool_calls import ParsedReply, ToolCall


def call_prefix(text: str) -> ParsedReply:
    """``CALL name`` on a line of its own calls ``name`` without arguments."""
    lines = text.splitlines()
    calls = [ToolCall(name=line[5:].strip(), arguments="{}") for line in lines if line.startswith("CALL ")]
    return ParsedReply(content="\n".join(line for line in lines if not line.startswith("CALL ")), tool_calls=calls)


def raises(text: str) -> ParsedReply:
    raise RuntimeError("boom")


def wrong_signature(reply: str) -> ParsedReply:
    return ParsedReply(content=reply)
