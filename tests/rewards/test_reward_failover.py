"""Servers dying, freezing, restarting and draining under a stream of batches: no sample is lost
and none is scored twice."""

from __future__ import annotations

import signal
from pathlib import Path

import anyio
import pytest

from streamrl.rewards import RewardClient, RewardSample
from tests.rewards.conftest import Servers

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(90)]
PACED = "tests.rewards.reward_test_functions:paced_length"


class WriteOnceColumn:
    """Stands in for the dock's reward column: writing a sample twice is an error."""

    def __init__(self) -> None:
        self.values: dict[int, float] = {}

    def put(self, sample_id: int, value: float) -> None:
        assert sample_id not in self.values, f"sample {sample_id} scored twice"
        self.values[sample_id] = value


def batch(start: int, size: int) -> list[RewardSample]:
    return [RewardSample(id=i, prompt="p", response="y" * (i % 11)) for i in range(start, start + size)]


async def stream(
    client: RewardClient,
    column: WriteOnceColumn,
    n_batches: int,
    size: int,
    *,
    first_id: int = 0,
    streams: int = 4,
) -> None:
    """``streams`` concurrent producers, like several score-stage workers sharing one client."""

    async def producer(first: int) -> None:
        for b in range(first, n_batches, streams):
            for result in await client.score(batch(first_id + b * size, size)):
                assert isinstance(result.score, float)
                column.put(result.sample_id, result.score)

    async with anyio.create_task_group() as group:
        for first in range(streams):
            group.start_soon(producer, first)


async def wait_until(predicate: object, timeout_s: float, what: str) -> None:
    with anyio.fail_after(timeout_s):
        while not predicate():  # type: ignore[operator]
            await anyio.sleep(0.005)


async def test_sigkill_mid_run_loses_nothing_and_scores_each_sample_once(servers: Servers) -> None:
    victim = servers.reward_server(PACED, "--workers", "2")
    survivor = servers.reward_server(PACED, "--workers", "2")
    column = WriteOnceColumn()
    n_batches, size = 80, 16
    async with RewardClient(
        [victim.endpoint, survivor.endpoint], max_in_flight_per_server=2, max_batch_size=8, timeout_s=10
    ) as client:
        await client.wait_servers_up(timeout_s=10)

        async def kill_when_busy() -> None:
            # Kill once the victim has done some work and has requests in flight right now.
            def victim_busy() -> bool:
                stats = client.statistics().servers[0]
                return stats.replies >= 10 and stats.outstanding > 0

            await wait_until(victim_busy, 20, "victim busy")
            victim.signal(signal.SIGKILL)

        with anyio.fail_after(60):
            async with anyio.create_task_group() as group:
                group.start_soon(kill_when_busy)
                await stream(client, column, n_batches, size)
        stats = client.statistics()

    assert victim.wait() == -signal.SIGKILL
    assert sorted(column.values) == list(range(n_batches * size))
    assert all(value == float(i % 11) for i, value in column.values.items())
    victim_stats, survivor_stats = stats.servers
    assert victim_stats.lost >= 1 and victim_stats.disconnects == 1 and victim_stats.state == "connecting"
    assert stats.retries >= victim_stats.lost
    assert survivor_stats.samples + victim_stats.samples == n_batches * size
    assert stats.samples == n_batches * size


async def test_a_restarted_server_is_used_again(servers: Servers) -> None:
    first = servers.reward_server(PACED)
    other = servers.reward_server(PACED)
    column = WriteOnceColumn()
    async with RewardClient([first.endpoint, other.endpoint], heartbeat_interval_s=0.1) as client:
        await client.wait_servers_up(timeout_s=10)
        await stream(client, column, 8, 4)
        first.signal(signal.SIGKILL)
        first.wait()
        await wait_until(lambda: client.statistics().servers[0].state == "connecting", 5, "loss noticed")
        await stream(client, column, 8, 4, first_id=32)  # the other server carries on alone
        served_before = client.statistics().servers[0].replies
        restarted = servers.reward_server(PACED, bind=first.endpoint)
        await client.wait_servers_up(timeout_s=10)
        await stream(client, column, 16, 4, first_id=64)
        stats = client.statistics()
    assert restarted.endpoint == first.endpoint
    assert stats.servers[0].replies > served_before  # back in the rotation
    assert sorted(column.values) == list(range(128))


async def test_a_frozen_server_is_detected_by_heartbeat_and_recovers(servers: Servers) -> None:
    frozen = servers.reward_server(PACED)
    healthy = servers.reward_server(PACED)
    column = WriteOnceColumn()
    async with RewardClient(
        [frozen.endpoint, healthy.endpoint], heartbeat_interval_s=0.1, heartbeat_timeout_s=0.5, timeout_s=30
    ) as client:
        await client.wait_servers_up(timeout_s=10)
        frozen.signal(signal.SIGSTOP)  # TCP stays up: only the missing pongs tell
        try:
            with anyio.fail_after(20):
                await stream(client, column, 12, 4)
            assert len(column.values) == 48
            stats = client.statistics().servers[0]
            assert stats.state == "connecting" and "heartbeat_timeout_s=0.5" in (stats.last_error or "")
        finally:
            frozen.signal(signal.SIGCONT)
        await wait_until(lambda: client.statistics().servers[0].state == "up", 10, "frozen server back")


async def test_sigterm_drains_a_server_without_losing_its_batches(servers: Servers, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    started = tmp_path / "batch-started"
    monkeypatch.setenv("STREAMRL_TEST_BATCH_STARTED", str(started))  # inherited by the server process
    draining = servers.reward_server("tests.rewards.reward_test_functions:half_second_length_announced")
    monkeypatch.delenv("STREAMRL_TEST_BATCH_STARTED")
    other = servers.reward_server(PACED)
    column = WriteOnceColumn()
    async with RewardClient([draining.endpoint, other.endpoint], timeout_s=10) as client:
        await client.wait_servers_up(timeout_s=10)

        async def terminate_when_busy() -> None:
            # Not "the client has a request outstanding": a SIGTERM before the server has read it off
            # its socket loses the request (the client retries it elsewhere), so there would be no
            # accepted batch to drain. Wait until the server is computing one.
            await wait_until(started.exists, 10, "draining server took a batch")
            draining.signal(signal.SIGTERM)

        with anyio.fail_after(30):
            async with anyio.create_task_group() as group:
                group.start_soon(terminate_when_busy)
                await stream(client, column, 24, 4)
        stats = client.statistics()
    assert draining.wait() == 0
    assert sorted(column.values) == list(range(96))
    # The batch it had accepted was finished by the draining server itself (0.5 s), not lost.
    assert stats.servers[0].replies >= 1 and (stats.servers[0].latency_p50_ms or 0) >= 450, draining.stderr()
