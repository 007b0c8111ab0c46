"""A reward client whose link to its server resets re-registers and loses nothing (issue 25).

A real reward server process over tcp 127.0.0.1; the client reaches it through a
:class:`tests.dock.relay.Relay` that the test resets (RST both ways, in-flight bytes dropped)
while batches stream, once while paused so that a request dies in the link. ZeroMQ reconnects
underneath; what this pins is the client's own state: it says hello again, the server is used
again, every batch lost in the link is sent again, and each is scored exactly once. A link that
dies silently (half-open, ``Relay.stall``) is dropped and dialled again after the heartbeat timeout.
"""

from __future__ import annotations

import anyio
import pytest

from streamrl.rewards import RewardClient, RewardSample
from tests.dock.relay import Relay
from tests.rewards.conftest import Servers

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]
PACED = "tests.rewards.reward_test_functions:paced_length"  # len(response), 10 ms per batch


def batch(b: int, size: int) -> list[RewardSample]:
    return [RewardSample(id=i, prompt="p", response="y" * (i % 11)) for i in range(b * size, (b + 1) * size)]


async def wait_until(predicate: object, timeout_s: float) -> None:
    with anyio.fail_after(timeout_s):
        while not predicate():  # type: ignore[operator]
            await anyio.sleep(0.005)


async def test_a_client_whose_link_resets_mid_stream_scores_every_batch_once(servers: Servers) -> None:
    server = servers.reward_server(PACED)
    n_batches, size, phase, streams = 30, 8, 6, 2
    scores: dict[int, float] = {}
    done = 0
    allowed = phase  # batches below this may start; the resetter opens the next phase after each reset
    with Relay(server.endpoint) as relay:
        async with RewardClient(
            [relay.endpoint], timeout_s=10, heartbeat_interval_s=0.1, heartbeat_timeout_s=3,
            max_batch_size=size, max_in_flight_per_server=2, no_server_timeout_s=10,
        ) as client:  # fmt: skip
            await client.wait_servers_up(timeout_s=10)

            async def producer(first: int) -> None:
                nonlocal done
                for b in range(first, n_batches, streams):
                    await wait_until(lambda b=b: b < allowed, 10)
                    for result in await client.score(batch(b, size)):
                        assert result.sample_id not in scores, f"sample {result.sample_id} scored twice"
                        assert isinstance(result.score, float) and result.error is None
                        scores[result.sample_id] = result.score
                    done += 1

            async def resetter() -> None:
                nonlocal allowed
                for k in range(1, n_batches // phase):
                    # Reset while the phase's last batches are in flight.
                    await wait_until(lambda target=allowed - 2: done >= target, 10)
                    if k == 3:
                        # A request dies in the link: the relay holds it (and any reply), then resets.
                        # Whatever is outstanding once it has been paused a while is stuck there: a
                        # reply would take 10 ms.
                        relay.pause()
                        allowed += phase
                        await anyio.sleep(0.2)
                        await wait_until(lambda: client.statistics().servers[0].outstanding >= 1, 10)
                        assert await anyio.to_thread.run_sync(relay.reset) == 1
                    else:
                        assert await anyio.to_thread.run_sync(relay.reset) == 1
                        allowed += phase

            with anyio.fail_after(25):
                async with anyio.create_task_group() as group:
                    group.start_soon(resetter)
                    for first in range(streams):
                        group.start_soon(producer, first)
                await client.wait_servers_up(timeout_s=5)
                # The server is alive and still serving this client after the last reset.
                last = await client.score(batch(n_batches, size))
            stats = client.statistics()

    assert server.proc.poll() is None, server.stderr()
    assert [r.score for r in last] == [float(i % 11) for i in range(n_batches * size, (n_batches + 1) * size)]
    assert sorted(scores) == list(range(n_batches * size))
    assert all(value == float(i % 11) for i, value in scores.items())
    (s,) = stats.servers
    assert relay.resets == 4 and relay.accepted == 5  # one fresh connection after each reset
    assert s.state == "up" and s.disconnects == 4, s  # each reset noticed, and hello answered again
    assert s.lost >= 1 and stats.retries >= s.lost, s  # at least the paused request was sent again
    assert stats.batches == n_batches + 1 and stats.samples == (n_batches + 1) * size
    assert s.samples == (n_batches + 1) * size  # nothing scored twice by this server's accepted replies
    assert (stats.timeouts, stats.bad_replies, stats.sample_errors, stats.defaulted_samples) == (0, 0, 0, 0)


async def test_a_client_whose_link_dies_silently_dials_again(servers: Servers) -> None:
    """A half-open link (no RST, no FIN: nothing comes back, sends vanish) is seen only by the
    client's heartbeat. The client must then drop that connection and dial again; before, it marked
    the server lost and kept saying hello into the dead link: the server was unusable for good."""
    server = servers.reward_server(PACED)
    n_batches, size = 12, 8
    scores: dict[int, float] = {}
    with Relay(server.endpoint) as relay:
        async with RewardClient(
            [relay.endpoint], timeout_s=10, heartbeat_interval_s=0.1, heartbeat_timeout_s=0.5,
            max_batch_size=size, max_in_flight_per_server=2, no_server_timeout_s=10,
        ) as client:  # fmt: skip
            await client.wait_servers_up(timeout_s=10)
            with anyio.fail_after(20):
                for b in range(n_batches):
                    if b == n_batches // 2:
                        assert await anyio.to_thread.run_sync(relay.stall) == 1
                    for result in await client.score(batch(b, size)):
                        assert result.sample_id not in scores, f"sample {result.sample_id} scored twice"
                        scores[result.sample_id] = result.score  # type: ignore[assignment]
            stats = client.statistics()

    assert server.proc.poll() is None, server.stderr()
    assert scores == {i: float(i % 11) for i in range(n_batches * size)}
    (s,) = stats.servers
    assert relay.accepted == 2  # a fresh connection after the silent one
    assert s.state == "up" and s.disconnects == 1 and s.lost == 1, s
    assert "heartbeat_timeout_s=0.5" in (s.last_error or "")
    assert (stats.timeouts, stats.bad_replies, stats.sample_errors) == (0, 0, 0)
