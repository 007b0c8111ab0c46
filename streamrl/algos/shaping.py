"""Reward shaping applied where rewards are made (the score stage), as pure functions."""

from __future__ import annotations


def overlong_penalty(length: int, max_tokens: int, buffer: int, penalty: float = 1.0) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025) of a response of ``length`` tokens.

    0 up to ``max_tokens - buffer`` tokens; then falling linearly to ``-penalty`` at ``max_tokens``
    (a response cut at the cap): ``penalty * ((max_tokens - buffer) - length) / buffer``. Added
    to the reward, it tells a policy that runs into the length cap apart from one that answers
    within it, without the noise of punishing every truncated answer alike. ``buffer`` 0: none.
    """
    if buffer <= 0:
        return 0.0
    if not 0 < buffer <= max_tokens:
        raise ValueError(f"overlong buffer must be in [1, max_tokens={max_tokens}], got {buffer}")
    free = max_tokens - buffer
    if length <= free:
        return 0.0
    return -penalty * min(length - free, buffer) / buffer
