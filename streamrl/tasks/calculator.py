"""``digits-calc``: digits-sum with a calculator tool, the multi-turn task the agent stage ships.

The question is digits-sum's, "3+5+2=" -> "0" (the last digit of the sum). Alone, a tiny model
from a random init does not learn it: the answer depends on every digit at once, and RL stays at
chance (:mod:`streamrl.tasks.digits`). With the calculator it can: the agent (:func:`solve`, plain
``openai`` SDK code with ``tools``) offers a ``calculator`` tool; when the policy calls it, the
agent runs it on the question and sends the sum back as a tool message, and the policy's next
turn must say the sum's last digit. Answers count only after a call (:func:`solve`), so the
reward rises as the policy learns to call the tool and answer after it, then, more slowly (a
tiny model copies a digit from several positions back in tens of steps), to read its answer.

A call is the reply ``?`` alone (:func:`parse_call`, the agent stage's ``options.tool_parser``: a
tiny model cannot learn JSON quickly); a reply that has ``?`` among other characters is a
malformed call, which the agent sees as plain text and the run counts.
"""

from __future__ import annotations

from typing import Any

from streamrl.agents.tool_calls import ParsedReply, ToolCall
from streamrl.tasks.digits import FirstDigitTask

CALL = "?"
CALCULATOR_TOOL = {"type": "function", "function": {
    "name": "calculator", "description": "the sum of the question's digits",
    "parameters": {"type": "object", "properties": {}}}}


def digits_calc(n_digits: int = 3, tokenizer: Any = None) -> FirstDigitTask:
    """digits-sum's prompts and answers; the single-turn reward is digits-sum's (the first token)."""
    return FirstDigitTask("digits-calc", lambda d: sum(d) % 10, n_digits, tokenizer)


def parse_call(text: str) -> ParsedReply:
    """The tool-call parser: ``?`` alone calls the calculator; ``?`` with anything else is malformed."""
    if text == CALL:
        return ParsedReply(content="", tool_calls=[ToolCall("calculator", "{}")])
    if CALL in text:
        return ParsedReply(content=text, errors=[f"a calculator call is the reply {CALL!r} alone, got {text!r}"])
    return ParsedReply(content=text)


def calculator(question: str) -> str:
    """The tool: the sum of the digits in ``question`` ("3+5+2=" -> "10")."""
    return str(sum(int(c) for c in question if c.isdigit()))


async def solve(client: Any, sample: dict[str, Any], turns: int = 3, max_tokens: int = 1,
                tool_bonus: float = 0.2) -> float:
    """Answer ``sample["prompt"]`` with the policy behind ``client`` (an ``openai.AsyncOpenAI``),
    running the calculator whenever it asks, for at most ``turns`` turns; the first turn without a
    call is the answer. Only an answer after a call counts (the task is to use the tool): it earns
    ``tool_bonus`` shared by the calls made (a second call tells nothing new: without the share,
    calling twice pays as calling once, and a policy that settles on it must later unlearn the
    second call, which it does by calling less at every turn for a few steps), plus
    ``1 - tool_bonus`` if it is right. No answer within ``turns`` turns, or one
    without a call, earns nothing. Why: a random policy rarely calls; rewarding the answers it
    guesses without the tool (right one time in ten) would teach it a fixed guess before it ever
    calls, and a fixed guess gives every session of a group the same reward, so nothing is learned
    after that. ``max_tokens``: 1, a turn is one character (the template closes it): a reply that
    had to end with the end-of-turn token as well would be right one time in ~400 at first, not 1 in 20.
    With longer replies, one that has ``?`` among other characters is a malformed call."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": sample["prompt"]}]
    for calls in range(turns):  # calls made so far
        reply = await client.chat.completions.create(model=sample["model"], messages=messages,
                                                     tools=[CALCULATOR_TOOL], max_tokens=max_tokens)
        message = reply.choices[0].message
        if not message.tool_calls:
            right = message.content == sample["answer"]
            return (tool_bonus / calls + (1.0 - tool_bonus) * right) if calls else 0.0
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calculator(sample["prompt"])})
    return 0.0
