"""RewardClient against real server processes: balancing, timeouts, bad replies and their policies."""

from __future__ import annotations

import anyio
import pytest

from streamrl.rewards import (
    InProcessRewardBackend,
    RewardClient,
    RewardConfigError,
    RewardError,
    RewardReplyError,
    RewardRetriesExhaustedError,
    RewardSample,
    RewardSampleError,
    RewardServersUnavailableError,
)
from tests.rewards.conftest import MISBEHAVING_SERVER, Servers

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]
FUNCTIONS = "tests.rewards.reward_test_functions"


def make_samples(n: int, start: int = 0) -> list[RewardSample]:
    return [RewardSample(id=i, prompt="p", response="x" * (i % 7)) for i in range(start, start + n)]


async def test_scores_match_the_inprocess_backend(servers: Servers) -> None:
    server = servers.reward_server(f"{FUNCTIONS}:length")
    batch = [
        *make_samples(5),
        RewardSample(id=99, response="boom", response_ids=[1, 2], metadata={"k": [1, "a"]}),
    ]
    async with RewardClient([server.endpoint], on_sample_error="keep") as client:
        remote = await client.score(batch)
        assert await client.score([]) == []
    async with InProcessRewardBackend(f"{FUNCTIONS}:length", on_sample_error="keep") as backend:
        local = await backend.score(batch)
    assert [(r.sample_id, r.score, r.error) for r in remote] == [
        (r.sample_id, r.score, r.error) for r in local
    ]
    assert remote[-1].error == "ValueError: boom requested" and remote[0].source == server.endpoint


async def test_sample_errors_fail_by_default_naming_server_and_sample(servers: Servers) -> None:
    server = servers.reward_server(f"{FUNCTIONS}:length")
    async with RewardClient([server.endpoint]) as client:
        with pytest.raises(RewardSampleError, match=rf"sample 2 on {server.endpoint}: ValueError: boom"):
            await client.score([RewardSample(id=1, response="ok"), RewardSample(id=2, response="boom")])
        # The server is still there for the next batch.
        assert [r.score for r in await client.score(make_samples(3))] == [0.0, 1.0, 2.0]


async def test_async_and_batched_functions_are_served(servers: Servers) -> None:
    plain = servers.reward_server(f"{FUNCTIONS}:async_length")
    batched = servers.reward_server(f"{FUNCTIONS}:async_batched_length")
    flagged = [RewardSample(id=0, response="abc"), RewardSample(id=1, response="de", metadata={"flag": True})]
    async with RewardClient([plain.endpoint], on_sample_error="keep") as client:
        assert [r.score for r in await client.score(flagged)] == [3.0, 2.0]
    async with RewardClient([batched.endpoint], on_sample_error="keep") as client:
        results = await client.score(flagged)
        assert results[0].score == 3.0 and results[1].error == "ValueError: flagged"


async def test_load_is_spread_and_in_flight_is_bounded(servers: Servers) -> None:
    endpoints = [servers.reward_server(f"{FUNCTIONS}:paced_length").endpoint for _ in range(2)]
    peak = 0
    async with RewardClient(endpoints, max_in_flight_per_server=2, max_batch_size=4) as client:
        await client.wait_servers_up(timeout_s=10)
        done = anyio.Event()

        async def watch() -> None:
            nonlocal peak
            while not done.is_set():
                peak = max(peak, *(s.outstanding for s in client.statistics().servers))
                await anyio.sleep(0.002)

        async with anyio.create_task_group() as group:
            group.start_soon(watch)
            with anyio.fail_after(30):
                results = await client.score(make_samples(120))
            done.set()
        stats = client.statistics()
    assert [r.score for r in results] == [float(i % 7) for i in range(120)]
    assert peak == 2  # saturated, never above the bound
    per_server = [s.replies for s in stats.servers]
    assert sum(per_server) == 30 and min(per_server) >= 10, per_server
    assert stats.retries == 0 and stats.batches == 30 and stats.samples == 120
    assert all(s.latency_p50_ms is not None and s.latency_p99_ms >= s.latency_p50_ms for s in stats.servers)


async def test_a_slow_server_times_out_and_the_batch_goes_to_another(servers: Servers) -> None:
    slow = servers.reward_server(f"{FUNCTIONS}:very_slow_length")
    fast = servers.reward_server(f"{FUNCTIONS}:length")
    async with RewardClient([slow.endpoint, fast.endpoint], timeout_s=0.3) as client:
        await client.wait_servers_up(timeout_s=10)
        results = []
        for start in range(0, 12, 3):
            with anyio.fail_after(10):
                results += await client.score(make_samples(3, start))
        assert [r.score for r in results] == [float(i % 7) for i in range(12)]
        assert {r.source for r in results} == {fast.endpoint}
        stats = client.statistics()
        slow_stats = next(s for s in stats.servers if s.endpoint == slow.endpoint)
        assert slow_stats.timeouts >= 1 and stats.retries >= 1 and stats.timeouts == slow_stats.timeouts
        # The slow server's answer still comes, and is dropped: its batch was answered elsewhere.
        with anyio.fail_after(5):
            while client.statistics().late_replies < 1:
                await anyio.sleep(0.05)
        assert all(r.attempts >= 1 for r in results)


async def test_a_lone_slow_server_exhausts_the_attempts(servers: Servers) -> None:
    slow = servers.reward_server(f"{FUNCTIONS}:very_slow_length")
    async with RewardClient([slow.endpoint], timeout_s=0.3, max_attempts=2) as client:
        with anyio.fail_after(10), pytest.raises(RewardRetriesExhaustedError) as caught:
            await client.score(make_samples(2))
        assert caught.value.sample_ids == [0, 1]
        assert str(caught.value).count(f"{slow.endpoint}: no reply within timeout_s=0.3") == 2
        assert client.statistics().timeouts == 2


@pytest.mark.parametrize(
    ("mode", "reason"),
    [
        ("garbage", "undecodable reply"),
        ("wrong_count", "2 results for 3 samples"),
        (
            "wrong_type",
            "malformed reply: Expected `float | object | null`, got `str` - at `$.results[0].score`",
        ),
    ],
)
async def test_bad_replies_fail_by_default_naming_server_and_samples(
    servers: Servers, mode: str, reason: str
) -> None:
    bad = servers.script(MISBEHAVING_SERVER, mode, "--bind", "tcp://127.0.0.1:0")
    async with RewardClient([bad.endpoint]) as client:
        with anyio.fail_after(10), pytest.raises(RewardReplyError) as caught:
            await client.score(make_samples(3, start=40))
    error = caught.value
    assert error.server == bad.endpoint and error.sample_ids == [40, 41, 42]
    assert reason in str(error) and bad.endpoint in str(error) and "[40, 41, 42]" in str(error)
    assert "on_bad_reply" in str(error)  # says what to do


async def test_bad_replies_can_score_a_default(servers: Servers) -> None:
    bad = servers.script(MISBEHAVING_SERVER, "wrong_count", "--bind", "tcp://127.0.0.1:0")
    async with RewardClient([bad.endpoint], on_bad_reply="default", default_score={"r": -1.0}) as client:
        results = await client.score(make_samples(2))
        assert [(r.score, r.source) for r in results] == [({"r": -1.0}, "default")] * 2
        stats = client.statistics()
        assert stats.bad_replies == 1 and stats.defaulted_samples == 2


async def test_bad_replies_can_be_retried_on_another_server(servers: Servers) -> None:
    bad = servers.script(MISBEHAVING_SERVER, "garbage", "--bind", "tcp://127.0.0.1:0")
    good = servers.reward_server(f"{FUNCTIONS}:length")
    async with RewardClient([bad.endpoint, good.endpoint], on_bad_reply="retry") as client:
        await client.wait_servers_up(timeout_s=10)
        results = []
        for start in range(0, 8, 2):
            results += await client.score(make_samples(2, start))
        assert {r.source for r in results} == {good.endpoint}
        assert [r.score for r in results] == [float(i % 7) for i in range(8)]
        stats = client.statistics()
        assert stats.bad_replies >= 1 and stats.retries == stats.bad_replies


async def test_incompatible_server_is_reported(servers: Servers) -> None:
    bad = servers.script(MISBEHAVING_SERVER, "bad_version", "--bind", "tcp://127.0.0.1:0")
    async with RewardClient([bad.endpoint]) as client:
        with anyio.fail_after(10), pytest.raises(RewardServersUnavailableError, match="I only speak 7"):
            await client.score(make_samples(1))
        assert client.statistics().servers[0].state == "incompatible"


async def test_no_reachable_server_is_an_error_after_no_server_timeout(tmp_path: object) -> None:
    endpoint = "tcp://127.0.0.1:9"  # discard port: nothing listens there
    async with RewardClient([endpoint], no_server_timeout_s=0.5) as client:
        with (
            anyio.fail_after(10),
            pytest.raises(RewardServersUnavailableError, match=r"127\.0\.0\.1:9 is connecting"),
        ):
            await client.score(make_samples(1))


async def test_misuse_and_bad_config_are_clear() -> None:
    with pytest.raises(RewardConfigError, match="at least one"):
        RewardClient([])
    with pytest.raises(RewardConfigError, match="must look like tcp://"):
        RewardClient(["localhost:5555"])
    with pytest.raises(RewardConfigError, match=r"heartbeat_timeout_s=1\.0 must exceed"):
        RewardClient(["tcp://127.0.0.1:5555"], heartbeat_interval_s=1.0, heartbeat_timeout_s=1.0)
    with pytest.raises(RewardConfigError, match="on_bad_reply='ignore'"):
        RewardClient(["tcp://127.0.0.1:5555"], on_bad_reply="ignore")  # type: ignore[arg-type]
    with pytest.raises(RewardError, match="not running"):
        await RewardClient(["tcp://127.0.0.1:5555"]).score(make_samples(1))
