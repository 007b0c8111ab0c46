"""Garbage on every dock socket: the servers answer with errors or drop it, and keep serving."""

from __future__ import annotations

from collections.abc import Iterator

import anyio
import msgpack
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streamrl.dock import protocol as p
from streamrl.dock.client import DockClient
from streamrl.dock.launch import LocalDock


@pytest.fixture(scope="module")
def garbage_dock() -> Iterator[LocalDock]:
    with LocalDock(["gen"], capacity=1024, n_warehouses=1) as d:
        yield d


def _blast(endpoint: str, messages: list[list[bytes]], expect_replies: bool = False,
           quiet_ms: int = 300) -> list[list[bytes]]:
    """Send raw multipart messages from a DEALER; collect replies until none comes for ``quiet_ms``."""
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    try:
        for m in messages:
            s.send_multipart(m)
        replies = []
        while s.poll(quiet_ms if not expect_replies or replies else 5000):
            replies.append(s.recv_multipart())
        return replies
    finally:
        s.close(0)


def _still_serves(dock: LocalDock) -> None:
    assert dock.alive(), "a dock server died"

    async def main() -> None:
        async with DockClient(dock.controller_endpoint, request_timeout_s=10) as c:
            idx = await c.add({"x": [torch.arange(3)]})
            lease = await c.claim("gen", ["x"], 1, timeout=10)
            assert lease.indices == idx
            assert (await c.fetch(idx, ["x"]))["x"][0].tolist() == [0, 1, 2]
            await c.ack(lease)

    anyio.run(main)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frames=st.lists(st.binary(max_size=64), min_size=0, max_size=4))
def test_random_bytes_on_both_sockets(garbage_dock: LocalDock, frames: list[bytes]) -> None:
    for ep in (garbage_dock.controller_endpoint, garbage_dock.warehouse_endpoints[0]):
        _blast(ep, [frames] if frames else [[b""]], quiet_ms=20)
    assert garbage_dock.alive()


STRUCTURED = [
    # well-formed msgpack, wrong shapes / types / tags
    msgpack.packb({"type": "claim", "req_id": 1}),  # missing fields
    msgpack.packb({"type": "claim", "req_id": 2, "client_id": 5, "consumer": [], "reads": 3, "n": "x"}),
    msgpack.packb({"type": "launch_missiles", "req_id": 3}),
    msgpack.packb({"type": "put", "req_id": 4, "indices": [0], "columns": []}),  # warehouse msg to controller
    msgpack.packb({"type": "ack", "req_id": 5, "client_id": "z", "lease_id": 999}),
    msgpack.packb({"type": "reserve", "req_id": 6, "client_id": "z", "n": -5}),
    msgpack.packb({"type": "reserve", "req_id": 7, "client_id": "z", "n": 1 << 62}),
    msgpack.packb([1, 2, 3]),
    msgpack.packb({"req_id": 8}),
    b"\xc1",  # never-used msgpack byte
    msgpack.packb({"type": "hello", "req_id": 9, "client_id": "z", "protocol": 999}),
    msgpack.packb({"type": "hello", "req_id": 10, "client_id": "z", "protocol": 1, "lease_ttl_s": -1.0}),
]


def test_structured_garbage_on_the_controller_gets_error_replies(garbage_dock: LocalDock) -> None:
    replies = _blast(garbage_dock.controller_endpoint, [[m] for m in STRUCTURED] + [[msgpack.packb({"type": "stats", "req_id": 11}), b"extra"]],
                     expect_replies=True)
    decoded = [p.reply_decoder.decode(r[0]) for r in replies]
    assert decoded and all(isinstance(d, p.ErrorReply) for d in decoded)
    codes = {d.req_id: d.code for d in decoded}
    assert codes[1] == "malformed" and codes[3] == "malformed" and codes[5] == "unknown_lease"
    # out-of-bound numbers are refused by the decoder itself (msgspec Meta bounds): malformed
    assert codes[6] == "malformed" and codes[7] == "malformed" and codes[9] == "protocol"
    assert codes[11] == "bad_frames" and codes[10] == "malformed"
    assert all(d.message for d in decoded)
    _still_serves(garbage_dock)


def _put(req_id: int, col: dict, indices: list[int] | None = None) -> bytes:
    return msgpack.packb({"type": "put", "req_id": req_id, "indices": indices or [100000], "columns": [col]})


def test_structured_garbage_on_the_warehouse_gets_error_replies(garbage_dock: LocalDock) -> None:
    tensor = {"kind": "tensor", "name": "x", "dtype": "float32", "shapes": [[4]], "frames": [0], "offsets": [0]}
    messages = [
        [_put(1, tensor)],  # frame missing
        [_put(2, tensor), b"\x00" * 3],  # truncated frame
        [_put(3, {**tensor, "dtype": "evil"}), b"\x00" * 16],
        [_put(4, {**tensor, "shapes": [[1 << 40]]}), b"\x00" * 16],  # absurd shape
        [_put(5, {**tensor, "offsets": [-8]}), b"\x00" * 16],
        [_put(6, {**tensor, "frames": [7]}), b"\x00" * 16],
        [_put(7, {"kind": "object", "name": "x", "values": [1, 2]})],  # 2 values, 1 index
        [_put(8, {"kind": "pickle", "name": "x", "values": [1]})],
        [_put(9, tensor, indices=[-1]), b"\x00" * 16],
        [msgpack.packb({"type": "get", "req_id": 10, "indices": [424242], "columns": ["x"]})],
        [msgpack.packb({"type": "free", "indices": [1]})],  # only the controller may free
        [msgpack.packb({"type": "claim", "req_id": 12})],  # controller message to a warehouse
    ]
    replies = _blast(garbage_dock.warehouse_endpoints[0], messages, expect_replies=True)
    decoded = {d.req_id: d for d in (p.reply_decoder.decode(r[0]) for r in replies)}
    assert all(isinstance(d, p.ErrorReply) for d in decoded.values())
    assert set(decoded) >= {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12}
    assert "outside frame" in decoded[2].message and "unknown dtype" in decoded[3].message
    assert decoded[9].code == "malformed" and "$.indices[0]" in decoded[9].message  # the bound names the field
    _still_serves(garbage_dock)
