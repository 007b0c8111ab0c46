"""The reward-function adapter and the in-process backend (no sockets)."""

from __future__ import annotations

import threading

import anyio
import pytest

from streamrl.rewards import (
    InProcessRewardBackend,
    RewardConfigError,
    RewardFunction,
    RewardFunctionLoadError,
    RewardResult,
    RewardSample,
    RewardSampleError,
    batched,
    load_reward_function,
)

pytestmark = pytest.mark.anyio


def sample(i: int, response: str, **metadata: object) -> RewardSample:
    return RewardSample(id=i, prompt="q", response=response, metadata=dict(metadata))


async def test_per_sample_function_gets_only_the_arguments_it_names() -> None:
    seen: list[dict[str, object]] = []

    def reward(response: str, answer: str) -> float:
        seen.append({"response": response, "answer": answer})
        return float(response == answer)

    fn = RewardFunction(reward)
    results = await fn.score([sample(0, "4", answer="4", unused=1), sample(1, "5", answer="4")])
    assert [r.score for r in results] == [1.0, 0.0]
    assert seen[0] == {"response": "4", "answer": "4"}


async def test_var_keyword_function_also_receives_token_ids() -> None:
    def reward(prompt: str, response: str, **metadata: object) -> float:
        assert metadata["response_ids"] == [5, 6, 7] and metadata["tag"] == "x"
        return float(len(metadata["response_ids"]))  # type: ignore[arg-type]

    fn = RewardFunction(reward)
    [result] = await fn.score(
        [RewardSample(id=3, prompt="p", response="r", response_ids=[5, 6, 7], metadata={"tag": "x"})]
    )
    assert result.score == 3.0 and result.error is None


async def test_one_raising_sample_fails_alone() -> None:
    def reward(response: str) -> float:
        if response == "bad":
            raise ZeroDivisionError("cannot score this")
        return 1.0

    results = await RewardFunction(reward).score([sample(0, "ok"), sample(1, "bad"), sample(2, "ok")])
    assert [r.score for r in results] == [1.0, None, 1.0]
    assert results[1].error == "ZeroDivisionError: cannot score this"


async def test_invalid_return_values_become_sample_errors() -> None:
    values = iter(["high", float("nan"), {"a": 1}, True])
    fn = RewardFunction(lambda response: next(values))
    results = await fn.score([sample(i, "x") for i in range(4)])
    assert [r.score for r in results] == [None, None, {"a": 1.0}, None]
    assert "str" in (results[0].error or "") and "not finite" in (results[1].error or "")


async def test_metadata_clashing_with_sample_fields_is_a_sample_error() -> None:
    [result] = await RewardFunction(lambda response: 1.0).score(
        [RewardSample(id=0, response="x", metadata={"response": "other"})]
    )
    assert result.error is not None and "clash" in result.error


async def test_batched_sync_and_async_functions() -> None:
    @batched
    def lengths(responses: list[str], metadata: list[dict]) -> list[float | Exception]:
        return [
            ValueError("flagged") if m.get("flag") else float(len(r))
            for r, m in zip(responses, metadata, strict=True)
        ]

    @batched
    async def async_lengths(responses: list[str]) -> list[float]:
        await anyio.sleep(0)
        return [float(len(r)) for r in responses]

    batch = [sample(0, "ab"), sample(1, "abc", flag=True)]
    results = await RewardFunction(lengths).score(batch)
    assert results[0].score == 2.0 and results[1].error == "ValueError: flagged"
    assert [r.score for r in await RewardFunction(async_lengths).score(batch)] == [2.0, 3.0]


async def test_batched_function_returning_the_wrong_count_fails_every_sample() -> None:
    fn = RewardFunction(batched(lambda responses: [1.0]))
    results = await fn.score([sample(0, "a"), sample(1, "b")])
    assert all(r.error == "batched reward function returned 1 scores for 2 samples" for r in results)


class ConcurrencyProbe:
    """An async reward that records how many calls ran at once."""

    def __init__(self) -> None:
        self.running = 0
        self.peak = 0

    async def __call__(self, response: str) -> float:
        self.running += 1
        self.peak = max(self.peak, self.running)
        await anyio.sleep(0.01)
        self.running -= 1
        return 1.0


async def test_async_per_sample_function_scores_a_batch_concurrently() -> None:
    probe = ConcurrencyProbe()
    fn = RewardFunction(probe)
    assert fn.is_async
    results = await fn.score([sample(i, "x") for i in range(5)])
    assert [r.score for r in results] == [1.0] * 5 and probe.peak == 5


async def test_sync_functions_run_off_the_event_loop_thread() -> None:
    threads: list[int] = []
    fn = RewardFunction(lambda response: threads.append(threading.get_ident()) or 1.0)
    await fn.score([sample(0, "x")])
    assert threads and threads[0] != threading.get_ident()


def test_load_reward_function_errors_are_actionable() -> None:
    assert load_reward_function("tests.rewards.reward_test_functions:length").__name__ == "length"
    with pytest.raises(RewardFunctionLoadError, match="module:function"):
        load_reward_function("no_colon")
    with pytest.raises(RewardFunctionLoadError, match="cannot import module 'no_such_module_x'"):
        load_reward_function("no_such_module_x:f")
    with pytest.raises(RewardFunctionLoadError, match="no attribute 'missing'"):
        load_reward_function("tests.rewards.reward_test_functions:missing")
    with pytest.raises(RewardFunctionLoadError, match="not callable"):
        load_reward_function("tests.rewards.reward_test_functions:__name__")


async def test_inprocess_backend_policies_and_statistics() -> None:
    batch = [sample(0, "ok"), sample(1, "boom"), sample(2, "okay")]
    async with InProcessRewardBackend("tests.rewards.reward_test_functions:length") as backend:
        with pytest.raises(RewardSampleError, match=r"sample 1 on inprocess: ValueError: boom requested"):
            await backend.score(batch)
    async with InProcessRewardBackend(
        "tests.rewards.reward_test_functions:length", on_sample_error="default", default_score=-1
    ) as b:
        results = await b.score(batch)
        assert [r.score for r in results] == [2.0, -1.0, 4.0]
        assert results[1] == RewardResult(
            sample_id=1, score=-1.0, error="ValueError: boom requested", source="inprocess"
        )
        stats = b.statistics()
        assert (stats.batches, stats.samples, stats.sample_errors, stats.defaulted_samples) == (1, 3, 1, 1)
        assert stats.latency_p50_ms is not None
    async with InProcessRewardBackend(
        "tests.rewards.reward_test_functions:length", on_sample_error="keep"
    ) as b:
        assert (await b.score(batch))[1].score is None


async def test_inprocess_backend_bounds_concurrency() -> None:
    probe = ConcurrencyProbe()
    backend = InProcessRewardBackend(probe, max_concurrency=2)
    async with anyio.create_task_group() as group:
        for i in range(6):
            group.start_soon(backend.score, [sample(i, "x")])
    assert probe.peak == 2


def test_config_errors_name_the_bad_value() -> None:
    with pytest.raises(RewardConfigError, match="on_sample_error='ignore'"):
        InProcessRewardBackend(lambda response: 1.0, on_sample_error="ignore")  # type: ignore[arg-type]
    with pytest.raises(RewardConfigError, match="default_score=nan"):
        InProcessRewardBackend(lambda response: 1.0, default_score=float("nan"))
    with pytest.raises(RewardConfigError, match="max_concurrency=0"):
        InProcessRewardBackend(lambda response: 1.0, max_concurrency=0)
