"""Rewards by name, and weighted combinations of them (``task.options.reward`` of a run config).

``reward: math`` names one; ``reward: {math: 1.0, format: 0.1}`` combines several: the result is
a map of named scores, each component under its name plus ``reward``, their weighted sum. The
score stage trains on ``reward`` and reports each component's batch mean (``score/<name>_mean``),
so a run shows what its reward is made of.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

#: Names a reward spec may use, and where the function lives (imported on first use: math-verify
#: brings sympy, which a run that does not use it should not pay for).
NAMED_REWARDS: dict[str, str] = {
    "math": "streamrl.rewards.math:math_reward",
    "format": "streamrl.rewards.math:format_reward",
}


class RewardSpecError(ValueError):
    """A reward spec is not usable; the message names it and what to write."""


class WeightedReward:
    """``sum(weight x component)`` as ``reward``, with every component's score beside it."""

    def __init__(self, parts: Mapping[str, tuple[Callable[..., Any], float]]) -> None:
        if not parts:
            raise RewardSpecError("a weighted reward needs at least one {name: weight} entry")
        if "reward" in parts:
            raise RewardSpecError("a component may not be named 'reward': that name is the weighted sum")
        self.parts = dict(parts)

    def __call__(self, prompt: str, response: str, response_ids: Sequence[int], answer: str,
                 **metadata: Any) -> dict[str, float]:
        scores: dict[str, float] = {}
        for name, (fn, _) in self.parts.items():
            value = fn(prompt, response, response_ids, answer, **metadata)
            if isinstance(value, dict):
                raise RewardSpecError(f"reward component {name!r} returned a map of named scores {sorted(value)}; "
                                      "a component of a weighted reward must return one number")
            scores[name] = float(value)
        scores["reward"] = sum(weight * scores[name] for name, (_, weight) in self.parts.items())
        return scores


def check_weights(spec: Mapping[Any, Any]) -> dict[str, float]:
    """``{name: weight}`` with string names and finite numeric weights, else RewardSpecError."""
    if not spec:
        raise RewardSpecError("the mapping is empty; give {name: weight, ...}, e.g. {math: 1.0, format: 0.1}")
    out = {}
    for name, weight in spec.items():
        if not isinstance(name, str) or not name:
            raise RewardSpecError(f"{name!r} is not a reward name; use a named reward or 'module:function'")
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight):
            raise RewardSpecError(f"the weight of {name!r} must be a finite number, got {weight!r}")
        out[name] = float(weight)
    return out
