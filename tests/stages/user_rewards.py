"""A user's reward function for the score stage's ``options.reward`` (``module:function``)."""

from __future__ import annotations


def closeness(response: str, answer: str) -> float:
    """1 - |first digit - answer| / 9; 0 when the response does not start with a digit."""
    if not response[:1].isdigit():
        return 0.0
    return 1.0 - abs(int(response[0]) - int(answer)) / 9.0
