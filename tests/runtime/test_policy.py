"""Policy versions over real ZeroMQ sockets: numbering, long-polls, bitwise weights, snapshots."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest
import torch

from streamrl.runtime.policy import PolicyPublisher, PolicySubscriber, PolicyTimeout

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(64, 32, generator=g),
        "layer.0.bias": torch.randn(32, generator=g),
        "big": torch.randn(256, 128, generator=g),  # over the codec's zero-copy threshold (64 KiB)
        "lm_head.weight": torch.randn(32, 64, generator=g).t(),  # non-contiguous
        "scale": torch.tensor(1.5),  # 0-d
    }


@pytest.fixture(params=["tcp", "ipc"])
async def publisher(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[PolicyPublisher]:
    bind = "tcp://127.0.0.1:0" if request.param == "tcp" else f"ipc://{tmp_path}/weights"
    pub = PolicyPublisher(bind)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(pub.serve)
            yield pub
            tg.cancel_scope.cancel()
    finally:
        pub.close()


@pytest.fixture
async def subscriber(publisher: PolicyPublisher) -> AsyncIterator[PolicySubscriber]:
    sub = PolicySubscriber(publisher.endpoint, poll_s=0.5)
    yield sub
    sub.close()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _assert_bitwise_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype, name
        assert got[name].shape == t.shape, name
        assert torch.equal(_bytes(got[name]), _bytes(t)), name


async def test_versions_must_increase(publisher: PolicyPublisher) -> None:
    await publisher.publish(1, _state())
    await publisher.publish(2, _state())
    assert publisher.version == 2
    for stale in (2, 1):
        with pytest.raises(ValueError, match="must increase"):
            await publisher.publish(stale, _state())
    assert publisher.version == 2


async def test_version_zero_needs_no_publisher(tmp_path: Path) -> None:
    """Every stage builds version 0 itself: waiting for it returns at once, even with nobody serving."""
    sub = PolicySubscriber(f"ipc://{tmp_path}/nobody")
    try:
        with anyio.fail_after(1):
            assert await sub.wait_version(0) == 0
            assert await sub.wait_version(-3) == 0
    finally:
        sub.close()


async def test_wait_version_long_polls_until_published(publisher: PolicyPublisher,
                                                       subscriber: PolicySubscriber) -> None:
    got: list[tuple[int, float]] = []

    async def waiter() -> None:
        v = await subscriber.wait_version(2, timeout_s=20)
        got.append((v, time.monotonic()))

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await anyio.sleep(0.3)
        await publisher.publish(1, _state())
        await anyio.sleep(0.7)  # more than the subscriber's poll period: it keeps waiting
        assert got == []
        t_publish = time.monotonic()
        await publisher.publish(2, _state())
    assert got[0][0] == 2
    # answered by the publish itself, not by the next poll (poll_s = 0.5 s)
    assert got[0][1] - t_publish < 0.4
    assert subscriber.known_version == 2
    with anyio.fail_after(1):  # known: no round trip
        assert await subscriber.wait_version(1) == 2


async def test_wait_version_times_out(publisher: PolicyPublisher, subscriber: PolicySubscriber) -> None:
    await publisher.publish(1, _state())
    t0 = time.monotonic()
    with pytest.raises(PolicyTimeout, match="version 5 did not appear") as info:
        await subscriber.wait_version(5, timeout_s=0.6)
    assert 0.5 <= time.monotonic() - t0 < 3
    assert "newest: 1" in str(info.value)


async def test_fetch_returns_the_published_weights_bitwise(publisher: PolicyPublisher,
                                                          subscriber: PolicySubscriber) -> None:
    state = _state(1)
    await publisher.publish(1, state)
    version, got = await subscriber.fetch(have=0, need=1, timeout_s=10)
    assert version == 1 and got is not None
    _assert_bitwise_equal(got, state)
    # up to date: no weights
    assert await subscriber.fetch(have=1, need=1, timeout_s=10) == (1, None)
    # behind but need satisfied: the newest version comes
    state2 = _state(2)
    await publisher.publish(2, state2)
    version, got = await subscriber.fetch(have=1, need=0, timeout_s=10)
    assert version == 2 and got is not None
    _assert_bitwise_equal(got, state2)
    assert subscriber.bytes_received > 0


async def test_fetch_long_polls_for_a_future_version(publisher: PolicyPublisher,
                                                    subscriber: PolicySubscriber) -> None:
    state = _state(3)
    result: list[tuple[int, dict[str, torch.Tensor] | None]] = []

    async def fetcher() -> None:
        result.append(await subscriber.fetch(have=0, need=1, timeout_s=20))

    async with anyio.create_task_group() as tg:
        tg.start_soon(fetcher)
        await anyio.sleep(0.7)
        assert result == []
        await publisher.publish(1, state)
    version, got = result[0]
    assert version == 1 and got is not None
    _assert_bitwise_equal(got, state)


async def test_a_mutation_after_publish_does_not_reach_subscribers(publisher: PolicyPublisher,
                                                                   subscriber: PolicySubscriber) -> None:
    """The snapshot rule: publish clones, so the optimizer may update the live parameters at once."""
    live = _state(4)
    expected = {k: v.clone() for k, v in live.items()}
    await publisher.publish(1, live)
    for t in live.values():
        t.add_(1000.0)  # the optimizer's next step, in place
    _, got = await subscriber.fetch(have=0, need=1, timeout_s=10)
    assert got is not None
    _assert_bitwise_equal(got, expected)


async def test_many_subscribers_get_the_same_version(publisher: PolicyPublisher) -> None:
    state = _state(5)
    subs = [PolicySubscriber(publisher.endpoint, poll_s=0.5) for _ in range(4)]
    results: dict[int, tuple[int, dict[str, torch.Tensor] | None]] = {}
    try:
        async def fetch(i: int) -> None:
            results[i] = await subs[i].fetch(have=0, need=1, timeout_s=20)

        async with anyio.create_task_group() as tg:
            for i in range(len(subs)):
                tg.start_soon(fetch, i)
            await anyio.sleep(0.3)
            await publisher.publish(1, state)
        for version, got in results.values():
            assert version == 1 and got is not None
            _assert_bitwise_equal(got, state)
    finally:
        for s in subs:
            s.close()


async def test_a_malformed_request_does_not_stop_the_publisher(publisher: PolicyPublisher,
                                                               subscriber: PolicySubscriber) -> None:
    import zmq
    import zmq.asyncio

    junk = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    junk.setsockopt(zmq.LINGER, 0)
    junk.connect(publisher.endpoint)
    try:
        await junk.send(b"\xc1 not msgpack")
        await publisher.publish(1, _state())
        assert await subscriber.wait_version(1, timeout_s=10) == 1
    finally:
        junk.close()


async def test_a_state_with_mixed_dtypes_is_served() -> None:
    state = {"w": torch.randn(4, 4), "h": torch.randn(4).to(torch.bfloat16), "steps": torch.tensor([3])}
    pub = PolicyPublisher("tcp://127.0.0.1:0")
    sub = PolicySubscriber(pub.endpoint, poll_s=0.5)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(pub.serve)
            await pub.publish(1, state)
            _, got = await sub.fetch(have=0, need=1, timeout_s=5)
            tg.cancel_scope.cancel()
        assert got is not None
        _assert_bitwise_equal(got, state)
    finally:
        sub.close()
        pub.close()
