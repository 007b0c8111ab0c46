"""Policy versions over real ZeroMQ sockets: numbering, long-polls, bitwise weights, snapshots;
and on one host through the version's file in the run's shared memory (the ``files`` fixture
case runs every test here that way too)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest
import torch

from streamrl.runtime.policy import PolicyPublisher, PolicySubscriber, PolicyTimeout
from tests.runtime.policy_serving import served

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


@pytest.fixture(params=["tcp", "ipc", "files"])
async def publisher(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[PolicyPublisher]:
    bind = "tcp://127.0.0.1:0" if request.param == "tcp" else f"ipc://{tmp_path}/weights"
    async with served(PolicyPublisher(bind, shm_dir=tmp_path / "shm" if request.param == "files" else None)) as pub:
        yield pub


def _version_files(publisher: PolicyPublisher) -> list[str]:
    """The publisher's versions' files (not the spare it allocates ahead for the next one)."""
    assert publisher.files_dir is not None
    return sorted(p.name for p in publisher.files_dir.iterdir() if "-v" in p.name)


def _subscriber(publisher: PolicyPublisher) -> PolicySubscriber:
    """A subscriber of the publisher's host: it shares the publisher's shm directory, if any."""
    shm = publisher.files_dir.parent if publisher.files_dir is not None else None
    return PolicySubscriber(publisher.endpoint, poll_s=0.5, shm_dir=shm)


@pytest.fixture
async def subscriber(publisher: PolicyPublisher) -> AsyncIterator[PolicySubscriber]:
    sub = _subscriber(publisher)
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
        with pytest.raises(ValueError, match="must increase"):  # a snapshot made for it is not kept
            await publisher.publish(stale, snapshot=publisher.snapshot(stale, _state()))
    with pytest.raises(ValueError, match="the snapshot of version 4"):
        await publisher.publish(3, snapshot=publisher.snapshot(4, _state()))
    assert publisher.version == 2
    if publisher.files_dir is not None:
        assert len(_version_files(publisher)) == 1  # version 2's


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
    if publisher.files_dir is None:
        assert subscriber.bytes_received > 0
    else:  # both versions came as files, none over the socket
        assert (subscriber.files_mapped, subscriber.bytes_received, publisher.files_served) == (2, 0, 2)


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
    subs = [_subscriber(publisher) for _ in range(4)]
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


async def test_a_version_file_outlives_its_replacement_for_its_readers(file_publisher: PolicyPublisher) -> None:
    """One file per version, private to the run's user; the next publish removes it, and a
    generator still holding its tensors reads them unchanged."""
    pub = file_publisher
    assert pub.files_dir is not None
    sub = _subscriber(pub)
    try:
        first = _state(1)
        await pub.publish(1, first)
        _, got1 = await sub.fetch(have=0, need=1, timeout_s=10)
        assert got1 is not None
        files = _version_files(pub)
        assert len(files) == 1 and files[0].endswith("-v1.bin")
        assert pub.files_dir.stat().st_mode & 0o777 == 0o700
        assert (pub.files_dir / files[0]).stat().st_mode & 0o777 == 0o600

        second = _state(2)
        await pub.publish(2, second)
        assert _version_files(pub) == [files[0].replace("-v1.bin", "-v2.bin")]
        _assert_bitwise_equal(got1, first)  # the unlinked file's pages live on in this mapping
        _, got2 = await sub.fetch(have=1, need=2, timeout_s=10)
        assert got2 is not None
        _assert_bitwise_equal(got2, second)
        assert sub.files_mapped == 2 and sub.bytes_received == 0
    finally:
        sub.close()


async def test_a_file_its_readers_are_done_with_takes_the_version_after_next(file_publisher: PolicyPublisher) -> None:
    """A subscriber that installs each version and lets go of it says so with its next request
    (``WeightsRequest.done``): the publisher writes the version after next into that file instead
    of a new one (two files take turns), and every version still arrives bit for bit."""
    pub = file_publisher
    assert pub.files_dir is not None
    sub = _subscriber(pub)
    inode: dict[int, int] = {}
    try:
        for v in range(1, 7):
            await pub.publish(v, _state(v))
            inode[v] = (pub.files_dir / _version_files(pub)[0]).stat().st_ino
            _, got = await sub.fetch(have=v - 1, need=v, timeout_s=10)
            assert got is not None
            _assert_bitwise_equal(got, _state(v))
            del got  # installed: the mapping goes with the last view of it
    finally:
        sub.close()
    assert [inode[v] == inode[v - 2] for v in range(3, 7)] == [True] * 4, inode
    assert inode[1] != inode[2] and pub.files_reused == 4
    assert len(list(pub.files_dir.iterdir())) <= 3  # the current version's, the retired one, a spare


async def test_a_file_a_reader_still_maps_is_never_written_again(file_publisher: PolicyPublisher) -> None:
    """A subscriber that keeps version 1's tensors reports nothing done (``done`` covers every
    version up to the oldest it maps), so no file of its is rewritten: its tensors stay version
    1's however many versions follow."""
    pub = file_publisher
    sub = _subscriber(pub)
    try:
        await pub.publish(1, _state(1))
        _, kept = await sub.fetch(have=0, need=1, timeout_s=10)
        assert kept is not None
        for v in range(2, 6):
            await pub.publish(v, _state(v))
            _, got = await sub.fetch(have=v - 1, need=v, timeout_s=10)
            assert got is not None
            _assert_bitwise_equal(got, _state(v))
            del got
        _assert_bitwise_equal(kept, _state(1))
        assert pub.files_reused == 0
    finally:
        sub.close()


async def test_a_file_whose_bytes_went_out_as_frames_is_never_written_again(file_publisher: PolicyPublisher,
                                                                              tmp_path: Path) -> None:
    """The frames of a reply over the socket are views of the version's file, sent zero-copy: that
    file is removed when its version is replaced, never written again, though every file reader
    is done with it."""
    pub = file_publisher
    local = _subscriber(pub)
    remote = PolicySubscriber(pub.endpoint, poll_s=0.5)  # no shared directory: frames
    try:
        for v in range(1, 5):
            await pub.publish(v, _state(v))
            _, got = await local.fetch(have=v - 1, need=v, timeout_s=10)
            assert got is not None
            del got
            if v == 2:  # version 2 goes out as frames too
                _, framed = await remote.fetch(have=0, need=2, timeout_s=10)
                assert framed is not None and remote.files_mapped == 0
                del framed
        # version 1's file (its reader done with it) took version 3; version 2's (framed) was
        # removed when version 3 came out, so version 4 got a file of its own
        assert pub.files_reused == 1
    finally:
        local.close()
        remote.close()


async def test_the_next_versions_file_is_allocated_ahead_and_close_removes_every_file(tmp_path: Path) -> None:
    """After a publish a thread allocates the next version's file (a spare, never named in a
    reply); the next snapshot of the same size becomes that file; close() removes them all."""
    pub = PolicyPublisher(f"ipc://{tmp_path}/weights", shm_dir=tmp_path / "shm")
    assert pub.files_dir is not None
    await pub.publish(1, _state(1))
    assert pub._spare_maker is not None
    pub._spare_maker.join(timeout=10)
    spare = [p.name for p in pub.files_dir.iterdir() if "-next" in p.name]
    assert len(spare) == 1 and _version_files(pub) == [next(p.name for p in pub.files_dir.iterdir() if "-v1" in p.name)]
    spare_inode = (pub.files_dir / spare[0]).stat().st_ino
    await pub.publish(2, _state(2))
    v2 = _version_files(pub)
    assert len(v2) == 1 and v2[0].endswith("-v2.bin")
    assert (pub.files_dir / v2[0]).stat().st_ino == spare_inode  # the spare, renamed and filled
    await _assert_served(pub, 2)
    pub.close()
    assert list(pub.files_dir.iterdir()) == []


async def _assert_served(pub: PolicyPublisher, version: int) -> None:
    """A fresh subscriber, served by ``pub`` for the call, fetches ``version`` bit for bit."""
    sub = _subscriber(pub)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(pub.serve)
            _, got = await sub.fetch(have=0, need=version, timeout_s=10)
            tg.cancel_scope.cancel()
        assert got is not None
        _assert_bitwise_equal(got, _state(version))
    finally:
        sub.close()


async def test_a_write_into_received_weights_stays_in_that_process(file_publisher: PolicyPublisher) -> None:
    """Subscribers map the file copy-on-write: one that writes into its tensors changes neither
    the file nor another subscriber's copy."""
    state = _state(3)
    await file_publisher.publish(1, state)
    a, b = _subscriber(file_publisher), _subscriber(file_publisher)
    try:
        _, got_a = await a.fetch(have=0, need=1, timeout_s=10)
        assert got_a is not None
        for t in got_a.values():
            t.add_(1.0)
        _, got_b = await b.fetch(have=0, need=1, timeout_s=10)
        assert got_b is not None and b.files_mapped == 1
        _assert_bitwise_equal(got_b, state)
    finally:
        a.close()
        b.close()


async def test_a_subscriber_of_another_host_gets_the_weights_over_the_socket(file_publisher: PolicyPublisher,
                                                                             tmp_path: Path) -> None:
    """A reply names a file this subscriber's directory does not hold (another host's): it asks
    again for frames, and after two misses in a row asks for frames only."""
    sub = PolicySubscriber(file_publisher.endpoint, poll_s=0.5, shm_dir=tmp_path / "elsewhere")
    try:
        for version in (1, 2, 3):
            state = _state(version)
            await file_publisher.publish(version, state)
            got_version, got = await sub.fetch(have=version - 1, need=version, timeout_s=10)
            assert got_version == version and got is not None
            _assert_bitwise_equal(got, state)
        assert sub.files_mapped == 0 and sub.bytes_received > 0
        assert not sub.asks_for_files
        assert file_publisher.files_served == 2  # versions 1 and 2; 3 was asked for as frames at once
    finally:
        sub.close()


async def test_a_file_gone_before_it_is_opened_costs_a_new_ask_not_the_version(
        file_publisher: PolicyPublisher) -> None:
    """A reply's file can be gone when the subscriber opens it (the next version replaced it, or the
    run's directory was cleaned): the subscriber asks again and gets the version all the same."""
    pub = file_publisher
    assert pub.files_dir is not None
    sub = _subscriber(pub)
    try:
        state = _state(1)
        await pub.publish(1, state)
        (pub.files_dir / _version_files(pub)[0]).unlink()
        version, got = await sub.fetch(have=0, need=1, timeout_s=10)
        assert version == 1 and got is not None
        _assert_bitwise_equal(got, state)
        assert sub.files_mapped == 0 and sub.bytes_received > 0
    finally:
        sub.close()


def test_a_shared_memory_too_small_for_a_version_sends_it_over_the_socket(tmp_path: Path) -> None:
    """Where the directory cannot hold a version (a container's small /dev/shm; here a file-size
    limit on the publisher's process), its allocation fails cleanly, never a SIGBUS on the write,
    and that version and every later one go over the socket. In a subprocess: the limit is
    process state."""
    import subprocess
    import sys

    probe = f"""
import resource, signal, anyio, torch
from pathlib import Path
from streamrl.runtime.policy import PolicyPublisher, PolicySubscriber
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit: EFBIG, as ENOSPC on a full tmpfs
resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))
state = {{"big": torch.arange(256 * 1024, dtype=torch.float32)}}  # 1 MiB: more than the limit
async def main():
    pub = PolicyPublisher("ipc://{tmp_path}/w", shm_dir=Path("{tmp_path}/shm"))
    sub = PolicySubscriber(pub.endpoint, poll_s=0.5, shm_dir=Path("{tmp_path}/shm"))
    async with anyio.create_task_group() as tg:
        tg.start_soon(pub.serve)
        for v in (1, 2):
            await pub.publish(v, snapshot=pub.snapshot(v, state))
            version, got = await sub.fetch(have=v - 1, need=v, timeout_s=10)
            assert version == v and torch.equal(got["big"], state["big"])
        tg.cancel_scope.cancel()
    print(pub.writes_files, sub.files_mapped, sub.bytes_received > 0, sorted(p.name for p in Path("{tmp_path}/shm/policy").iterdir()))
    sub.close(); pub.close()
anyio.run(main)
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "0", "True", "[]"], out.stdout + out.stderr
    assert "its weights go over the socket" in out.stderr


async def test_a_version_published_after_the_runs_shared_memory_was_removed_makes_no_directory_again(
        tmp_path: Path) -> None:
    """A killed launcher's workers remove its directories as they stop, while a trainer may still
    publish (runtime/orphans.py). Its next version then goes over the socket: neither the version's
    file nor the next one's spare makes the run's directory again, which no one would remove (no
    owner file)."""
    import shutil

    shm = tmp_path / "shm"
    pub = PolicyPublisher(f"ipc://{tmp_path}/weights", shm_dir=shm)
    try:
        await pub.publish(1, _state(1))
        assert pub._spare_maker is not None
        pub._spare_maker.join(timeout=10)
        shutil.rmtree(shm)
        pub._make_spare(1024)  # a spare allocated by its thread after the removal (the race it lost)
        pub._spare_maker.join(timeout=10)
        assert not shm.exists()
        await pub.publish(2, _state(2))
        assert not shm.exists() and not pub.writes_files
        await _assert_served(pub, 2)  # over the socket
    finally:
        pub.close()
    assert not shm.exists()
