"""Token-exact sessions: a trajectory only ever grows by what the policy sampled and what the
template adds after it, on three chat-template families; a rewritten history forks."""

from __future__ import annotations

import json
from typing import Any

import pytest

from streamrl.agents.tool_calls import parse_tool_calls
from streamrl.agents.trajectory import NO_VERSION, ChatRenderer, TemplateError, Trajectory, same_message
from streamrl.models.tokenizer import build_char_tokenizer
from tests.agents.templates import LLAMA3, QWEN3, QWEN25, tokenizer

TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers",
                                           "parameters": {"type": "object"}}}]
FAMILIES = {  # template, end-of-turn token (the eos the policy samples), tool-call parser, tool-call text
    "qwen2.5": (QWEN25, "<|im_end|>", "hermes", '<tool_call>\n{{"name": "add", "arguments": {args}}}\n</tool_call>'),
    "llama3": (LLAMA3, "<|eot_id|>", "llama3", '{{"name": "add", "parameters": {args}}}'),
}


def sampled_ids(tok: Any, text: str) -> list[int]:
    """What a policy may sample for ``text``: one piece per character, not the tokenizer's merges
    (the tokens a re-tokenisation would make differ, so the test sees whether they are kept)."""
    return [i for ch in text for i in tok.encode(ch, add_special_tokens=False)]


class Agent:
    """The session's two sides: the server's trajectory, and the agent's message list."""

    def __init__(self, family: str) -> None:
        template, self.eos, self.parser, self.call_format = FAMILIES[family]
        self.tok = tokenizer(template, self.eos)
        self.renderer = ChatRenderer(self.tok)
        self.messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 12 + 30?"}]
        self.trajectory: Trajectory | None = None
        self.forks = 0
        self.sampled: list[tuple[int, list[int]]] = []  # (where in the trajectory, the ids sampled there)
        self.errors = 0

    def turn(self, reply: str, version: int) -> dict[str, Any]:
        """One request: continue (or fork), then 'sample' ``reply`` and return the assistant message."""
        got = self.renderer.continue_from(self.trajectory, self.messages, TOOLS)
        if got.forked:
            self.forks += 1
        t = got.trajectory
        if self.trajectory is not None and not got.forked:
            assert t.ids[:len(self.trajectory.ids)] == self.trajectory.ids  # the earlier turns' tokens, untouched
        ids = [*sampled_ids(self.tok, reply), self.tok.convert_tokens_to_ids(self.eos)]
        self.sampled.append((len(t.ids), ids))
        parsed = parse_tool_calls(self.parser, reply)
        self.errors += len(parsed.errors)
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content or None}
        if parsed.tool_calls:
            message["tool_calls"] = [{"id": f"call_{len(self.sampled)}_{k}", "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}}
                                     for k, c in enumerate(parsed.tool_calls)]
        t.append_completion(ids, [-0.5] * len(ids), [version] * len(ids), message, stop_token=ids[-1])
        self.trajectory = t
        self.messages.append(message)
        return message


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_an_eight_turn_session_with_tool_calls_keeps_every_sampled_token(family: str) -> None:
    agent = Agent(family)
    for turn in range(8):
        if turn % 3 == 2:
            reply = '<tool_call>{"name": "add", "arguments": {"a": 12,}}</tool_call>' if family == "qwen2.5" \
                else '{"name": "add", "parameters": {"a": 12'  # malformed: the agent sees its text
        elif turn % 3 == 0:
            reply = agent.call_format.format(args=json.dumps({"a": 12, "b": turn}))
        else:
            reply = f"The answer is {42 + turn}."
        message = agent.turn(reply, version=turn // 2)
        if message.get("tool_calls"):
            call = message["tool_calls"][0]
            args = json.loads(call["function"]["arguments"])
            agent.messages.append({"role": "tool", "tool_call_id": call["id"], "content": str(args["a"] + args["b"])})
        else:
            agent.messages.append({"role": "user", "content": "Go on."})
    t = agent.trajectory
    assert t is not None and agent.forks == 0 and agent.errors == 2  # turns 2 and 5
    # every mask-1 token is one the policy sampled, with its logprob and version; nothing else is mask 1
    expected_mask = [0] * len(t.ids)
    for start, ids in agent.sampled:
        assert t.ids[start:start + len(ids)] == ids
        expected_mask[start:start + len(ids)] = [1] * len(ids)
    assert t.loss_mask == expected_mask
    assert all((v >= 0) == bool(m) and (lp == -0.5) == bool(m) for v, lp, m in zip(t.versions, t.logprobs, t.loss_mask,
                                                                                 strict=True))
    assert {v for v in t.versions if v != NO_VERSION} == {0, 1, 2, 3}
    # the mask-0 tokens between two completions are the template's: its closing after the sampled
    # end-of-turn token, the tool result or user turn, and the next generation prompt
    r, user = agent.renderer, [{"role": "user", "content": "u"}]
    prompt = r.render(user, None, add_generation_prompt=True)[len(r.render(user, None, add_generation_prompt=False)):]
    followers = [m for m in agent.messages if m["role"] != "assistant"][1:]
    for (a, ids_a), (b, _), follower in zip(agent.sampled, agent.sampled[1:], followers, strict=False):
        between = agent.tok.decode(t.ids[a + len(ids_a):b], skip_special_tokens=False)
        assert between.endswith(prompt) and follower["content"] in between, between


def test_plain_turns_decode_to_what_the_template_renders() -> None:
    """With no tool call to re-format, the trajectory's text is the template's rendering of the
    whole conversation, though its tokens are the sampled ones (not the tokenizer's merges)."""
    agent = Agent("qwen2.5")
    for k in range(3):
        agent.turn(f"It is {k}.", version=k)
        agent.messages.append({"role": "user", "content": "And then?"})
    t = agent.renderer.continue_from(agent.trajectory, agent.messages, TOOLS).trajectory
    text = agent.tok.decode(t.ids, skip_special_tokens=False)
    assert text == agent.renderer.render(agent.messages, TOOLS, add_generation_prompt=True)
    assert t.ids != agent.tok.encode(text, add_special_tokens=False)  # the sampled pieces, not re-merged


def test_a_template_that_drops_earlier_reasoning_forks_the_session() -> None:
    tok = tokenizer(QWEN3, "<|im_end|>")
    renderer = ChatRenderer(tok)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "a"}]
    t = renderer.start(messages)
    reply = "<think>\nhmm, add them\n</think>\n\n42"
    ids = [*sampled_ids(tok, reply), tok.convert_tokens_to_ids("<|im_end|>")]
    message = {"role": "assistant", "content": reply}
    t.append_completion(ids, [-1.0] * len(ids), [0] * len(ids), message, stop_token=ids[-1])
    messages += [message, {"role": "user", "content": "b"}]
    got = renderer.continue_from(t, messages)
    assert got.forked and "rewrites history" in got.reason
    fresh = got.trajectory  # rendered anew from the request, nothing in it sampled
    assert fresh.sampled_tokens == 0
    assert tok.decode(fresh.ids, skip_special_tokens=False) == renderer.render(messages, None, add_generation_prompt=True)
    # a reply without reasoning is not rewritten: the same session continues
    t2 = renderer.start(messages[:1])
    ids2 = [*sampled_ids(tok, "42"), ids[-1]]
    t2.append_completion(ids2, [0.0] * len(ids2), [0] * len(ids2), {"role": "assistant", "content": "42"}, ids2[-1])
    assert not renderer.continue_from(t2, [messages[0], {"role": "assistant", "content": "42"}, messages[2]]).forked


def test_an_edited_history_a_changed_tool_list_or_no_new_message_forks() -> None:
    agent = Agent("qwen2.5")
    agent.turn("The answer is 42.", version=0)
    t = agent.trajectory
    edited = [dict(agent.messages[0], content="What is 1 + 1?"), *agent.messages[1:], {"role": "user", "content": "?"}]
    got = agent.renderer.continue_from(t, edited, TOOLS)
    assert got.forked and "message 0 (user) differs" in got.reason
    assert "tools differ" in agent.renderer.continue_from(t, [*agent.messages, {"role": "user", "content": "?"}],
                                                          None).reason
    assert "no new message" in agent.renderer.continue_from(t, agent.messages, TOOLS).reason


def test_a_completion_cut_at_its_length_gets_the_whole_closing() -> None:
    """No stop token sampled: the template's whole closing (end-of-turn included) is mask 0."""
    agent = Agent("qwen2.5")
    r = agent.renderer
    t = r.start(agent.messages, TOOLS)
    ids = sampled_ids(agent.tok, "The ans")
    t.append_completion(ids, [0.0] * len(ids), [0] * len(ids), {"role": "assistant", "content": "The ans"}, None)
    got = r.continue_from(t, [*agent.messages, {"role": "assistant", "content": "The ans"},
                              {"role": "user", "content": "?"}], TOOLS)
    added = agent.tok.decode(got.trajectory.ids[len(t.ids):], skip_special_tokens=False)
    assert not got.forked and added.startswith("<|im_end|>\n<|im_start|>user\n?")


def test_tool_calls_compare_by_decoded_arguments() -> None:
    a = {"role": "assistant", "content": None,
         "tool_calls": [{"id": "1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]}
    b = {"role": "assistant", "content": "",
         "tool_calls": [{"id": "1", "type": "function", "function": {"name": "add", "arguments": '{"b":2,"a":1}'}}]}
    assert same_message(a, b)
    assert not same_message(a, {**b, "tool_calls": [{"function": {"name": "add", "arguments": '{"a": 2}'}}]})


def test_a_tokenizer_without_a_template_is_refused_naming_the_fix() -> None:
    with pytest.raises(TemplateError, match="no chat template"):
        ChatRenderer(build_char_tokenizer())


def test_a_completion_needs_one_logprob_and_version_per_token() -> None:
    with pytest.raises(ValueError, match="one logprob and version per token"):
        Trajectory().append_completion([1, 2], [0.0], [0, 0], {"role": "assistant", "content": ""}, None)
    with pytest.raises(ValueError, match="not the completion's last token"):
        Trajectory().append_completion([1, 2], [0.0, 0.0], [0, 0], {"role": "assistant", "content": ""}, 5)
