"""Authorization inside a run (issue 25), over real sockets with ZAP: an insider holding the
credentials of one role cannot act as another (docs/dock-protocol.md §6.2).

The servers run in threads with a run's own credentials (streamrl.security: PLAIN, and CURVE for
one case), so the role each server reads is the one the peer proved at the handshake. Every wait
has a timeout.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import zmq

from streamrl.dock import protocol as p
from streamrl.dock.authz import AccessDenied, DockPolicy
from streamrl.dock.controller import ConsumerView, ControllerServer
from streamrl.dock.limits import DockLimits
from streamrl.dock.warehouse import WarehouseServer
from streamrl.security import DOCK, RunCredentials, release_context, secure_client

ROLES = ["stage:source", "stage:gen", "stage:train"]


class _Stage(msgspec.Struct):
    name: str
    reads: list[str]
    writes: list[str]
    workers: int = 1


STAGES = [_Stage("source", [], ["prompt", "key"]), _Stage("gen", ["prompt"], ["resp"]),
          _Stage("train", ["prompt", "resp"], [])]
VIEWS = {"gen": ConsumerView(["prompt"]), "train": ConsumerView(["prompt", "resp"])}
CAPACITY = 8
RESERVE_TTL_S = 1


class Peer:
    """A DEALER authenticated as ``role`` with the run's credentials, speaking protocol structs."""

    def __init__(self, ctx: zmq.Context, endpoint: str, role: str, creds: RunCredentials) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        secure_client(self.sock, creds.client(role))
        self.sock.connect(endpoint)
        self.rid = 0

    def ask(self, msg: msgspec.Struct, *frames: bytes, timeout_s: float = 5.0) -> Any:
        self.sock.send_multipart([p.encoder.encode(msg), *frames])
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        return p.reply_decoder.decode(self.sock.recv_multipart()[0])

    def next_id(self) -> int:
        self.rid += 1
        return self.rid


class Run:
    def __init__(self, ctx: zmq.Context, ctl: ControllerServer, wh: WarehouseServer, creds: RunCredentials) -> None:
        self.ctx, self.ctl, self.wh, self.creds = ctx, ctl, wh, creds
        self.peers: list[Peer] = []

    def peer(self, role: str, to: str = "controller") -> Peer:
        peer = Peer(self.ctx, self.ctl.endpoint if to == "controller" else self.wh.endpoint, role, self.creds)
        self.peers.append(peer)
        return peer

    def hello(self, role: str, client_id: str, ttl: float = 10.0) -> tuple[Peer, Any]:
        peer = self.peer(role)
        return peer, peer.ask(p.Hello(peer.next_id(), client_id, p.PROTOCOL_VERSION, ttl))


@pytest.fixture(params=["plain", "curve"])
def run(request: pytest.FixtureRequest) -> Iterator[Run]:
    ctx = zmq.Context()
    creds = RunCredentials.generate(request.param, ROLES)
    policy = DockPolicy.from_stages(STAGES, authenticated=True)
    limits = DockLimits(reserve_ttl_s=RESERVE_TTL_S)
    ctl = ControllerServer("tcp://127.0.0.1:0", ["gen", "train"], CAPACITY, 1, secret="s", limits=limits,
                           views=VIEWS, context=ctx, policy=policy, auth=creds.server())
    threads = [threading.Thread(target=ctl.serve_forever, daemon=True)]
    threads[0].start()
    wh = WarehouseServer("tcp://127.0.0.1:0", ctl.endpoint, 0, 1, secret="s", limits=limits, context=ctx,
                         policy=policy, auth=creds.server(), dock_auth=creds.client(DOCK))
    r = Run(ctx, ctl, wh, creds)
    try:
        wh.register(10.0)
        threads.append(threading.Thread(target=wh.serve_forever, daemon=True))
        threads[1].start()
        yield r
    finally:
        ctl.stop()
        wh.stop()
        for t in threads:
            t.join(timeout=5)
        if len(threads) == 1:
            wh.close()
        for peer in r.peers:
            peer.sock.close(0)
        release_context(ctx)
        ctx.term()


def _error(reply: Any, code: str, *words: str) -> p.ErrorReply:
    assert isinstance(reply, p.ErrorReply), reply
    assert reply.code == code, reply
    for w in words:
        assert w in reply.message, reply.message
    return reply


def _put(peer: Peer, indices: list[int], **columns: list[Any]) -> Any:
    cols = [p.ObjectColumn(name, values) for name, values in columns.items()]
    return peer.ask(p.Put(peer.next_id(), indices, cols))


def _reserve(run: Run, n: int, client_id: str = "src-0", timeout_s: float | None = 0.0) -> Any:
    src = run.peer("stage:source")
    return src.ask(p.Reserve(src.next_id(), client_id, n, 1, timeout_s))


def _stats(run: Run) -> dict[str, Any]:
    launcher = run.peer("launcher")
    reply = launcher.ask(p.StatsRequest(launcher.next_id()))
    assert isinstance(reply, p.Stats), reply
    return reply.stats


def _written_sample(run: Run) -> int:
    """One sample reserved and fully written by the source."""
    reply = _reserve(run, 1)
    assert isinstance(reply, p.Reserved), reply
    (k,) = reply.indices
    assert isinstance(_put(run.peer("stage:source", "warehouse"), [k], prompt=["1+1"], key=[7]), p.Ok)
    return k


def _wait_claim(peer: Peer, client_id: str, consumer: str, reads: list[str]) -> p.Claimed:
    """Claim (long-poll, bounded): the readiness travels warehouse -> controller on its own."""
    reply = peer.ask(p.Claim(peer.next_id(), client_id, consumer, reads, 4, timeout_s=3.0), timeout_s=8.0)
    assert isinstance(reply, p.Claimed) and reply.samples, reply
    return reply


def test_only_a_columns_owner_writes_it(run: Run) -> None:
    k = _written_sample(run)
    # the train stage (and the launcher, and the dock's own role) may not write the gen stage's column
    for role in ("stage:train", "launcher", "dock"):
        _error(_put(run.peer(role, "warehouse"), [k], resp=["poison"]), "forbidden", role, "'resp'", "gen")
    # nothing was stored: the owner's own put still succeeds (write-once not burned), and train reads it
    assert isinstance(_put(run.peer("stage:gen", "warehouse"), [k], resp=["4"]), p.Ok)
    train = run.peer("stage:train")
    lease = _wait_claim(train, "train-0", "train", ["prompt", "resp"])
    assert [s.index for s in lease.samples] == [k]
    got = run.peer("stage:train", "warehouse")
    fetched = got.ask(p.Get(got.next_id(), [k], ["resp"]))
    assert isinstance(fetched, p.Fetched) and fetched.columns[0].values == ["4"]
    # a stage reads only what it declares; the launcher reads no sample data at all
    _error(got.ask(p.Get(got.next_id(), [k], ["key"])), "forbidden", "'key'")
    launcher = run.peer("launcher", "warehouse")
    _error(launcher.ask(p.Get(launcher.next_id(), [k], ["prompt"])), "forbidden")


def test_columns_ready_only_from_the_dock_role_and_with_the_owner_as_writer(run: Run) -> None:
    reply = _reserve(run, 1)
    (k,) = reply.indices
    forged = p.ColumnsReady(0, [k], ["prompt", "key"], writer="stage:source")
    train = run.peer("stage:train")
    _error(train.ask(forged), "forbidden", "dock")
    # even the warehouse's connection cannot announce a column for a role that does not own it
    replies: list[Any] = []
    run.ctl._send = lambda identity, msg: replies.append(msg)  # type: ignore[method-assign]
    wh_identity = next(iter(run.ctl.warehouse_ids))
    run.ctl.handle([wh_identity, p.encoder.encode(p.ColumnsReady(0, [k], ["resp"], writer="stage:train"))], "dock")
    _error(replies[0], "forbidden", "stage:train", "'resp'")
    assert run.ctl.state.samples[k].ready == 0


def test_undeclared_column_names_are_refused_and_the_dock_keeps_serving(run: Run) -> None:
    reply = _reserve(run, 1)
    (k,) = reply.indices
    wh = run.peer("stage:source", "warehouse")
    junk = {f"junk{i}": [i] for i in range(256)}
    _error(_put(wh, [k], **junk), "unknown_column", "'junk0'", "not declared")
    _error(_put(wh, [k], prompt=["x"], key=[1], extra=[2]), "unknown_column", "'extra'")
    gen = run.peer("stage:gen")
    _error(gen.ask(p.Claim(gen.next_id(), "gen-0", "gen", ["junk"], 1)), "bad_field", "'junk'")  # declared reads
    assert run.wh.store.column_names == set()  # nothing stored, no name kept
    assert sorted(_stats(run)["columns"]) == ["key", "prompt", "resp"]
    assert isinstance(_put(wh, [k], prompt=["x"], key=[1]), p.Ok)  # still serving


def test_only_a_consumers_own_stage_claims_acks_and_releases(run: Run) -> None:
    k = _written_sample(run)
    gen = run.peer("stage:gen")
    train = run.peer("stage:train")
    launcher = run.peer("launcher")
    # claiming another consumer's samples: refused for another stage and for the launcher
    _error(train.ask(p.Claim(train.next_id(), "train-0", "gen", ["prompt"], 4)), "forbidden", "stage:train", "'gen'")
    _error(launcher.ask(p.Claim(launcher.next_id(), "l-0", "gen", ["prompt"], 4)), "forbidden", "launcher")
    lease = _wait_claim(gen, "gen-0", "gen", ["prompt"])
    assert [s.index for s in lease.samples] == [k]
    # acking or releasing it from another role, even with the holder's client id and lease id
    _error(train.ask(p.Ack(train.next_id(), "gen-0", lease.lease_id)), "forbidden", "gen-0", "stage:gen")
    _error(train.ask(p.Release(train.next_id(), "gen-0", lease.lease_id)), "forbidden")
    # a heartbeat from another role does not renew the holder's lease
    seen = run.ctl.client_seen["gen-0"]
    train.sock.send(p.encoder.encode(p.Heartbeat("gen-0")))
    time.sleep(0.2)
    assert run.ctl.client_seen["gen-0"] == seen
    assert run.ctl.state.leases[lease.lease_id].indices == {k}  # still the gen worker's, unacked
    assert isinstance(gen.ask(p.Ack(gen.next_id(), "gen-0", lease.lease_id)), p.Ok)


def test_only_producers_reserve_and_close_the_input(run: Run) -> None:
    for role in ("stage:gen", "stage:train", "launcher"):
        peer = run.peer(role)
        _error(peer.ask(p.Reserve(peer.next_id(), f"{role}-0", CAPACITY, 1, 0.0)), "forbidden", role, "reserve")
        _error(peer.ask(p.CloseInput(peer.next_id(), f"{role}-0")), "forbidden", "close_input")
    stats = _stats(run)
    assert stats["in_flight"] == 0 and not stats["input_closed"]
    assert stats["refused"]["forbidden"] == 6
    assert isinstance(_reserve(run, 2), p.Reserved)


def test_reserved_samples_never_written_expire_and_their_capacity_returns(run: Run) -> None:
    squat = _reserve(run, CAPACITY)
    assert isinstance(squat, p.Reserved)
    _error(_reserve(run, 1), "full")
    k = squat.indices[0]
    # the creator writing only part of its declared columns (none any consumer can claim on) does
    # not make a sample written
    assert isinstance(_put(run.peer("stage:source", "warehouse"), [k], key=[1]), p.Ok)
    t0 = time.monotonic()
    # a waiting reserve is served once the unwritten ones expire (RESERVE_TTL_S), not never
    again = _reserve(run, CAPACITY, timeout_s=RESERVE_TTL_S + 4.0)
    assert isinstance(again, p.Reserved), again
    assert RESERVE_TTL_S - 0.2 <= time.monotonic() - t0 <= RESERVE_TTL_S + 3.0
    assert not set(again.indices) & set(squat.indices)
    stats = _stats(run)
    assert stats["reservations_expired"] == CAPACITY and stats["in_flight"] == CAPACITY
    deadline = time.monotonic() + 3.0
    while k in run.wh.store.rows and time.monotonic() < deadline:  # the warehouse is told to drop it
        time.sleep(0.02)
    assert k not in run.wh.store.rows


def test_a_role_squatting_client_slots_does_not_block_another_role(run: Run) -> None:
    limit = DockPolicy.from_stages(STAGES).clients["stage:gen"]
    for i in range(limit):
        _, reply = run.hello("stage:gen", f"squat-{i}", ttl=3600.0)
        assert isinstance(reply, p.HelloReply), reply
    _, reply = run.hello("stage:gen", "squat-more", ttl=3600.0)
    _error(reply, "too_many_clients", "stage:gen")
    # every other role still gets its clients
    for role in ("stage:train", "stage:source", "launcher"):
        _, reply = run.hello(role, f"{role}-worker")
        assert isinstance(reply, p.HelloReply), (role, reply)
    # and a client id is bound to its first role: another role cannot take it over
    _, reply = run.hello("stage:train", "squat-0")
    _error(reply, "forbidden", "squat-0", "stage:gen")
    assert _stats(run)["clients_per_role"]["stage:gen"] == limit


def test_a_message_without_a_role_is_refused_on_an_authenticated_dock(run: Run) -> None:
    replies: list[bytes] = []
    run.ctl._send = lambda identity, msg: replies.append(msg)  # type: ignore[method-assign]
    run.ctl.handle([b"x", p.encoder.encode(p.StatsRequest(5))], None)
    (reply,) = replies
    _error(reply, "unauthenticated")


def test_the_policy_of_the_grpo_pipeline() -> None:
    """What the launcher hands the dock for pipelines/grpo.yaml (launch_backends.dock_policy)."""
    from pathlib import Path

    import yaml

    from streamrl.runtime.pipeline import PipelineSpec

    raw = yaml.safe_load((Path(__file__).resolve().parents[2] / "pipelines" / "grpo.yaml").read_text())
    spec = msgspec.convert(raw, PipelineSpec)
    policy = DockPolicy.from_stages(spec.stages)
    assert policy.columns["advantage"] == "advantage" and policy.columns["sample_key"] == "source"
    assert policy.columns["response_ids"] == "generate" and "train" not in policy.columns.values()
    assert policy.producers == ["source"] and not policy.authenticated
    assert policy.clients["stage:train"] == 1 + 4 and policy.clients["launcher"] == 8
    policy.check_write("stage:advantage", ["advantage"])
    with pytest.raises(AccessDenied, match="only its owner, stage 'advantage'"):
        policy.check_write("stage:score", ["advantage"])
