"""Authentication on the dock, both mechanisms: a dock started with the run's credentials serves
only clients that prove one of the run's roles, and each connection's ZAP User-Id is that role.

Real sockets on loopback tcp, the dock as processes through its real launch path (LocalDock, what
``resources.launch: processes`` starts; credentials in the servers' environment). A stranger (no
credentials; a role the run does not have; a wrong password or a key pair that is not the role's;
another run's credentials) gets no answer from the controller or a warehouse: it cannot claim,
reserve, put, fetch or register as a warehouse, and the servers keep serving the run's clients.
Every wait is bounded (1-2 s).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import anyio
import msgspec
import pytest
import torch
import zmq

from ops.fuzz.servers import rss_mib
from ops.fuzz.zmtp import send_endless_message
from streamrl import security
from streamrl.dock import protocol as p
from streamrl.dock.client import DockClient
from streamrl.dock.errors import DockTimeout
from streamrl.dock.launch import LocalDock, ThreadDock, is_loopback
from streamrl.dock.warehouse import RegistrationError, WarehouseServer
from streamrl.security import ClientAuth, RunCredentials, ServerAuth, peer_role, stage_role

STRANGER_WAIT_S = 1.5
GEN = stage_role("gen")
MECHANISMS = ["plain", "curve"]


@pytest.fixture(scope="module", params=MECHANISMS)
def creds(request: pytest.FixtureRequest) -> RunCredentials:
    return RunCredentials.generate(request.param, [GEN])


@pytest.fixture(scope="module")
def dock(creds: RunCredentials) -> Iterator[LocalDock]:
    with LocalDock(["gen"], capacity=64, n_warehouses=1, auth=creds, start_timeout_s=30) as d:
        yield d


def strangers(creds: RunCredentials) -> dict[str, ClientAuth | None]:
    """Clients that must be refused, each of a kind the ZAP handler sees (it counts the refusal)
    or one that fails the handshake before it (no credentials, another run's server key)."""
    other = RunCredentials.generate(creds.mechanism, [GEN, "stage:intruder"])
    out: dict[str, ClientAuth | None] = {"no credentials": None, "another run's credentials": other.client(GEN)}
    if creds.mechanism == "plain":
        out["wrong password"] = ClientAuth("plain", GEN, password="not-the-password")
        out["a role the run does not have"] = ClientAuth("plain", "stage:intruder", password="x")
    else:  # knows the run's server public key (no secret), but not the role's key pair
        mine = other.client(GEN)
        out["a key pair that is not the role's"] = ClientAuth("curve", GEN, public=mine.public, secret=mine.secret,
                                                              server_public=creds.server_public)
    return out


class Raw:
    """A bare DEALER (optionally presenting credentials) speaking msgpack by hand, on its own context."""

    def __init__(self, ctx: zmq.Context, endpoint: str, auth: ClientAuth | None) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        security.secure_client(self.sock, auth)
        self.sock.connect(endpoint)

    def send(self, msg: dict[str, Any], *frames: bytes) -> None:
        """Queue ``msg``; dropped when the server already refused the handshake. After a refused
        PLAIN handshake libzmq (4.3) ends the connection and does not reconnect: the DEALER has no
        peer left, and a blocking send would wait for one forever (CI hung here once)."""
        with contextlib.suppress(zmq.Again):
            self.sock.send_multipart([msgspec.msgpack.encode(msg), *frames], flags=zmq.NOBLOCK)

    def recv(self, timeout_s: float) -> Any:
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        return p.decode_reply(self.sock.recv_multipart()[0])

    def close(self) -> None:
        self.sock.close(linger=0)


async def _round_trip(dock: LocalDock | ThreadDock, auth: ClientAuth, value: list[int]) -> dict[str, Any]:
    """The run's own client: add -> claim -> fetch -> ack, checked; returns the servers' statistics."""
    async with DockClient(dock.controller_endpoint, auth=auth, request_timeout_s=10, connect_timeout_s=20) as c:
        idx = await c.add({"x": [torch.tensor(value)]})
        lease = await c.claim("gen", ["x"], 1, timeout=10)
        assert lease.indices == idx
        assert (await c.fetch(idx, ["x"]))["x"][0].tolist() == value
        await c.ack(lease)
        return await c.server_statistics()


def test_a_client_with_its_roles_credentials_works(dock: LocalDock, creds: RunCredentials) -> None:
    stats = anyio.run(_round_trip, dock, creds.client(GEN), [1, 2, 3])
    assert stats["controller"]["auth"]["accepted"] >= 2  # the warehouse (role dock) and this client
    assert stats["warehouses"][0]["auth"]["accepted"] >= 1
    assert stats["warehouses"][0]["samples_stored"] >= 1
    # the launcher's role too (status page, end-of-run statistics)
    anyio.run(_round_trip, dock, creds.client(security.LAUNCHER), [0])


def test_strangers_get_no_answer_and_the_dock_keeps_serving(dock: LocalDock, creds: RunCredentials) -> None:
    own = creds.client(GEN)
    before = anyio.run(_round_trip, dock, own, [4, 5])
    others = strangers(creds)
    ctx = zmq.Context()
    raws: list[Raw] = []
    try:
        # every stranger sends every request at once, to the controller and to the warehouse
        for name, auth in others.items():
            ctl = Raw(ctx, dock.controller_endpoint, auth)
            wh = Raw(ctx, dock.warehouse_endpoints[0], auth)
            raws += [ctl, wh]
            ctl.send({"type": "hello", "req_id": 1, "client_id": name, "protocol": p.PROTOCOL_VERSION})
            ctl.send({"type": "reserve", "req_id": 2, "client_id": name, "n": 1, "timeout_s": 0.0})
            ctl.send({"type": "claim", "req_id": 3, "client_id": name, "consumer": "gen", "reads": ["x"], "n": 8})
            ctl.send({"type": "stats", "req_id": 4})
            wh.send({"type": "put", "req_id": 5, "indices": [63], "columns": [
                {"kind": "object", "name": "x", "values": [1]}]})
            wh.send({"type": "get", "req_id": 6, "indices": [0], "columns": ["x"]})
            wh.send({"type": "stats", "req_id": 7})

        async def stranger_client(auth: ClientAuth | None) -> None:
            with pytest.raises(DockTimeout):
                async with DockClient(dock.controller_endpoint, auth=auth, connect_timeout_s=1.0,
                                      request_timeout_s=1.0):
                    pass

        async def clients() -> None:
            async with anyio.create_task_group() as tg:
                for auth in others.values():
                    tg.start_soon(stranger_client, auth)

        anyio.run(clients)  # ~1 s, meanwhile the raw requests travel
        for raw in raws:
            assert raw.recv(STRANGER_WAIT_S if raw is raws[0] else 0.05) is None, "a stranger got an answer"

        # a warehouse server without the run's dock credentials cannot register, even knowing the secret
        for auth in others.values():
            own_ctx = zmq.Context()  # its server socket installs a ZAP handler: keep it off the shared context
            wh_srv = WarehouseServer("tcp://127.0.0.1:0", dock.controller_endpoint, 0, 1, secret=dock._secret,
                                     dock_auth=auth, context=own_ctx)
            try:
                with pytest.raises(RegistrationError, match="did not answer"):
                    wh_srv.register(1.0)
            finally:
                wh_srv.close()
                security.release_context(own_ctx)
                own_ctx.term()
    finally:
        for raw in raws:
            raw.close()
        ctx.term()

    assert dock.alive()
    after = anyio.run(_round_trip, dock, own, [6, 7, 8])  # the run's client is still served
    ctl_before, ctl_after = before["controller"], after["controller"]
    wh_before, wh_after = before["warehouses"][0], after["warehouses"][0]
    # the strangers whose handshake reached the ZAP handler were refused there, and counted
    assert ctl_after["auth"]["refused"] > ctl_before["auth"]["refused"]
    assert wh_after["auth"]["refused"] > wh_before["auth"]["refused"]
    # nothing the strangers sent took effect: one reserve and one stored sample per round trip
    assert ctl_after["reserved_total"] == ctl_before["reserved_total"] + 1
    assert wh_after["samples_stored"] == wh_before["samples_stored"] + 1
    assert wh_after["gets"] == wh_before["gets"] + 1
    assert ctl_after["warehouses_registered"] == 1


def test_an_insider_that_is_no_warehouse_cannot_announce_columns(dock: LocalDock, creds: RunCredentials) -> None:
    """A stage's credentials make a peer a client, not a warehouse: columns_ready needs the registration."""
    ctx = zmq.Context()
    ctl = Raw(ctx, dock.controller_endpoint, creds.client(GEN))
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


def test_a_dock_bound_beyond_loopback_needs_curve() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("10.0.0.5") and not is_loopback("0.0.0.0") and not is_loopback("node-3")
    for auth in (None, RunCredentials.generate("plain", [GEN])):  # PLAIN sends passwords in clear: not there
        with pytest.raises(ValueError, match="CURVE credentials"):
            LocalDock(["gen"], capacity=4, host="10.0.0.5", auth=auth).start()  # refused before any process starts


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_thread_docks_each_serve_their_own_run(mechanism: str) -> None:
    """ThreadDock servers share a context of their own: two runs' credentials in one process, one after another."""
    for _ in range(2):
        creds = RunCredentials.generate(mechanism, [GEN])  # type: ignore[arg-type]
        with ThreadDock(["gen"], capacity=8, n_warehouses=2, auth=creds, start_timeout_s=10) as dock:
            stats = anyio.run(_round_trip, dock, creds.client(GEN), [9])
            assert stats["controller"]["auth"]["accepted"] >= 3  # 2 warehouses + the client

            async def stranger(dock: ThreadDock = dock) -> None:
                with pytest.raises(DockTimeout):
                    other = RunCredentials.generate(mechanism, [GEN])  # type: ignore[arg-type]
                    async with DockClient(dock.controller_endpoint, auth=other.client(GEN), connect_timeout_s=1.0):
                        pass

            anyio.run(stranger)


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_peer_role_is_the_role_each_client_proved(mechanism: str) -> None:
    """The contract authorization builds on: on a secured server socket, the User-Id of every
    connection is the role string. Several roles in one process (``inprocess`` runs): each client
    socket presents its own, all on one context whose handler serves the run's servers."""
    creds = RunCredentials.generate(mechanism, [GEN, stage_role("train")])  # type: ignore[arg-type]
    ctx = zmq.Context()
    server = ctx.socket(zmq.ROUTER)
    server.linger = 0
    handler = security.secure_server(server, creds.server())
    assert handler is not None and security.secure_server(ctx.socket(zmq.ROUTER), creds.server()) is handler
    server.bind("tcp://127.0.0.1:0")
    endpoint = server.getsockopt_string(zmq.LAST_ENDPOINT)
    clients = []
    try:
        for role in (security.LAUNCHER, security.DOCK, GEN, stage_role("train")):
            client = ctx.socket(zmq.DEALER)
            client.linger = 0
            security.secure_client(client, creds.client(role))
            client.connect(endpoint)
            clients.append(client)
            client.send(role.encode())
            assert server.poll(5000), f"role {role} got no connection through"
            _identity, body = server.recv_multipart(copy=False)
            assert peer_role(body) == role == body.bytes.decode()
        with pytest.raises(ValueError, match="two runs"):
            security.secure_server(ctx.socket(zmq.ROUTER), RunCredentials.generate(mechanism, []).server())  # type: ignore[arg-type]
    finally:
        for client in clients:
            client.close(linger=0)
        server.close(linger=0)
        security.release_context(ctx)
        ctx.destroy(linger=0)
    assert handler.accepted == 4 and handler.refused == 0


def test_no_secret_in_a_repr_and_each_worker_holds_its_own_role_only() -> None:
    for mechanism in MECHANISMS:
        creds = RunCredentials.generate(mechanism, [GEN])  # type: ignore[arg-type]
        client, server = creds.client(GEN), creds.server()
        secrets = [s for s in (creds.run_secret, client.password, client.secret, server.server_secret,
                               *(k[1] for k in creds.keys.values())) if s]
        text = " ".join([repr(creds), str(creds), repr(client), repr(server), repr({"gen": client})])
        assert secrets and not any(s in text for s in secrets)
        # a server verifies every role without holding any role's secret
        assert not any(s in server.to_env() for s in (creds.run_secret, client.password, client.secret) if s)
        assert ClientAuth.from_env({security.CLIENT_ENV: client.to_env()}) == client
        assert ServerAuth.from_env({security.SERVER_ENV: server.to_env()}) == server
        with pytest.raises(KeyError, match="no credentials for role 'stage:other'"):
            creds.client("stage:other")



def test_a_strangers_endless_multipart_message_never_gets_in(dock: LocalDock) -> None:
    """libzmq bounds no message's frame count (docs/reliability.md, "Multipart floods"); the run's
    authentication is what holds, PLAIN (a launched local run's default) as CURVE: a stranger's
    greeting is refused before any frame is read, so the controller and warehouse stay flat."""
    before = {pid: rss_mib(pid) for pid in dock.pids}
    for endpoint in [dock.controller_endpoint, *dock.warehouse_endpoints]:
        host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
        for _ in range(10):
            sent, closed = send_endless_message(host, int(port), 16 << 20, timeout_s=10)
            assert closed and sent == 0, f"a stranger got {sent} bytes of frames into {endpoint}"
    grown = {pid: rss_mib(pid) - mib for pid, mib in before.items()}
    assert all(g < 16 for g in grown.values()), f"MiB grown per dock server under refused floods: {grown}"
    assert dock.alive()
