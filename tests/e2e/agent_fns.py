"""Agents for the agent stage's tests: ``options.rollout`` names them."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path
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


async def three_turns_across_a_train_step(client: Any, sample: dict[str, Any], run_dir: str, marks: str, steps: int,
                                          batch: int, pause_s: float = 0.2, wait_s: float = 60.0,
                                          **rollout_args: Any) -> float:
    """``three_slow_turns`` that makes a policy version land inside sessions for certain, with two agent
    workers playing micro-batches of half a step (``batch`` samples a step, ``steps`` steps):

    - a session of the second half of step s < steps - 1 holds its last turn until a session of step
      s + 1 has had its first reply (a file in ``marks``), so step s is trained only after that;
    - a session of step s >= 1 holds its second turn until step s - 1's row is in the run's
      ``metrics.jsonl``, which the trainer writes after it has published version s.

    So in every step s >= 1 at least the session whose first reply made the mark has that reply on a
    version older than s and its second on version s, however fast the train step is (without the
    holds, whether any version landed inside a session was a race between the agent's next claim and
    the train step). Each hold is bounded by ``wait_s``. Each session appends its step and the
    ``streamrl.policy_version`` of each reply to ``marks``/sessions.jsonl."""
    step, slot = int(sample["step"]), int(sample["sample_key"]) % batch
    metrics, marked = Path(run_dir) / "metrics.jsonl", Path(marks)
    messages: list[dict[str, Any]] = [{"role": "user", "content": sample["prompt"]}]
    content, versions = "", []
    for turn in range(3):
        if turn == 1 and step >= 1:
            await _wait_for(lambda: _rows(metrics) >= step, wait_s)
        if turn == 2 and slot >= batch // 2 and step < steps - 1:
            await _wait_for(lambda: (marked / f"first-reply-{step + 1}").exists(), wait_s)
        if turn:
            await asyncio.sleep(pause_s)
        reply = await client.chat.completions.create(model=sample["model"], messages=messages, max_tokens=2)
        if turn == 0:
            (marked / f"first-reply-{step}").touch()
        versions.append(reply.choices[0].model_extra["streamrl"]["policy_version"])
        content = reply.choices[0].message.content or ""
        messages += [{"role": "assistant", "content": content}, {"role": "user", "content": "?"}]
    with open(marked / "sessions.jsonl", "a") as log:  # one short line per write: appends do not interleave
        log.write(json.dumps({"step": step, "versions": versions}) + "\n")
    return 1.0 if content == sample["answer"] else 0.0


async def _wait_for(condition: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)


def _rows(metrics: Path) -> int:
    """Training steps recorded in a run's metrics.jsonl (evaluation rows carry no reward_mean)."""
    return metrics.read_text().count('"reward_mean"') if metrics.exists() else 0


class EchoEnv:
    """A gym-style environment: asks the prompt, then asks again; 0.5 per reply that is the answer."""

    def reset(self, sample: dict[str, Any]) -> str:
        self.answer, self.turn = sample["answer"], 0
        return str(sample["prompt"])

    def step(self, reply: str) -> tuple[str | None, float, bool]:
        self.turn += 1
        return "?", 0.5 * (reply == self.answer), self.turn == 2
