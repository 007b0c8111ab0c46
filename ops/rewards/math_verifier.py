"""Example reward functions for `streamrl reward-server` (this directory on PYTHONPATH, or cd here).

    streamrl reward-server math_verifier:boxed_match --bind tcp://127.0.0.1:5555 --workers 4
    streamrl reward-server math_verifier:format_and_length --bind tcp://127.0.0.1:5556

``boxed_match`` is per-sample: called as ``f(prompt=..., response=..., **metadata)`` with only the
arguments its signature names. ``format_and_length`` is batched (lists in, list out) and returns
named scores, which arrive in the dock as a dict.
"""

from __future__ import annotations

import re

from streamrl.rewards import batched

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _normalise(text: str) -> str:
    text = text.strip().replace(",", "").rstrip(".")
    try:
        return repr(float(text))
    except ValueError:
        return text


def boxed_match(response: str, answer: str | int | float) -> float:
    """1.0 if the last \\boxed{...} (or else the last number) in the response equals ``answer``."""
    found = _BOXED.findall(response) or _NUMBER.findall(response)
    if not found:
        return 0.0
    return 1.0 if _normalise(found[-1]) == _normalise(str(answer)) else 0.0


@batched
def format_and_length(responses: list[str], metadata: list[dict]) -> list[dict[str, float]]:
    """Named scores per sample: whether it used \\boxed{}, and its length relative to a budget."""
    scores = []
    for response, meta in zip(responses, metadata, strict=True):
        budget = float(meta.get("length_budget", 512))
        scores.append(
            {
                "boxed": 1.0 if _BOXED.search(response or "") else 0.0,
                "length_ratio": len(response or "") / budget,
            }
        )
    return scores
