"""What a task is: prompts to ask and a rule to score the answers.

A reward function has one signature everywhere (in-process ``score`` stage, external reward
server): ``reward(prompt, response, response_ids, answer, **metadata) -> float``. ``prompt`` and
``response`` are text, ``response_ids`` the sampled token ids (EOS included when emitted),
``answer`` the reference answer from the prompt row, ``metadata`` the row's other fields.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import msgspec

# Names a metadata field may not take: they are the reward function's own parameters.
RESERVED_FIELDS = frozenset({"prompt", "response", "response_ids", "answer"})


class TaskOptionError(TypeError, ValueError):
    """A task option is unknown or has the wrong value (``task.options`` of a run config). Both a
    TypeError (what ``get_task`` raised for unknown options) and a ValueError (for bad values)."""


def int_option(task: str, name: str, value: object, minimum: int) -> int:
    """``value`` as an int option of ``task``, refused with the option's name when it is not an int
    (YAML ``"3"`` or ``3.0``, or a bool) or below ``minimum``."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TaskOptionError(f"task {task!r}: option {name} must be an int >= {minimum}, got "
                              f"{type(value).__name__} {value!r}; write e.g. {name}: {max(minimum, 3)}")
    if value < minimum:
        raise TaskOptionError(f"task {task!r}: option {name} must be >= {minimum}, got {value}")
    return value


class Prompt(msgspec.Struct, frozen=True):
    """One prompt row: the text the policy sees, the reference answer, any extra fields.

    ``messages``: a chat prompt (``[{"role": ..., "content": ...}, ...]``), rendered through the
    tokenizer's chat template (``task.chat_template``); ``text`` is then its last user message,
    what rewards see as the prompt."""

    text: str
    answer: str
    metadata: dict[str, Any] = msgspec.field(default_factory=dict)
    messages: list[dict[str, str]] | None = None


class RewardFn(Protocol):
    def __call__(
        self, prompt: str, response: str, response_ids: Sequence[int], answer: str, **metadata: Any
    ) -> float: ...


@runtime_checkable
class Task(Protocol):
    """A source of prompts plus the rule that scores completions of them."""

    name: str

    def make_prompts(self, rng: random.Random | int, n: int) -> list[Prompt]:
        """``n`` prompts; an int seeds a fresh ``random.Random``, a Random continues its stream."""
        ...

    def reward(
        self, prompt: str, response: str, response_ids: Sequence[int], answer: str, **metadata: Any
    ) -> float: ...

    def reward_batch(
        self,
        prompts: Sequence[str],
        responses: Sequence[str],
        response_ids: Sequence[Sequence[int]],
        answers: Sequence[str],
        metadata: Sequence[dict[str, Any]] | None = None,
    ) -> list[float]: ...


def as_rng(rng: random.Random | int) -> random.Random:
    if isinstance(rng, random.Random):
        return rng
    if isinstance(rng, int) and not isinstance(rng, bool):
        return random.Random(rng)
    raise TypeError(f"rng must be a random.Random or an int seed, got {type(rng).__name__}")


class BatchRewardMixin:
    """``reward_batch`` for a task class that defines the per-sample ``reward``."""

    def reward_batch(
        self,
        prompts: Sequence[str],
        responses: Sequence[str],
        response_ids: Sequence[Sequence[int]],
        answers: Sequence[str],
        metadata: Sequence[dict[str, Any]] | None = None,
    ) -> list[float]:
        return batch_reward(self.reward, prompts, responses, response_ids, answers, metadata)  # type: ignore[attr-defined]


def batch_reward(
    fn: RewardFn,
    prompts: Sequence[str],
    responses: Sequence[str],
    response_ids: Sequence[Sequence[int]],
    answers: Sequence[str],
    metadata: Sequence[dict[str, Any]] | None = None,
) -> list[float | dict[str, float]]:
    """Apply a per-sample reward function to equal-length columns (a map of named scores stays one)."""
    n = len(prompts)
    lengths = {"responses": len(responses), "response_ids": len(response_ids), "answers": len(answers)}
    if metadata is not None:
        lengths["metadata"] = len(metadata)
    for name, size in lengths.items():
        if size != n:
            raise ValueError(f"reward batch: {name} has {size} entries, prompts has {n}")
    meta = metadata if metadata is not None else [{}] * n
    out: list[float | dict[str, float]] = []
    for i in range(n):
        value = fn(prompts[i], responses[i], list(response_ids[i]), answers[i], **meta[i])
        out.append(value if isinstance(value, dict) else float(value))  # named scores stay a map
    return out
