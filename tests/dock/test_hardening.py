"""Each class of message that once killed or stalled a dock server, sent over a real socket to a real
server process; afterwards the server must still answer a normal request correctly (issue 12).

1 text that is not UTF-8        5 tensor frames longer than their header says
2 values nested thousands deep  6 per-client state that grows with every new client id
3 non-finite / out-of-range numbers  7 warehouse-only messages from anyone
4 frames far beyond any sensible size  8 a claim fixing a consumer's declared reads
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import anyio
import msgpack
import pytest
import torch
import zmq

from streamrl.dock import protocol as p
from streamrl.dock.client import DockClient
from streamrl.dock.controller import ConsumerView
from streamrl.dock.errors import DockTimeout, RemoteError
from streamrl.dock.launch import LocalDock, ThreadDock
from streamrl.dock.limits import DockLimits

VIEWS = {"gen": ConsumerView(["x"])}


@pytest.fixture(scope="module")
def dock() -> Iterator[LocalDock]:
    with LocalDock(["gen"], capacity=64, n_warehouses=1, views=VIEWS) as d:
        yield d


class Raw:
    """A bare DEALER speaking msgpack by hand, as an attacker (or a foreign client) would."""

    def __init__(self, endpoint: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def send(self, *frames: bytes) -> None:
        self.sock.send_multipart(list(frames))

    def recv(self, timeout_s: float = 5.0) -> Any:
        """The next reply decoded, or None if nothing comes within ``timeout_s``."""
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        return p.reply_decoder.decode(self.sock.recv_multipart()[0])

    def ask(self, header: dict[str, Any] | bytes, *frames: bytes, timeout_s: float = 5.0) -> Any:
        self.send(header if isinstance(header, bytes) else msgpack.packb(header), *frames)
        return self.recv(timeout_s)

    def close(self) -> None:
        self.sock.close(0)


@pytest.fixture
def raw_ctl(dock: LocalDock) -> Iterator[Raw]:
    r = Raw(dock.controller_endpoint)
    yield r
    r.close()


@pytest.fixture
def raw_wh(dock: LocalDock) -> Iterator[Raw]:
    r = Raw(dock.warehouse_endpoints[0])
    yield r
    r.close()


def still_serves(dock: LocalDock | ThreadDock, value: list[int] | None = None) -> None:
    """A normal add -> claim -> fetch -> ack round trip, checked value by value."""
    if isinstance(dock, LocalDock):
        assert dock.alive(), "a dock server process died"
    value = value or [4, 5, 6]

    async def main() -> None:
        async with DockClient(dock.controller_endpoint, request_timeout_s=10, connect_timeout_s=20) as c:
            idx = await c.add({"x": [torch.tensor(value)]})
            lease = await c.claim("gen", ["x"], 1, timeout=10)
            assert lease.indices == idx
            assert (await c.fetch(idx, ["x"]))["x"][0].tolist() == value
            await c.ack(lease)

    anyio.run(main)


def _error(reply: Any, req_id: int, code: str) -> p.ErrorReply:
    assert isinstance(reply, p.ErrorReply), f"expected an error reply to request {req_id}, got {reply!r}"
    assert (reply.req_id, reply.code) == (req_id, code), reply
    return reply


def _claim(req_id: int, **over: Any) -> dict[str, Any]:
    return {"type": "claim", "req_id": req_id, "client_id": "raw", "consumer": "gen", "reads": ["x"], "n": 1, **over}


def _tensor_put(req_id: int, shape: list[int], index: int = 1 << 40, **over: Any) -> dict[str, Any]:
    col = {"kind": "tensor", "name": "t", "dtype": "float32", "shapes": [shape], "frames": [0], "offsets": [0], **over}
    return {"type": "put", "req_id": req_id, "indices": [index], "columns": [col]}


# ---------------------------------------------------------------- 1. text that is not UTF-8
def test_1_text_that_is_not_utf8_is_malformed_not_fatal(dock: LocalDock, raw_ctl: Raw, raw_wh: Raw) -> None:
    hello = msgpack.packb({"type": "hello", "req_id": 1, "client_id": "\u00e9", "protocol": p.PROTOCOL_VERSION})
    bad_value = hello.replace("\u00e9".encode(), b"\xff\xfe")  # same length, invalid UTF-8
    reply = _error(raw_ctl.ask(bad_value), 1, "malformed")
    assert "UTF-8" in reply.message
    bad_key = msgpack.packb({"type": "stats", "req_id": 2, "k\u00e9": 1}).replace("k\u00e9".encode(), b"k\xff\xfe")
    _error(raw_ctl.ask(bad_key), 2, "malformed")
    obj = {"kind": "object", "name": "o", "values": ["\u00e9\u00e9"]}
    put = msgpack.packb({"type": "put", "req_id": 3, "indices": [1 << 40], "columns": [obj]})
    _error(raw_wh.ask(put.replace("\u00e9\u00e9".encode(), b"\xc3\x28\xa0\xa1")), 3, "malformed")
    assert p.salvage_req_id(bad_value) == 1  # the salvage path itself never raises
    still_serves(dock)


# ---------------------------------------------------------------- 2. deep nesting
def test_2_deeply_nested_values_are_refused(dock: LocalDock, raw_ctl: Raw, raw_wh: Raw) -> None:
    deep = b"\x91" * 100_000 + b"\x00"  # [[[[...0...]]]] 100k levels: a RecursionError in msgspec
    raw_wh.send(b"\x83\xa4type\xa3put\xa7indices\x91\x00\xa7columns" + deep)
    raw_ctl.send(b"\x82\xa4type\xa5stats\xa6req_id" + deep)
    assert raw_wh.recv(0.5) is None and raw_ctl.recv(0.5) is None  # no readable req_id: dropped
    nested: Any = 1
    for _ in range(p.MAX_DEPTH + 1):
        nested = [nested]
    put = {"type": "put", "req_id": 4, "indices": [1 << 40], "columns": [{"kind": "object", "name": "o",
                                                                           "values": [nested]}]}
    assert "32 levels" in _error(raw_wh.ask(put), 4, "malformed").message
    ok = {"type": "put", "req_id": 5, "indices": [(1 << 40) + 1], "columns": [{"kind": "object", "name": "o",
                                                                              "values": [nested[0]]}]}
    assert isinstance(raw_wh.ask(ok), p.Ok)  # exactly MAX_DEPTH levels is fine
    still_serves(dock)


# ---------------------------------------------------------------- 3. numbers out of range
NAN, INF = float("nan"), float("inf")
BAD_NUMBERS = [
    _claim(10, timeout_s=NAN), _claim(11, timeout_s=INF), _claim(12, timeout_s=-1.0), _claim(13, timeout_s=1e308),
    _claim(14, n=1 << 62), _claim(15, n=0), _claim(16, min_n=1 << 40), _claim(17, min_version=(1 << 64) - 1),
    {"type": "reserve", "req_id": 18, "client_id": "raw", "n": 1, "timeout_s": NAN},
    {"type": "reserve", "req_id": 19, "client_id": "raw", "n": 1 << 60, "group_size": 1 << 60},
    {"type": "reserve", "req_id": 20, "client_id": "raw", "n": 2, "group_size": 1 << 62},
    {"type": "ack", "req_id": 21, "client_id": "raw", "lease_id": 1, "indices": [-1]},
    {"type": "ack", "req_id": 22, "client_id": "raw", "lease_id": 1 << 63},
    {"type": "hello", "req_id": 23, "client_id": "raw", "protocol": p.PROTOCOL_VERSION, "lease_ttl_s": NAN},
    {"type": "hello", "req_id": 24, "client_id": "raw", "protocol": p.PROTOCOL_VERSION, "lease_ttl_s": 1e308},
    {"type": "release", "req_id": 25, "client_id": "raw", "lease_id": -5},
]


def test_3_non_finite_and_out_of_range_numbers_are_refused(dock: LocalDock, raw_ctl: Raw, raw_wh: Raw) -> None:
    for msg in BAD_NUMBERS:
        reply = _error(raw_ctl.ask(msg), msg["req_id"], "malformed")
        assert "$." in reply.message, reply  # names the field
    for rid, put in enumerate([
        _tensor_put(30, [1 << 62, 1 << 62]), _tensor_put(31, [4], offsets=[1 << 63]),
        _tensor_put(32, [4], frames=[-1]), _tensor_put(33, [1] * (p.MAX_NDIM + 1)),
        _tensor_put(34, [4], index=-1), {**_tensor_put(35, [4]), "versions": [NAN]},
    ], start=30):
        assert isinstance(raw_wh.ask(put, b"\0" * 16), p.ErrorReply), rid
    stats = raw_ctl.ask({"type": "stats", "req_id": 40})
    assert stats.stats["pending_claims"] == 0 and stats.stats["pending_reserves"] == 0  # nothing parked
    still_serves(dock)


# ---------------------------------------------------------------- 4. frames beyond any sensible size
def test_4_oversized_frames_and_too_many_frames() -> None:
    limits = DockLimits(max_message_mib=1, max_header_mib=1)
    with LocalDock(["gen"], capacity=16, limits=limits) as small:
        wh, ctl = Raw(small.warehouse_endpoints[0]), Raw(small.controller_endpoint)
        try:
            # a frame over MAXMSGSIZE: libzmq drops the connection before allocating; no reply
            wh.send(msgpack.packb(_tensor_put(1, [1 << 19])), b"\0" * (2 << 20))
            ctl.send(msgpack.packb({"type": "stats", "req_id": 2, "pad": "x" * (2 << 20)}))
            assert wh.recv(1.0) is None and ctl.recv(0.2) is None
        finally:
            wh.close()
            ctl.close()
        wh = Raw(small.warehouse_endpoints[0])
        try:
            many = [b""] * (p.MAX_FRAMES + 1)
            _error(wh.ask(msgpack.packb(_tensor_put(3, [0])), *many, timeout_s=20), 3, "bad_frames")
        finally:
            wh.close()
        still_serves(small)


# ---------------------------------------------------------------- 5. tensor frames longer than declared
def test_5_frames_must_match_their_header_and_bytes_held_is_real(dock: LocalDock, raw_wh: Raw) -> None:
    long = raw_wh.ask(_tensor_put(1, [4]), b"\0" * (1 << 20))  # 16 bytes declared, 1 MiB sent
    assert "at most 16" in _error(long, 1, "bad_request").message
    _error(raw_wh.ask(_tensor_put(2, [4]), b"\0" * 16, b"\0" * 64), 2, "bad_request")  # an unreferenced frame
    padded = raw_wh.ask(_tensor_put(3, [3], index=(1 << 40) + 7, dtype="uint8"), b"\0" * 16)
    assert isinstance(padded, p.Ok)  # up to the 16-byte alignment padding is allowed

    async def main() -> None:
        async with DockClient(dock.controller_endpoint, request_timeout_s=10) as c:
            with anyio.fail_after(5):  # the refused/unknown puts above are freed asynchronously
                while (await c.server_statistics())["warehouses"][0]["samples"]:
                    await anyio.sleep(0.02)
            base = (await c.server_statistics())["warehouses"][0]["bytes_held"]
            assert base == 0  # nothing stored, nothing counted
            # three small values share one pack frame: 16 + 16 + 4 = 36 bytes, held until all are freed
            values = [torch.zeros(4), torch.zeros(4), torch.zeros(1)]
            idx = await c.add({"x": values})
            held = (await c.server_statistics())["warehouses"][0]["bytes_held"]
            assert held - base == 36
            for i in idx:
                lease = await c.claim("gen", ["x"], 1, timeout=10)
                await c.ack(lease)
                if i != idx[-1]:
                    await anyio.sleep(0.2)
                    assert (await c.server_statistics())["warehouses"][0]["bytes_held"] - base == 36
            with anyio.fail_after(5):
                while (await c.server_statistics())["warehouses"][0]["bytes_held"] != base:
                    await anyio.sleep(0.02)

    anyio.run(main)
    still_serves(dock)


# ---------------------------------------------------------------- 6. per-client state
def test_6_idle_clients_are_forgotten_and_their_number_is_capped() -> None:
    with LocalDock(["gen"], capacity=16, limits=DockLimits(max_clients=4)) as small:
        ctl = Raw(small.controller_endpoint)
        try:
            for k in range(4):
                hello = {"type": "hello", "req_id": k, "client_id": f"c{k}", "protocol": p.PROTOCOL_VERSION,
                         "lease_ttl_s": 0.2}
                assert isinstance(ctl.ask(hello), p.HelloReply)
            refused = _error(ctl.ask(_claim(9, client_id="c-new")), 9, "too_many_clients")
            assert "max_clients" in refused.message
            assert ctl.ask({"type": "stats", "req_id": 10}).stats["clients"] == 4
            # c0..c3 hold nothing: forgotten, once silent for their 0.2 s TTL, when the limit is hit
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                reply = ctl.ask(_claim(11, client_id="c-new"))
                if isinstance(reply, p.Claimed):
                    break
                time.sleep(0.3)
            assert isinstance(reply, p.Claimed), reply
            assert ctl.ask({"type": "stats", "req_id": 12}).stats["clients"] <= 2
        finally:
            ctl.close()
        still_serves(small)


# ---------------------------------------------------------------- 7. warehouse-only messages
def test_7_only_registered_warehouses_may_register_and_announce(dock: LocalDock, raw_ctl: Raw) -> None:
    reserved = raw_ctl.ask({"type": "reserve", "req_id": 1, "client_id": "raw", "n": 1})
    assert isinstance(reserved, p.Reserved)
    fake = {"type": "columns_ready", "warehouse_id": 0, "indices": reserved.indices, "columns": ["x"]}
    _error(raw_ctl.ask(fake), -1, "unauthorized")
    claim = raw_ctl.ask(_claim(2))
    assert isinstance(claim, p.Claimed) and not claim.samples  # the sample is not ready: nothing stored
    impostor = {"type": "warehouse_hello", "req_id": 3, "warehouse_id": 0, "endpoint": "tcp://10.0.0.1:1",
                "protocol": p.PROTOCOL_VERSION, "secret": "guess"}
    _error(raw_ctl.ask(impostor), 3, "unauthorized")
    # even with the run's secret, a registered id cannot be taken over from another connection
    _error(raw_ctl.ask({**impostor, "req_id": 4, "secret": dock._secret}), 4, "already_registered")
    hello = raw_ctl.ask({"type": "hello", "req_id": 5, "client_id": "raw", "protocol": p.PROTOCOL_VERSION})
    assert hello.warehouses == dock.warehouse_endpoints
    still_serves(dock)


# ---------------------------------------------------------------- 8. declared consumer views
def test_8_a_claim_cannot_change_a_declared_consumer_view(dock: LocalDock, raw_ctl: Raw) -> None:
    wrong = _error(raw_ctl.ask(_claim(1, reads=["secret_column"])), 1, "bad_field")
    assert "'gen'" in wrong.message and "reads=['x']" in wrong.message and "declared" in wrong.message
    _error(raw_ctl.ask(_claim(2, whole_groups=True)), 2, "bad_field")
    still_serves(dock)


def test_8_thread_dock_declares_views_too() -> None:
    with ThreadDock(["gen"], capacity=8, views=VIEWS) as td:
        ctl = Raw(td.controller_endpoint)
        try:
            _error(ctl.ask(_claim(1, reads=["y"])), 1, "bad_field")
        finally:
            ctl.close()
        still_serves(td)


# ---------------------------------------------------------------- the client's side of the replies
def test_client_survives_garbage_replies() -> None:
    """A rogue server answering with invalid UTF-8, deep nesting and bytes that are not msgpack: the
    request times out cleanly."""
    rogue = zmq.Context.instance().socket(zmq.ROUTER)
    rogue.setsockopt(zmq.LINGER, 0)
    port = rogue.bind_to_random_port("tcp://127.0.0.1")
    junk = [msgpack.packb({"type": "ok", "req_id": 1, "x": "\u00e9"}).replace("\u00e9".encode(), b"\xff\xfe"),
            b"\x82\xa4type\xa2ok\xa6req_id" + b"\x91" * 100_000 + b"\x01",
            b"\xc1garbage"]  # 0xc1: never used in msgpack

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            async def serve() -> None:
                while True:
                    if rogue.poll(0):
                        ident, *_ = rogue.recv_multipart()
                        for j in junk:
                            rogue.send_multipart([ident, j])
                    await anyio.sleep(0.01)

            tg.start_soon(serve)
            with pytest.raises(DockTimeout):
                async with DockClient(f"tcp://127.0.0.1:{port}", connect_timeout_s=1.0):
                    pass
            tg.cancel_scope.cancel()

    try:
        anyio.run(main)
    finally:
        rogue.close(0)


def test_remote_error_names_the_field_through_the_client(dock: LocalDock) -> None:
    async def main() -> None:
        async with DockClient(dock.controller_endpoint, request_timeout_s=10) as c:
            with pytest.raises(RemoteError, match=r"\$\.n"):
                await c.reserve(p.MAX_ITEMS + 1)

    anyio.run(main)


def test_6_parked_requests_are_capped_and_answered_ones_leave_the_deadline_heap() -> None:
    with LocalDock(["gen", "other"], capacity=16, limits=DockLimits(max_parked=3)) as small:
        ctl = Raw(small.controller_endpoint)
        try:
            for k in range(2):  # claims for a column nobody writes: they stay parked
                ctl.send(msgpack.packb(_claim(k, consumer="other", reads=["never"], timeout_s=30.0)))
            token = ctl.ask({"type": "stats", "req_id": 5, "watch": ["gen"]}).stats["watched"]
            # a stats long poll nothing answers (docs §5.9) takes a parked slot as well
            ctl.send(msgpack.packb({"type": "stats", "req_id": 6, "watch": ["gen"], "seen": token, "timeout_s": 30.0}))
            busy = _error(ctl.ask(_claim(9, consumer="other", reads=["never"], timeout_s=30.0)), 9, "busy")
            assert "max_parked" in busy.message
            busy = _error(ctl.ask({"type": "stats", "req_id": 11, "watch": ["gen"], "seen": token,
                                   "timeout_s": 30.0}), 11, "busy")
            stats = ctl.ask({"type": "stats", "req_id": 10}).stats
            assert stats["pending_claims"] == 2 and stats["pending_stats"] == 1
        finally:
            ctl.close()
        still_serves(small)  # a claim that is answered at once is not parked, so not refused

    # in-process: long-polls answered early must not pile up in the deadline heap until they expire
    from streamrl.dock.controller import ControllerServer

    srv = ControllerServer("tcp://127.0.0.1:0", ["gen"], 4096, 1, secret="s")
    try:
        sent: list[Any] = []
        srv._send = lambda identity, msg: sent.append(msg)  # type: ignore[method-assign]
        for k in range(3000):
            srv.handle([b"id", msgpack.packb(_claim(k, timeout_s=3600.0))])
            idx, _ = srv.state.reserve(1, 1)
            srv.state.columns_ready(idx, ["x"], None, None)
            srv._serve_claims(0)
        assert sum(isinstance(m, p.Claimed) and len(m.samples) == 1 for m in sent) == 3000
        assert len(srv.deadlines) <= 2100, len(srv.deadlines)  # compacted, not 3000 stale entries
    finally:
        srv.sock.close(0)
