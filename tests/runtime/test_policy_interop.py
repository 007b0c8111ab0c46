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


async def _ask(sock: zmq.asyncio.Socket, req_id: int, need: int, *, files: bool) -> list[bytes]:
    request = {"type": "weights_request", "req_id": req_id, "have": 0, "need": need, "want_weights": True,
               "timeout_s": 5.0, "files": files}
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
