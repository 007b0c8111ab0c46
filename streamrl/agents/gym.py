"""The third way to write an agent: a gym-style environment that streamrl drives itself.

``options.rollout: streamrl.agents.gym:run_env`` with ``rollout_args: {env: module:Class}``. For
each sample the stage builds ``Class()`` and plays::

    class Env:
        def reset(self, sample: dict) -> str | list[dict]: ...       # the first message(s)
        def step(self, reply: str) -> tuple[str | None, float, bool]: ...  # observation, reward, done

``reset`` gives the opening user message (a string) or the opening messages (system prompt
included); each policy reply (its text) goes to ``step``, whose observation becomes the next user
message. The sample's reward is the sum of the step rewards. The episode ends when ``step`` says
done, or after ``max_turns`` replies. Either method may be a coroutine function.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from streamrl.runtime.pipeline import import_object


class EnvError(RuntimeError):
    """An environment returned something the loop cannot use."""


@functools.lru_cache(maxsize=16)
def _env_class(spec: str) -> Any:
    return import_object(spec, "rollout_args.env", form="module:Class", must_call=True)


async def _call(fn: Any, *args: Any) -> Any:
    out = fn(*args)
    return await out if inspect.isawaitable(out) else out


async def run_env(client: Any, sample: dict[str, Any], env: str, max_turns: int = 8, max_tokens: int = 256,
                  temperature: float = 1.0) -> float:
    """One episode of ``env`` (``module:Class``) against the policy behind ``client``."""
    game = _env_class(env)()
    first = await _call(game.reset, sample)
    messages: list[dict[str, Any]] = [{"role": "user", "content": first}] if isinstance(first, str) else list(first)
    total = 0.0
    for _ in range(max_turns):
        reply = await client.chat.completions.create(model=sample["model"], messages=messages, max_tokens=max_tokens,
                                                     temperature=temperature)
        text = reply.choices[0].message.content or ""
        result = await _call(game.step, text)
        if not (isinstance(result, tuple) and len(result) == 3):
            raise EnvError(f"{env}.step must return (observation, reward, done), got {result!r}")
        observation, reward, done = result
        total += float(reward)
        if done:
            break
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": str(observation or "")}]
    return total
