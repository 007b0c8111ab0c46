"""A subscriber and a policy file written from docs/policy-channel.md alone (pyzmq, msgpack, mmap):
streamrl's publisher serves the one, streamrl's reader maps the other."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import anyio
import msgpack
import numpy as np
import pytest
import torch
import zmq
import zmq.asyncio

from streamrl.runtime.policy import PolicyPublisher
from streamrl.runtime.policy_file import WeightSlot, map_snapshot

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

NUMPY = {"float32": np.float32, "int64": np.int64}  # the page's dtype names this test reads


async def _ask(sock: zmq.asyncio.Socket, req_id: int, need: int, *, files: bool, done: int | None = None
               ) -> list[bytes]:
    request = {"type": "weights_request", "req_id": req_id, "have": 0, "need": need, "want_weights": True,
               "timeout_s": 5.0, "files": files}
    if done is not None:
        request["done"] = done
    await sock.send(msgpack.packb(request))
    with anyio.fail_after(10):
        return await sock.recv_multipart()


async def test_a_subscriber_from_the_page_maps_the_version_file(file_publisher: PolicyPublisher, tmp_path: Path) -> None:
    state = {"w": torch.randn(3, 5), "steps": torch.tensor([7, 8, 9])}
    await file_publisher.publish(1, state)
    sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(file_publisher.endpoint)
    try:
        frames = await _ask(sock, 41, 1, files=True)
        reply = msgpack.unpackb(frames[0])
        assert reply["type"] == "weights_reply" and reply["req_id"] == 41 and reply["version"] == 1
        assert len(frames) == 1 and reply["weights"] is None  # the file, not frames
        name, size = reply["file"], reply["file_bytes"]
        assert "/" not in name and name.startswith("policy-") and name.endswith("-v1.bin")
        fd = os.open(tmp_path / "shm" / "policy" / name, os.O_RDONLY)
        try:
            assert os.fstat(fd).st_size == size
            view = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        got = {}
        for slot_name, dtype, shape, offset in reply["slots"]:
            assert offset % 64 == 0
            count = int(np.prod(shape)) if shape else 1
            got[slot_name] = np.frombuffer(view, dtype=NUMPY[dtype], count=count, offset=offset).reshape(shape)
        assert list(got) == ["w", "steps"]
        for key, t in state.items():
            assert np.array_equal(got[key], t.numpy()), key

        # without files: the same version as frames (names per column, one TensorColumn per dtype)
        frames = await _ask(sock, 42, 1, files=False)
        reply = msgpack.unpackb(frames[0])
        assert reply["file"] is None and reply["names"] == [["w"], ["steps"]] and len(frames) > 1
    finally:
        sock.close()


async def test_a_subscriber_from_the_page_that_says_done_gets_its_file_reused(file_publisher: PolicyPublisher,
                                                                             tmp_path: Path) -> None:
    """§2 ``done`` and §4's lifetime: a file stays as written while a subscriber it was named to
    may map it; once that subscriber says it maps no file of a version <= v, the publisher may write
    a later version into version v's file (streamrl's keeps the file of the version before the
    current one for that, and writes the version after next into it)."""
    directory = tmp_path / "shm" / "policy"
    sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(file_publisher.endpoint)
    try:
        await file_publisher.publish(1, {"w": torch.full((300,), 1.0)})
        reply = msgpack.unpackb((await _ask(sock, 1, 1, files=True))[0])
        fd = os.open(directory / reply["file"], os.O_RDONLY)
        view = mmap.mmap(fd, reply["file_bytes"], flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        os.close(fd)
        await file_publisher.publish(2, {"w": torch.full((300,), 2.0)})
        # not said done: version 1's bytes stay as they are under this mapping, whatever comes next
        reply = msgpack.unpackb((await _ask(sock, 2, 2, files=True))[0])
        second_inode = os.stat(directory / reply["file"]).st_ino
        await file_publisher.publish(3, {"w": torch.full((300,), 3.0)})
        assert np.frombuffer(view, dtype=np.float32, count=300).tolist() == [1.0] * 300
        view.close()
        # unmapped, and said so (version 2's file it never mapped): version 2's file, retired when
        # version 3 came out, takes version 4 (version 1's was removed then: still mapped)
        reply = msgpack.unpackb((await _ask(sock, 3, 3, files=True, done=2))[0])
        await file_publisher.publish(4, {"w": torch.full((300,), 4.0)})
        reply = msgpack.unpackb((await _ask(sock, 4, 4, files=True, done=3))[0])
        assert reply["version"] == 4
        fd = os.open(directory / reply["file"], os.O_RDONLY)
        try:
            assert os.fstat(fd).st_ino == second_inode
            assert np.frombuffer(os.read(fd, 1200), dtype=np.float32).tolist() == [4.0] * 300
        finally:
            os.close(fd)
    finally:
        sock.close()


def test_a_policy_file_written_from_the_page_is_mapped_bitwise(tmp_path: Path) -> None:
    """Offsets at multiples of 64, row-major bytes, zero gaps; the reply's slots as arrays."""
    tensors = {"a": np.arange(10, dtype=np.float32).reshape(2, 5), "b": np.array([3, -4], dtype=np.int64)}
    slots, blob, offset = [], bytearray(), 0
    for key, arr in tensors.items():
        blob.extend(b"\0" * (offset - len(blob)))
        blob.extend(arr.tobytes())
        slots.append(WeightSlot(key, str(arr.dtype), list(arr.shape), offset))
        offset = -(-len(blob) // 64) * 64
    name = "policy-0123456789abcdef-v3.bin"
    (tmp_path / name).write_bytes(bytes(blob))
    got = map_snapshot(tmp_path, name, len(blob), slots)
    for key, arr in tensors.items():
        assert np.array_equal(got[key].numpy(), arr), key
