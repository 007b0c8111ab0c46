"""CURVE on the dock: a dock started with the run's keys serves only clients holding them.

Real sockets on loopback tcp (the dock as processes, keys in their environment). A stranger (no
keys; another client key pair that knows the server's public key; keys of another run) gets no
answer from the controller or a warehouse: it cannot claim, reserve, put, fetch or register as a
warehouse, and the servers keep serving the run's own client. Every wait is bounded (1-2 s).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anyio
import msgspec
import pytest
import torch
import zmq

from streamrl import curve
from streamrl.curve import RunKeys
from streamrl.dock import protocol as p
from streamrl.dock.client import DockClient
from streamrl.dock.errors import DockTimeout
from streamrl.dock.launch import LocalDock, ThreadDock, is_loopback
from streamrl.dock.warehouse import RegistrationError, WarehouseServer

STRANGER_WAIT_S = 1.5


@pytest.fixture(scope="module")
def keys() -> RunKeys:
    return RunKeys.generate()


@pytest.fixture(scope="module")
def dock(keys: RunKeys) -> Iterator[LocalDock]:
    with LocalDock(["gen"], capacity=64, n_warehouses=1, curve=keys, start_timeout_s=30) as d:
        yield d


def _strangers(keys: RunKeys) -> dict[str, RunKeys | None]:
    other = RunKeys.generate()
    return {
        "no keys": None,
        # knows the run's server public key, but its client key pair is not the run's
        "other client key pair": RunKeys(keys.server_public, other.server_secret, other.client_public,
                                         other.client_secret),
        "another run's keys": other,
    }


class Raw:
    """A bare DEALER (optionally a CURVE client) speaking msgpack by hand, on its own context."""

    def __init__(self, ctx: zmq.Context, endpoint: str, keys: RunKeys | None) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        curve.secure_client(self.sock, keys)
        self.sock.connect(endpoint)

    def send(self, msg: dict[str, Any], *frames: bytes) -> None:
        self.sock.send_multipart([msgspec.msgpack.encode(msg), *frames])

    def recv(self, timeout_s: float) -> Any:
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        return p.decode_reply(self.sock.recv_multipart()[0])

    def close(self) -> None:
        self.sock.close(linger=0)


async def _round_trip(dock: LocalDock | ThreadDock, keys: RunKeys, value: list[int]) -> dict[str, Any]:
    """The run's own client: add -> claim -> fetch -> ack, checked; returns the servers' statistics."""
    async with DockClient(dock.controller_endpoint, curve=keys, request_timeout_s=10, connect_timeout_s=20) as c:
        idx = await c.add({"x": [torch.tensor(value)]})
        lease = await c.claim("gen", ["x"], 1, timeout=10)
        assert lease.indices == idx
        assert (await c.fetch(idx, ["x"]))["x"][0].tolist() == value
        await c.ack(lease)
        return await c.server_statistics()


def test_a_client_with_the_run_keys_works(dock: LocalDock, keys: RunKeys) -> None:
    stats = anyio.run(_round_trip, dock, keys, [1, 2, 3])
    assert stats["controller"]["curve"]["accepted"] >= 1
    assert stats["warehouses"][0]["curve"]["accepted"] >= 1
    assert stats["warehouses"][0]["samples_stored"] >= 1


def test_strangers_get_no_answer_and_the_dock_keeps_serving(dock: LocalDock, keys: RunKeys) -> None:
    before = anyio.run(_round_trip, dock, keys, [4, 5])
    strangers = _strangers(keys)
    ctx = zmq.Context()
    raws: list[Raw] = []
    try:
        # every stranger sends every request at once, to the controller and to the warehouse
        for name, stranger_keys in strangers.items():
            ctl = Raw(ctx, dock.controller_endpoint, stranger_keys)
            wh = Raw(ctx, dock.warehouse_endpoints[0], stranger_keys)
            raws += [ctl, wh]
            ctl.send({"type": "hello", "req_id": 1, "client_id": name, "protocol": p.PROTOCOL_VERSION})
            ctl.send({"type": "reserve", "req_id": 2, "client_id": name, "n": 1, "timeout_s": 0.0})
            ctl.send({"type": "claim", "req_id": 3, "client_id": name, "consumer": "gen", "reads": ["x"], "n": 8})
            ctl.send({"type": "stats", "req_id": 4})
            wh.send({"type": "put", "req_id": 5, "indices": [63], "columns": [
                {"kind": "object", "name": "x", "values": [1]}]})
            wh.send({"type": "get", "req_id": 6, "indices": [0], "columns": ["x"]})
            wh.send({"type": "stats", "req_id": 7})

        async def stranger_client(stranger_keys: RunKeys | None) -> None:
            with pytest.raises(DockTimeout):
                async with DockClient(dock.controller_endpoint, curve=stranger_keys, connect_timeout_s=1.0,
                                      request_timeout_s=1.0):
                    pass

        async def clients() -> None:
            async with anyio.create_task_group() as tg:
                for stranger_keys in strangers.values():
                    tg.start_soon(stranger_client, stranger_keys)

        anyio.run(clients)  # ~1 s, meanwhile the raw requests travel
        for raw in raws:
            assert raw.recv(STRANGER_WAIT_S if raw is raws[0] else 0.05) is None, "a stranger got an answer"

        # a warehouse server without the run's keys cannot register, even knowing the warehouse secret
        for stranger_keys in strangers.values():
            own = zmq.Context()  # its server socket installs a ZAP handler: keep it off the shared context
            wh_srv = WarehouseServer("tcp://127.0.0.1:0", dock.controller_endpoint, 0, 1, secret=dock._secret,
                                     curve=stranger_keys, context=own)
            try:
                with pytest.raises(RegistrationError, match="did not answer"):
                    wh_srv.register(1.0)
            finally:
                wh_srv.sock.close(linger=0)
                wh_srv.ctl.close(linger=0)
                curve.release_context(own)  # stop its ZAP handler (if any), or term() would wait for it
                own.term()
    finally:
        for raw in raws:
            raw.close()
        ctx.term()

    assert dock.alive()
    after = anyio.run(_round_trip, dock, keys, [6, 7, 8])  # the run's client is still served
    ctl_before, ctl_after = before["controller"], after["controller"]
    wh_before, wh_after = before["warehouses"][0], after["warehouses"][0]
    # the stranger that knew the server key completed the CURVE crypto, then the allow-list refused it
    assert ctl_after["curve"]["refused"] > ctl_before["curve"]["refused"]
    assert wh_after["curve"]["refused"] > wh_before["curve"]["refused"]
    # nothing the strangers sent took effect: one reserve and one stored sample per round trip
    assert ctl_after["reserved_total"] == ctl_before["reserved_total"] + 1
    assert wh_after["samples_stored"] == wh_before["samples_stored"] + 1
    assert wh_after["gets"] == wh_before["gets"] + 1
    assert ctl_after["warehouses_registered"] == 1


def test_an_insider_that_is_no_warehouse_cannot_announce_columns(dock: LocalDock, keys: RunKeys) -> None:
    """The run's CURVE keys make a peer a client, not a warehouse: columns_ready needs the registration."""
    ctx = zmq.Context()
    ctl = Raw(ctx, dock.controller_endpoint, keys)
    try:
        ctl.send({"type": "stats", "req_id": 1})
        refused_before = ctl.recv(2.0).stats["refused"]["columns_ready"]
        ctl.send({"type": "reserve", "req_id": 2, "client_id": "insider", "n": 1, "timeout_s": 0.0})
        reserved = ctl.recv(2.0)
        assert isinstance(reserved, p.Reserved), reserved
        ctl.send({"type": "columns_ready", "warehouse_id": 0, "indices": reserved.indices, "columns": ["x"]})
        error = ctl.recv(2.0)
        assert isinstance(error, p.ErrorReply) and (error.req_id, error.code) == (-1, "unauthorized"), error
        ctl.send({"type": "claim", "req_id": 3, "client_id": "insider", "consumer": "gen", "reads": ["x"], "n": 8})
        claimed = ctl.recv(2.0)
        assert isinstance(claimed, p.Claimed) and reserved.indices[0] not in [s.index for s in claimed.samples]
        ctl.send({"type": "stats", "req_id": 4})
        assert ctl.recv(2.0).stats["refused"]["columns_ready"] == refused_before + 1
    finally:
        ctl.close()
        ctx.term()


def test_a_dock_bound_beyond_loopback_needs_keys() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("10.0.0.5") and not is_loopback("0.0.0.0") and not is_loopback("node-3")
    with pytest.raises(ValueError, match="CURVE keys"):
        LocalDock(["gen"], capacity=4, host="10.0.0.5").start()  # refused before any process starts


def test_keyed_thread_docks_each_serve_their_own_run() -> None:
    """ThreadDock servers share a context of their own: two runs' keys in one process, one after another."""
    for _ in range(2):
        keys = RunKeys.generate()
        with ThreadDock(["gen"], capacity=8, n_warehouses=2, curve=keys, start_timeout_s=10) as dock:
            stats = anyio.run(_round_trip, dock, keys, [9])
            assert stats["controller"]["curve"]["accepted"] >= 3  # 2 warehouses + the client

            async def stranger(dock: ThreadDock = dock) -> None:
                with pytest.raises(DockTimeout):
                    async with DockClient(dock.controller_endpoint, curve=RunKeys.generate(), connect_timeout_s=1.0):
                        pass

            anyio.run(stranger)
