"""Reward functions that ship with streamrl, for ``streamrl reward-server`` (no task needed).

``exact_match`` is also the reference function of the conformance suite
(ops/conformance/reward_server.py): a server under test that hosts the same rule gets its scores
checked value by value, not only their shape. ``ops/rewards/minimal_server.py`` implements it too.

    streamrl reward-server streamrl.rewards.builtin:exact_match --bind tcp://127.0.0.1:5555
"""

from __future__ import annotations


def exact_match(response: str | None, answer: object) -> float:
    """1.0 if the response text equals ``metadata["answer"]`` (both stripped, the answer as text:
    ``4`` matches ``"4"``), else 0.0. A sample without response text, or without an answer, fails
    (a per-sample error): there is nothing to compare, and 0.0 would hide the missing field."""
    if response is None:
        raise ValueError("sample has no response text")
    return 1.0 if response.strip() == str(answer).strip() else 0.0
