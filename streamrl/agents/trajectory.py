"""A session's tokens, kept exactly as the policy saw and sampled them, turn after turn.

An agent speaks in messages; the policy in tokens. Re-rendering the conversation through the chat
template and tokenizing it again at every turn trains on tokens the policy never produced: the
template writes a tool call in its own spacing and key order, a BPE tokenizer merges across a
turn's boundary differently, a template drops earlier reasoning. So a session keeps its
:class:`Trajectory`, the token ids themselves, and a request only ever *appends* to it:

- **The first request** renders its messages with the generation prompt: those tokens, loss mask 0.
- **A completion** appends the sampled ids with loss mask 1, their logprobs and the policy version
  that sampled each, and records the assistant message the server returned for them.
- **A later request** continues the trajectory when its messages start with the conversation the
  trajectory holds, message for message (an assistant turn must be the one returned, its tool
  calls compared as JSON), and the template renders the new messages as a pure suffix of what it
  renders for the old ones. Then only that suffix is tokenized (loss mask 0), after the *bridge*:
  the text the template closes an assistant turn with (``<|im_end|>\\n`` in ChatML) minus the stop
  token the policy already sampled. The tokens of earlier turns are never re-made.
- **Otherwise it forks**: the agent edited a message, or the template rewrote history (Qwen3 drops
  an assistant turn's ``<think>`` block once a later user turn exists). The request starts a new
  trajectory from its own rendering; the old one ends as it was (it is still a valid sample).
  Forks are counted: a high fork rate means a template that rewrites history, or an agent that
  edits it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

NO_VERSION = -1  # the policy version of a token the policy did not sample


class TemplateError(ValueError):
    """The tokenizer's chat template cannot render what a session needs (no template, or one
    that does not show an assistant turn's content as written)."""


@dataclass
class Trajectory:
    """Token ids with one loss-mask bit, logprob and policy version per token."""

    ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)  # 1: sampled by the policy; 0: prompt, template, tool output
    logprobs: list[float] = field(default_factory=list)  # the sampling logprob; 0.0 where the mask is 0
    versions: list[int] = field(default_factory=list)  # the policy version that sampled it; NO_VERSION where mask 0
    messages: list[dict[str, Any]] = field(default_factory=list)  # the conversation these tokens hold
    tools: list[dict[str, Any]] | None = None  # the tools the template rendered them with
    last_stop: int | None = None  # the stop token the last completion ended with (None: cut at its length)

    @property
    def sampled_tokens(self) -> int:
        return sum(self.loss_mask)

    def append_context(self, ids: list[int]) -> None:
        """Tokens the policy did not sample (prompt, template, tool output): loss mask 0."""
        self.ids.extend(ids)
        self.loss_mask.extend([0] * len(ids))
        self.logprobs.extend([0.0] * len(ids))
        self.versions.extend([NO_VERSION] * len(ids))

    def append_completion(self, ids: list[int], logprobs: list[float], versions: list[int],
                          message: dict[str, Any], stop_token: int | None) -> None:
        """The policy's sampled tokens (loss mask 1) and the assistant message returned for them.
        ``stop_token``: the id it stopped on when that is ``ids[-1]`` (None: it ran to its length)."""
        if not len(ids) == len(logprobs) == len(versions):
            raise ValueError(f"a completion needs one logprob and version per token: {len(ids)} ids, "
                             f"{len(logprobs)} logprobs, {len(versions)} versions")
        if stop_token is not None and (not ids or ids[-1] != stop_token):
            raise ValueError(f"stop_token {stop_token} is not the completion's last token")
        self.ids.extend(ids)
        self.loss_mask.extend([1] * len(ids))
        self.logprobs.extend(logprobs)
        self.versions.extend(versions)
        self.messages.append(message)
        self.last_stop = stop_token


@dataclass
class Continuation:
    """What a request makes of its session: the trajectory to generate after (its tokens are the
    prompt) and whether it had to fork from the session's previous one."""

    trajectory: Trajectory
    forked: bool
    reason: str = ""  # why it forked


class ChatRenderer:
    """Renders conversations through the tokenizer's chat template, and continues trajectories."""

    SENTINEL = "\u2063streamrl\u2063"  # text no template writes: marks where an assistant turn's content ends

    def __init__(self, tokenizer: Any) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError("the tokenizer has no chat template; an agent session renders its messages through "
                                "one: use a model whose tokenizer has one, or set tokenizer.chat_template")
        self.tokenizer = tokenizer
        probe = [{"role": "user", "content": "u"}, {"role": "assistant", "content": self.SENTINEL}]
        text = self.render(probe, None, add_generation_prompt=False)
        if text.count(self.SENTINEL) != 1:
            raise TemplateError("the chat template does not show an assistant turn's content as written, so a "
                                "session cannot tell the tokens after it")
        self.closing = text.split(self.SENTINEL, 1)[1]  # what the template writes after an assistant turn

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, *,
               add_generation_prompt: bool) -> str:
        kwargs: dict[str, Any] = {"tools": tools} if tools else {}
        return str(self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt, **kwargs))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))  # the template has its own specials

    def start(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> Trajectory:
        """A new trajectory: the messages rendered with the generation prompt, loss mask 0."""
        t = Trajectory(messages=[dict(m) for m in messages], tools=tools)
        t.append_context(self.encode(self.render(messages, tools, add_generation_prompt=True)))
        return t

    def continue_from(self, previous: Trajectory | None, messages: list[dict[str, Any]],
                      tools: list[dict[str, Any]] | None = None) -> Continuation:
        """The trajectory a request's ``messages`` generate after: ``previous`` extended when the
        messages extend it exactly, else a fork (a new trajectory)."""
        if previous is None:
            return Continuation(self.start(messages, tools), forked=False)
        reason = self._mismatch(previous, messages, tools)
        if reason:
            return Continuation(self.start(messages, tools), forked=True, reason=reason)
        # the earlier turns as this request writes them (equal to the session's, message for message)
        old = self.render(messages[:len(previous.messages)], tools, add_generation_prompt=False)
        new = self.render(messages, tools, add_generation_prompt=True)
        if not new.startswith(old):
            return Continuation(self.start(messages, tools), forked=True,
                                reason="the chat template renders the earlier turns differently once the new "
                                       "messages follow them (it rewrites history)")
        bridge = self.closing
        if previous.last_stop is not None:  # the policy sampled the start of the closing itself
            stop_text = self.tokenizer.decode([previous.last_stop], skip_special_tokens=False)
            if bridge.startswith(stop_text):
                bridge = bridge[len(stop_text):]
        t = Trajectory(ids=list(previous.ids), loss_mask=list(previous.loss_mask), logprobs=list(previous.logprobs),
                       versions=list(previous.versions), messages=[dict(m) for m in messages], tools=tools)
        t.append_context(self.encode(bridge + new[len(old):]))
        return Continuation(t, forked=False)

    def _mismatch(self, previous: Trajectory, messages: list[dict[str, Any]],
                  tools: list[dict[str, Any]] | None) -> str:
        """Why ``messages`` do not extend ``previous``'s conversation ('' when they do)."""
        if not previous.messages or previous.messages[-1].get("role") != "assistant":
            return "the session's last turn is not a completion"
        if (tools or None) != (previous.tools or None):
            return "the request's tools differ from the session's"
        if len(messages) <= len(previous.messages):
            return "the request has no new message after the session's last completion"
        for i, (had, got) in enumerate(zip(previous.messages, messages, strict=False)):
            if not same_message(had, got):
                return f"message {i} ({had.get('role')}) differs from the session's"
        return ""


def same_message(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Equal as a chat template sees them: role, content (None and '' alike), tool calls by name
    and decoded arguments, and the tool call a tool result answers."""
    if a.get("role") != b.get("role") or (a.get("content") or "") != (b.get("content") or ""):
        return False
    if a.get("tool_call_id") != b.get("tool_call_id") or a.get("name") != b.get("name"):
        return False
    return _calls(a) == _calls(b)


def _calls(m: dict[str, Any]) -> list[tuple[str, Any]]:
    out = []
    for call in m.get("tool_calls") or []:
        fn = call.get("function", call) if isinstance(call, dict) else {}
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        out.append((fn.get("name"), args))
    return out
