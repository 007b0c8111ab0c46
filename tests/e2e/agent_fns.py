"""Agents for the agent stage's tests: ``options.rollout`` names them."""

from __future__ import annotations

import asyncio
from typing import Any


async def fails_after_one_turn(client: Any, sample: dict[str, Any], **rollout_args: Any) -> float:
    await client.chat.completions.create(model=sample["model"], messages=[{"role": "user", "content": "?"}],
                                         max_tokens=2)
    raise ValueError("the tool server is down")


async def never_asks(client: Any, sample: dict[str, Any], **rollout_args: Any) -> float:
    return 1.0


async def three_slow_turns(client: Any, sample: dict[str, Any], pause_s: float = 0.2, **rollout_args: Any) -> float:
    """Three turns whatever the policy says, ``pause_s`` between them (a slow tool), so a session
    outlasts a training step: the reward is whether the last reply is the answer."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": sample["prompt"]}]
    content = ""
    for turn in range(3):
        if turn:
            await asyncio.sleep(pause_s)
        reply = await client.chat.completions.create(model=sample["model"], messages=messages, max_tokens=2)
        content = reply.choices[0].message.content or ""
        messages += [{"role": "assistant", "content": content}, {"role": "user", "content": "?"}]
    return 1.0 if content == sample["answer"] else 0.0


class EchoEnv:
    """A gym-style environment: asks the prompt, then asks again; 0.5 per reply that is the answer."""

    def reset(self, sample: dict[str, Any]) -> str:
        self.answer, self.turn = sample["answer"], 0
        return str(sample["prompt"])

    def step(self, reply: str) -> tuple[str | None, float, bool]:
        self.turn += 1
        return "?", 0.5 * (reply == self.answer), self.turn == 2
