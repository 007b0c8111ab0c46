"""Reward functions the tests serve (imported by server processes as ``reward_test_functions:NAME``)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import anyio

from streamrl.rewards import batched


def length(prompt: str | None, response: str, **metadata: object) -> float:
    """len(response); raises for the response "boom" so one sample of a batch can fail."""
    if response == "boom":
        raise ValueError("boom requested")
    return float(len(response))


def named(response: str) -> dict[str, float]:
    return {"length": float(len(response)), "vowels": float(sum(c in "aeiou" for c in response))}


def with_answer(response: str, answer: str) -> float:
    """Takes a metadata key as a named parameter; other metadata keys are not forced on it."""
    return 1.0 if response == answer else 0.0


def not_a_score(response: str) -> str:
    return "high"


async def async_length(response: str) -> float:
    await anyio.sleep(0.001)
    return float(len(response))


@batched
def paced_length(responses: list[str]) -> list[float]:
    """10 ms per batch: long enough that a killed server has requests in flight."""
    time.sleep(0.01)
    return [float(len(r)) for r in responses]


@batched
def half_second_length(responses: list[str]) -> list[float]:
    time.sleep(0.5)
    return [float(len(r)) for r in responses]


@batched
def half_second_length_announced(responses: list[str]) -> list[float]:
    """half_second_length that first touches the file named by $STREAMRL_TEST_BATCH_STARTED, so a
    test knows the server has taken a batch (not merely that the client sent one)."""
    marker = os.environ.get("STREAMRL_TEST_BATCH_STARTED")
    if marker:
        Path(marker).touch()
    time.sleep(0.5)
    return [float(len(r)) for r in responses]


@batched
def very_slow_length(responses: list[str]) -> list[float]:
    """Sleeps past every timeout the tests use; offset so its scores are recognisable."""
    time.sleep(1.5)
    return [1000.0 + len(r) for r in responses]


@batched
def short_batch(responses: list[str]) -> list[float]:
    return [0.0]


@batched
async def async_batched_length(responses: list[str], metadata: list[dict]) -> list[float | Exception]:
    await anyio.sleep(0.001)
    return [
        ValueError("flagged") if m.get("flag") else float(len(r))
        for r, m in zip(responses, metadata, strict=True)
    ]


def exact_named(response: str, answer: str) -> dict[str, float]:
    """Named scores for the score stage's tests: whether the response is the answer, and whether
    the tokenizer's EOS marker leaked into the response text (it must not)."""
    return {"exact": 1.0 if response == answer else 0.0, "eos_in_text": float("<eos>" in response)}
