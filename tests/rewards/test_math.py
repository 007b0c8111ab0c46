"""The math-verify reward against hand-checked cases, the format reward, weighted combinations of
named rewards, and the rewards called the way the score stage calls them (from worker threads)."""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from streamrl.rewards.math import format_reward, gold_text, math_reward
from streamrl.rewards.named import WeightedReward
from streamrl.tasks.registry import TaskOptionError, load_reward_fn
from tests.rewards.conftest import Servers

# (gold answer, response, expected reward): each checked by hand
MATH_CASES = [
    # equivalent forms
    ("72", "The answer is \\boxed{72}.", 1.0),
    ("0.5", "So we get \\boxed{\\frac{1}{2}}", 1.0),
    ("\\frac{1}{2}", "\\boxed{0.5}", 1.0),
    ("1/2", "\\boxed{\\frac{1}{2}}", 1.0),
    ("1000", "\\boxed{1,000}", 1.0),
    ("1,000", "\\boxed{1000}", 1.0),
    ("2", "\\boxed{\\sqrt{4}}", 1.0),
    ("3", "\\boxed{3.0}", 1.0),
    ("5", "\\boxed{x = 5}", 1.0),  # an equation answers its right-hand side
    ("-7", "the result is \\boxed{-7}", 1.0),
    ("\\frac{\\sqrt{3}}{2}", "\\boxed{\\frac{\\sqrt{3}}{2}}", 1.0),
    ("\\pi", "\\boxed{\\pi}", 1.0),
    ("50\\%", "\\boxed{0.5}", 1.0),  # a LaTeX percentage is its fraction
    # GSM8K gold: reasoning ending in #### N
    ("She pays 6 * 12 = <<6*12=72>>72 dollars.\n#### 72", "6 times 12 is 72, so \\boxed{72}", 1.0),
    ("It is 1,250 in all.\n#### 1,250", "\\boxed{1250}", 1.0),
    ("#### 72", "Step 1 ... Step 2 ...\n#### 72", 1.0),
    # no box: a stated final answer, else the last number
    ("72", "I think 71. The final answer is 72", 1.0),
    ("72", "The answer is 72 apples.", 1.0),
    # wrong answers
    ("72", "\\boxed{71}", 0.0),
    ("0.5", "\\boxed{\\frac{1}{3}}", 0.0),
    ("10", "\\boxed{9} wait, no: 10", 0.0),  # the box wins over a later number
    ("50", "\\boxed{0.5}", 0.0),
    ("72", "no numbers at all", 0.0),
    # malformed or missing
    ("72", "\\boxed{\\frac{1}{", 0.0),
    ("72", "", 0.0),
    ("", "\\boxed{3}", 0.0),  # no gold answer: nothing can match
    ("72", "\\boxed{}", 0.0),
]


@pytest.mark.parametrize(("gold", "response", "expected"), MATH_CASES)
def test_math_reward_cases(gold: str, response: str, expected: float) -> None:
    assert math_reward("q", response, [], gold) == expected


def test_gold_text_of_gsm8k_answers() -> None:
    assert gold_text("a\nb = <<1+1=2>>2\n#### 2") == "2"
    assert gold_text("#### 1,234") == "1234"
    assert gold_text("\\frac{1}{2}") == "$\\frac{1}{2}$"


def test_a_long_response_is_read_from_its_end_in_bounded_time() -> None:
    response = "blah 7 " * 50_000 + "\\boxed{72}"
    t0 = time.perf_counter()
    assert math_reward("q", response, [], "72") == 1.0
    assert time.perf_counter() - t0 < 10


@pytest.mark.parametrize(
    ("response", "expected"),
    [("\\boxed{3}", 1.0), ("so\n#### 42", 1.0), ("#### -1,250", 1.0), ("\\boxed{}", 0.0), ("the answer is 3", 0.0),
     ("####", 0.0), ("", 0.0)],
)
def test_format_reward(response: str, expected: float) -> None:
    assert format_reward("q", response, [], "") == expected


def test_weighted_named_rewards_keep_their_parts() -> None:
    fn = load_reward_fn({"math": 1.0, "format": 0.1})
    assert isinstance(fn, WeightedReward)
    assert fn("q", "\\boxed{72}", [], "#### 72") == {"math": 1.0, "format": 1.0, "reward": pytest.approx(1.1)}
    assert fn("q", "it is 72", [], "#### 72") == {"math": 1.0, "format": 0.0, "reward": 1.0}
    own = load_reward_fn({"tests.rewards.test_math:shortness": 2.0, "math": 1.0})
    assert own("q", "12345", [], "2") == {"shortness": 0.2, "math": 0.0, "reward": pytest.approx(0.4)}


def shortness(prompt: str, response: str, response_ids: object, answer: str, **_: object) -> float:
    return 1.0 / len(response) if response else 0.0


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ({"maht": 1.0}, "unknown reward 'maht' (did you mean 'math'?)"),
        ({"math": "heavy"}, "the weight of 'math' must be a finite number, got 'heavy'"),
        ({"math": float("nan")}, "the weight of 'math' must be a finite number"),
        ({}, "the mapping is empty"),
        ({"math": 1.0, "tests.rewards.test_math:nope": 1.0}, "has no callable 'nope'"),
        (3, "reward must be a reward name"),
    ],
)
def test_bad_reward_specs_are_named(spec: object, needle: str) -> None:
    with pytest.raises(TaskOptionError, match=re.escape(needle)):
        load_reward_fn(spec)  # type: ignore[arg-type]


def test_rewards_work_from_worker_threads() -> None:
    """The score stage runs rewards in threads, where math-verify's signal alarm cannot work."""
    fn = load_reward_fn({"math": 1.0, "format": 0.5})
    cases = [("q", f"\\boxed{{{i}}}", [], f"#### {i}") for i in range(16)]
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda c: fn(*c), cases))
    assert all(r == {"math": 1.0, "format": 1.0, "reward": 1.5} for r in results)


@pytest.mark.anyio
async def test_the_math_reward_served_by_a_reward_server(servers: Servers) -> None:
    """The example server (ops/rewards/math_verifier.py) and the library function, hosted by
    `streamrl reward-server` in its worker threads, score like the function in process."""
    from streamrl.rewards import RewardClient, RewardSample

    library = servers.reward_server("streamrl.rewards.math:math_reward")
    example = servers.reward_server("ops.rewards.math_verifier:math_answer")
    cases = MATH_CASES[:12] + MATH_CASES[17:22]
    samples = [RewardSample(id=i, prompt="q", response=response, metadata={"answer": gold})
               for i, (gold, response, _) in enumerate(cases)]
    for server in (library, example):
        async with RewardClient([server.endpoint]) as client:
            scores = [r.score for r in await client.score(samples)]
        assert scores == [expected for _, _, expected in cases]
