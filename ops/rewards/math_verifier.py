"""Example reward functions for `streamrl reward-server` (this directory on PYTHONPATH, or cd here).

    streamrl reward-server math_verifier:math_answer --bind tcp://127.0.0.1:5555 --workers 4
    streamrl reward-server math_verifier:format_and_length --bind tcp://127.0.0.1:5556

``math_answer`` is per-sample: called as ``f(prompt=..., response=..., **metadata)`` with only the
arguments its signature names; it is streamrl's math-verify reward (``streamrl.rewards.math``) as
a server would host it. ``format_and_length`` is batched (lists in, list out) and returns named
scores, which arrive in the dock as a dict.
"""

from __future__ import annotations

from streamrl.rewards import batched
from streamrl.rewards.math import format_reward, math_reward


def math_answer(response: str, answer: str | int | float) -> float:
    """1.0 if the response's final answer equals ``answer`` mathematically (math-verify)."""
    return math_reward(response=response, answer=str(answer))


@batched
def format_and_length(responses: list[str], metadata: list[dict]) -> list[dict[str, float]]:
    """Named scores per sample: whether it gave a checkable answer, and its length against a budget."""
    scores = []
    for response, meta in zip(responses, metadata, strict=True):
        budget = float(meta.get("length_budget", 512))
        scores.append({"format": format_reward(response=response or ""), "length_ratio": len(response or "") / budget})
    return scores
