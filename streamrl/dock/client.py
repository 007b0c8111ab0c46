"""The dock's async client (anyio on the asyncio backend; its sockets served by the event loop).

One DEALER to the controller and one per warehouse, each a :class:`~streamrl.loop_socket.LoopSocket`
whose loop callback routes replies to the waiting requests by request id, so any number of tasks
can share one client. Every request has a timeout (:class:`DockTimeout`), and each socket has a
bound on requests in flight.

Usage::

    async with DockClient("tcp://127.0.0.1:5555") as dock:
        idx = await dock.add({"prompt_ids": [t0, t1]}, group_size=2)
        lease = await dock.claim("generate", reads=["prompt_ids"], n=8, timeout=5)
        cols = await dock.fetch(lease.indices, ["prompt_ids"])
        await dock.put(lease.indices, {"response_ids": [...]}, versions=[...], lengths=[...])
        await dock.ack(lease)
"""

from __future__ import annotations

import asyncio
import itertools
import math
import os
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
import msgspec

# The client hands out tensors (the codec's views of the fetched frames): torch loads with the
# client, not inside the first fetch, where its seconds of import would count against the lease.
import torch  # noqa: F401
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from streamrl import wire
from streamrl.dock import protocol as p
from streamrl.dock.codec import decode_columns, encode_columns
from streamrl.dock.errors import (
    DockError,
    DockFull,
    DockTimeout,
    EndOfStream,
    NothingToClaim,
    RemoteError,
    WireFormatError,
)
from streamrl.dock.limits import DockLimits
from streamrl.loop_socket import LoopSocket
from streamrl.metrics.trace import tracer
from streamrl.security import ClientAuth, secure_client

_R = TypeVar("_R")

LONG_POLL_S = 1.0  # a waiting claim re-asks this often, so no single request outlives its timeout


class SampleList:
    """Per-sample views over ``self.samples`` (SampleInfo), shared by leases and stage batches."""

    samples: list[p.SampleInfo]

    @property
    def indices(self) -> list[int]:
        return [s.index for s in self.samples]

    @property
    def groups(self) -> list[int]:
        return [s.group for s in self.samples]

    @property
    def versions(self) -> list[int]:
        return [s.version for s in self.samples]

    @property
    def lengths(self) -> list[int]:
        return [s.length for s in self.samples]

    @property
    def returned(self) -> list[int]:
        """Per sample: how often this consumer had it before and gave it back unacked (a worker that
        died, or a release); 0 on a first delivery."""
        return [s.returned for s in self.samples]

    def __len__(self) -> int:
        return len(self.samples)


@dataclass
class Lease(SampleList):
    """Samples claimed for one consumer. Ack them (or release them) before the lease TTL runs out."""

    lease_id: int
    consumer: str
    samples: list[p.SampleInfo]
    dropped_stale: int = 0


@dataclass
class MicroBatch:
    """A lease plus the fetched columns (name -> one value per sample, in lease order)."""

    lease: Lease
    columns: dict[str, list[Any]]

    @property
    def indices(self) -> list[int]:
        return self.lease.indices

    def __len__(self) -> int:
        return len(self.lease)


@dataclass
class _Conn:
    name: str
    link: LoopSocket
    limit: anyio.Semaphore
    pending: dict[int, asyncio.Future[tuple[Any, list[zmq.Frame]]]] = field(default_factory=dict)
    # each request in flight and its tensor frames, by req_id: resent (marked ``again``) after a link
    # reset; a server that already had it answers from the reply it kept, never applying it twice (docs §5.8)
    sent: dict[int, tuple[Any, Sequence[Any]]] = field(default_factory=dict)
    monitor: LoopSocket | None = None  # the link monitor's reading end (_watch_link)


class DockClient:
    def __init__(
        self,
        controller: str,
        *,
        client_id: str | None = None,
        lease_ttl_s: float = 10.0,
        request_timeout_s: float = 30.0,
        connect_timeout_s: float = 60.0,
        max_in_flight: int = 64,
        max_message_mib: int = DockLimits.max_message_mib,
        context: zmq.asyncio.Context | None = None,
        auth: ClientAuth | None = None,
        home_warehouse: int | None = None,
    ) -> None:
        """``auth``: the credentials of the role this client acts as (streamrl.security); every
        socket it opens presents them, and a launched run's dock admits no socket without them. ``home_warehouse``: the warehouse on this
        client's node; reserves allocate samples it owns (when the dock's block > 1) and the
        controller counts claims of samples stored elsewhere as remote."""
        if home_warehouse is not None and not 0 <= home_warehouse <= 65_535:
            raise ValueError(f"home_warehouse must be a warehouse id in [0, 65535], got {home_warehouse}")
        if not p.MIN_TTL_S <= lease_ttl_s <= p.MAX_TTL_S:
            raise ValueError(f"lease_ttl_s must be in [{p.MIN_TTL_S}, {p.MAX_TTL_S}] seconds, got {lease_ttl_s}")
        if not request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be positive (seconds), got {request_timeout_s}")
        self.max_message_bytes = DockLimits(max_message_mib=max_message_mib).max_message_bytes
        self.controller_endpoint = controller
        self.client_id = client_id or f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.lease_ttl_s = lease_ttl_s
        self.request_timeout_s = request_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_in_flight = max_in_flight
        self.auth = auth
        self.home_warehouse = home_warehouse
        self.block = 1  # the dock's ownership block, from hello_reply
        self._ctx = context or zmq.asyncio.Context.instance()
        self._req_ids = itertools.count(1)
        self._conns: list[_Conn] = []
        self._ctl: _Conn | None = None
        self._warehouses: list[_Conn] = []
        self._tg: anyio.abc.TaskGroup | None = None
        self.consumers: list[str] = []
        self.capacity = 0
        self._leases: dict[int, Lease] = {}
        self._partly_acked: dict[int, set[int]] = {}  # lease id -> indices acked so far, for a lease acked in parts
        # one put, ack or release at a time: a worker that stops gives back its prefetched batch from
        # one task while another may still put or give back the batch it ran, and the spans of the
        # trace's reserve/put/ack track must nest (docs/observability.md). fast_acquire: an uncontended
        # acquire does not yield to the event loop (the hot path: one put a batch)
        self._out_lane = anyio.Lock(fast_acquire=True)
        # claims this client stopped waiting for (cancelled, timed out): if the controller grants
        # one anyway, the late reply is released at once instead of holding samples until the TTL
        self._abandoned_claims: set[int] = set()
        # how long aclose waits for those replies, to release what they were granted: a worker that
        # stops with the run sets 0 (nobody claims after it; the controller goes with the run)
        self.abandoned_claims_wait_s = 1.0
        self._counters = dict.fromkeys(("requests", "timeouts", "errors", "bytes_sent", "bytes_received",
                                        "reconnects", "resent"), 0)

    # ------------------------------------------------------------------ lifecycle
    async def __aenter__(self) -> DockClient:
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        try:
            self._ctl = self._open("controller", self.controller_endpoint)
            hello = p.Hello(self._next_id(), self.client_id, p.PROTOCOL_VERSION, self.lease_ttl_s,
                            self.home_warehouse)
            reply, _ = await self._request(self._ctl, hello, timeout=self.connect_timeout_s)
            reply = _expect(reply, p.HelloReply, "controller")
            if reply.protocol != p.PROTOCOL_VERSION:
                raise DockError(f"the dock speaks protocol {reply.protocol}, this client {p.PROTOCOL_VERSION}: "
                                "upgrade one side")
            self.consumers, self.capacity, self.block = reply.consumers, reply.capacity, reply.block
            self._warehouses = [self._open(f"warehouse {i} ({ep})", ep) for i, ep in enumerate(reply.warehouses)]
            self._tg.start_soon(self._heartbeat)
        except BaseException:
            await self.aclose()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._tg is not None and self._abandoned_claims and self.abandoned_claims_wait_s > 0:
            # give granted-but-abandoned claims a moment to come back, so they are released now
            with anyio.CancelScope(shield=True), anyio.move_on_after(self.abandoned_claims_wait_s):
                while self._abandoned_claims:
                    await anyio.sleep(0.005)
        if self._tg is not None:
            self._tg.cancel_scope.cancel()
            tg, self._tg = self._tg, None
            await tg.__aexit__(None, None, None)
        for conn in self._conns:
            for fut in conn.pending.values():
                if not fut.done():
                    fut.set_exception(DockError("client closed"))
            _stop_monitor(conn)  # before the close: a lingering socket must not report to a closed reader
            # a short linger: the last messages queued (a release of an abandoned claim) still leave;
            # the close itself never blocks (libzmq flushes in its I/O thread)
            conn.link.close(linger=500)
        self._conns.clear()

    def _open(self, name: str, endpoint: str) -> _Conn:
        # a plain socket of the (asyncio) context, so that the context's destroy still closes it
        sock = self._ctx.socket(zmq.DEALER, socket_class=zmq.Socket)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 1000)  # finite; requests in flight are bounded well below this
        sock.setsockopt(zmq.RCVHWM, 1000)
        # a server (or impostor) announcing a frame beyond this is disconnected before we allocate it
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        secure_client(sock, self.auth)  # no-op without credentials (a bare dock of a test or benchmark)
        # the same routing id across reconnects (ROUTER_HANDOVER on the servers): replies to requests
        # in flight when a link resets still reach this socket over the new connection
        wire.fixed_routing_id(sock, b"dc-")
        wire.watch_link(sock)
        # a unique address: pyzmq's default names it by fd, which a socket closed (lingering) may still hold
        address = f"inproc://dock-link-{uuid.uuid4().hex}"
        sock.monitor(address, zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        monitor_sock = self._ctx.socket(zmq.PAIR, socket_class=zmq.Socket)
        monitor_sock.connect(address)
        monitor = LoopSocket(monitor_sock, copy=True)
        sock.connect(endpoint)
        conn = _Conn(name, LoopSocket(sock), anyio.Semaphore(self.max_in_flight), monitor=monitor)
        conn.link.on_message = lambda frames: self._on_reply(conn, frames)
        self._conns.append(conn)
        assert self._tg is not None
        self._tg.start_soon(self._watch_link, conn, monitor)
        return conn

    async def _watch_link(self, conn: _Conn, monitor: LoopSocket) -> None:
        """After a link reset, resend every request in flight on it: the request or its reply may
        have died with the connection, and the server answers one it already had from its kept reply."""
        lost = False
        try:
            while True:
                event = parse_monitor_message(await monitor.recv())["event"]
                if event == zmq.EVENT_DISCONNECTED:
                    lost = True
                elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED and lost:
                    lost = False
                    self._counters["reconnects"] += 1
                    for msg, frames in list(conn.sent.values()):
                        self._counters["resent"] += 1
                        again = msgspec.structs.replace(msg, again=True)
                        conn.link.send([p.encoder.encode(again), *frames])
        finally:
            _stop_monitor(conn)

    def _on_reply(self, conn: _Conn, frames: list[zmq.Frame]) -> None:
        """A message on ``conn`` (the loop's callback): the reply goes to the request waiting for it."""
        msg = p.decode_reply(frames[0].bytes) if len(frames) <= p.MAX_FRAMES + 1 else None
        if msg is None:
            self._counters["errors"] += 1
            return  # not a reply we can route: drop it, the request will time out
        self._counters["bytes_received"] += sum(len(f) for f in frames)
        fut = conn.pending.pop(msg.req_id, None)
        if fut is not None and not fut.done():
            fut.set_result((msg, frames[1:]))
            return
        # Nobody waits for this reply any more: the request timed out or was cancelled (its future
        # is then done, and its task may not have run its clean-up yet: the cancel and this reply
        # can come in one turn of the loop, this callback first; the clean-up then finds the
        # request no longer pending and leaves its release to us), or this is the second answer
        # to a request resent after a link reset (its lease is in use: no future, not abandoned)
        abandoned = fut is not None or msg.req_id in self._abandoned_claims
        self._abandoned_claims.discard(msg.req_id)
        if abandoned and isinstance(msg, p.Claimed) and msg.samples:
            # granted after its requester gave up: give the samples back now, not at the TTL
            release = p.Release(self._next_id(), self.client_id, msg.lease_id)
            conn.link.send([p.encoder.encode(release)])  # its own reply is dropped here too

    async def _heartbeat(self) -> None:
        assert self._ctl is not None
        while True:
            await anyio.sleep(self.lease_ttl_s / 4)
            if self._leases:
                self._ctl.link.send([p.encoder.encode(p.Heartbeat(self.client_id))])

    def _next_id(self) -> int:
        return next(self._req_ids)

    async def _request(
        self, conn: _Conn, msg: Any, frames: Sequence[Any] = (), timeout: float | None = None
    ) -> tuple[Any, list[zmq.Frame]]:
        timeout = self.request_timeout_s if timeout is None else timeout
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[tuple[Any, list[zmq.Frame]]] = loop.create_future()
        rid = msg.req_id
        # the bound on requests in flight: a free slot is taken without a checkpoint (most requests)
        try:
            conn.limit.acquire_nowait()
        except anyio.WouldBlock:
            await conn.limit.acquire()
        # the deadline is a timer on the reply's future rather than a cancel scope around the wait:
        # the same TimeoutError, a fraction of the CPU (every dock request has one)
        timer = loop.call_later(timeout, _expire, fut) if timeout < math.inf else None
        try:
            conn.pending[rid] = fut
            conn.sent[rid] = (msg, frames)
            self._counters["requests"] += 1
            # zero-copy frames: libzmq holds the buffers until they have left
            conn.link.send([p.encoder.encode(msg), *frames])
            self._counters["bytes_sent"] += sum(memoryview(f).nbytes for f in frames)
            reply, data = await fut
        except BaseException as exc:
            if isinstance(msg, p.Claim):
                if fut.done() and not fut.cancelled() and fut.exception() is None:
                    # granted, but this task was cancelled before it could take the lease
                    granted = fut.result()[0]
                    if isinstance(granted, p.Claimed) and granted.samples:
                        release = p.Release(self._next_id(), self.client_id, granted.lease_id)
                        conn.link.send([p.encoder.encode(release)])  # reply dropped
                elif rid in conn.pending:
                    self._abandoned_claims.add(rid)  # reply still to come: _on_reply releases it
            if not isinstance(exc, TimeoutError):
                raise
            self._counters["timeouts"] += 1
            raise DockTimeout(
                f"{conn.name} did not answer {type(msg).__name__} within {timeout:.1f} s "
                "(is the dock running? is the endpoint right?)"
            ) from None
        finally:
            if timer is not None:
                timer.cancel()
            conn.pending.pop(rid, None)
            conn.sent.pop(rid, None)
            conn.limit.release()
        if isinstance(reply, p.ErrorReply):
            self._counters["errors"] += 1
            if reply.code == "full":
                raise DockFull(reply.message)
            if reply.code == "timeout":
                raise DockTimeout(f"{conn.name}: {reply.message}")
            raise RemoteError(conn.name, reply.code, reply.message)
        return reply, data

    def _owner(self, index: int) -> int:
        return p.owner(index, len(self._warehouses), self.block)

    def _split(self, indices: Sequence[int]) -> dict[int, list[int]]:
        """Positions in ``indices`` per owning warehouse."""
        if len(self._warehouses) == 1:  # one warehouse owns every sample
            return {0: list(range(len(indices)))}
        by_wh: dict[int, list[int]] = {}
        for pos, i in enumerate(indices):
            by_wh.setdefault(self._owner(i), []).append(pos)
        return by_wh

    # ------------------------------------------------------------------ producing
    async def reserve(self, n: int, group_size: int = 1, *, timeout: float | None = None) -> list[int]:
        """New sample indices, waiting while the dock is at capacity (backpressure). With a
        ``home_warehouse`` (and a dock block > 1) they are all stored on that warehouse."""
        assert self._ctl is not None
        req = p.Reserve(self._next_id(), self.client_id, n, group_size, timeout, self.home_warehouse)
        wait = (timeout if timeout is not None else math.inf) + self.request_timeout_s
        with tracer().span("reserve", "dock_out", "dock", samples=n):  # waits while the dock is full
            reply, _ = await self._request(self._ctl, req, timeout=wait)
        return list(_expect(reply, p.Reserved, "controller").indices)

    async def reserve_nowait(self, n: int, group_size: int = 1) -> list[int]:
        """Like :meth:`reserve` but raises :class:`DockFull` at once instead of waiting (one round trip)."""
        assert self._ctl is not None
        req = p.Reserve(self._next_id(), self.client_id, n, group_size, 0.0, self.home_warehouse)
        reply, _ = await self._request(self._ctl, req)
        return list(_expect(reply, p.Reserved, "controller").indices)

    async def put(
        self,
        indices: Sequence[int],
        columns: Mapping[str, Sequence[Any]],
        *,
        versions: Sequence[int] | None = None,
        lengths: Sequence[int] | None = None,
        ack: Lease | None = None,
    ) -> None:
        """Write columns of existing samples, straight to their warehouses, in parallel.

        Returns once every warehouse stored its part and the controller has its columns ready;
        only then may the caller modify the tensors it passed (they are sent zero-copy, see codec
        rule 1). ``ack``: the lease these samples came in, acked for them with the put (the
        warehouse forwards the ack with the columns' readiness: one message less than
        :meth:`ack` after the put, docs/dock-protocol.md §5.7).
        """
        n = len(indices)
        for name, vals in columns.items():
            if len(vals) != n:
                raise ValueError(f"column {name!r} has {len(vals)} values for {n} indices")
        if (versions is not None and len(versions) != n) or (lengths is not None and len(lengths) != n):
            raise ValueError(f"versions and lengths need one entry per index ({n})")

        async def send(wid: int, pos: list[int]) -> None:
            whole = len(pos) == n  # every sample to one warehouse, in order: no per-sample copy
            sub = columns if whole else {name: [vals[k] for k in pos] for name, vals in columns.items()}
            cols, frames = encode_columns(sub, len(pos))
            req = p.Put(
                self._next_id(),
                list(indices) if whole else [indices[k] for k in pos],
                cols,
                _pick(versions, pos, whole),
                _pick(lengths, pos, whole),
                ack_client=self.client_id if ack is not None else None,
                ack_lease=ack.lease_id if ack is not None else None,
            )
            await self._request(self._warehouses[wid], req, frames)

        async with self._out_lane:
            with tracer().span("put", "dock_out", "dock", samples=n, **({"ack": True} if ack is not None else {})):
                await self._fan_out(send, self._split(indices))
        if ack is not None:
            self._acked(ack, indices)

    async def add(
        self,
        columns: Mapping[str, Sequence[Any]],
        *,
        group_size: int = 1,
        versions: Sequence[int] | None = None,
        lengths: Sequence[int] | None = None,
        timeout: float | None = None,
    ) -> list[int]:
        """Reserve new samples (waiting for capacity) and put their first columns."""
        n = len(next(iter(columns.values())))
        indices = await self.reserve(n, group_size, timeout=timeout)
        await self.put(indices, columns, versions=versions, lengths=lengths)
        return indices

    async def close_input(self) -> None:
        """No more samples will be reserved; consumers get :class:`EndOfStream` once they had all."""
        assert self._ctl is not None
        await self._request(self._ctl, p.CloseInput(self._next_id(), self.client_id))

    # ------------------------------------------------------------------ consuming
    async def claim(
        self,
        consumer: str,
        reads: Sequence[str],
        n: int,
        *,
        min_n: int = 1,
        whole_groups: bool = False,
        balance_by_length: bool = False,
        min_version: int | None = None,
        timeout: float | None = None,
        one_reserve: bool = False,
    ) -> Lease:
        """Lease up to ``n`` samples whose ``reads`` are ready and ``consumer`` has not had.

        Waits until ``min_n`` are claimable (or, at ``timeout``, takes any that are); raises
        :class:`DockTimeout` if none came in time, :class:`EndOfStream` if none ever will.
        ``whole_groups`` returns only complete groups; ``balance_by_length`` picks samples of
        similar length; ``min_version`` drops (for this consumer) samples of older versions;
        ``one_reserve`` takes samples of one producer's reserve (one :meth:`add`) only.
        """
        deadline = time.monotonic() + (timeout if timeout is not None else math.inf)
        dropped = 0
        with tracer().span("claim", "dock_in", "dock", asked=n) as span:  # the wait for samples included
            while True:
                left = deadline - time.monotonic()
                last_poll = left <= LONG_POLL_S  # only the final poll may settle for fewer than min_n
                lease = await self._claim_once(consumer, reads, n, min_n, whole_groups, balance_by_length,
                                               min_version, max(0.0, min(LONG_POLL_S, left)), last_poll,
                                               one_reserve)
                dropped += lease.dropped_stale
                if lease.samples:
                    lease.dropped_stale = dropped
                    span["samples"] = len(lease.samples)
                    return lease
                if time.monotonic() >= deadline:
                    raise DockTimeout(f"no sample ready for consumer {consumer!r} within {timeout} s")

    async def claim_nowait(
        self,
        consumer: str,
        reads: Sequence[str],
        n: int,
        *,
        whole_groups: bool = False,
        balance_by_length: bool = False,
        min_version: int | None = None,
        one_reserve: bool = False,
    ) -> Lease:
        """Claim what is ready now (one round trip); :class:`NothingToClaim` if nothing is."""
        lease = await self._claim_once(consumer, reads, n, 1, whole_groups, balance_by_length, min_version, 0.0,
                                       True, one_reserve)
        if not lease.samples:
            raise NothingToClaim(f"nothing ready for consumer {consumer!r}")
        return lease

    async def _claim_once(
        self,
        consumer: str,
        reads: Sequence[str],
        n: int,
        min_n: int,
        whole_groups: bool,
        balance: bool,
        min_version: int | None,
        wait_s: float,
        partial_at_timeout: bool,
        one_reserve: bool = False,
    ) -> Lease:
        assert self._ctl is not None
        req = p.Claim(self._next_id(), self.client_id, consumer, list(reads), n, min_n, whole_groups, balance,
                      min_version, wait_s, partial_at_timeout, one_reserve)
        reply, _ = await self._request(self._ctl, req, timeout=wait_s + self.request_timeout_s)
        reply = _expect(reply, p.Claimed, "controller")
        if reply.end and not reply.samples:
            raise EndOfStream(f"consumer {consumer!r} has had every sample and the input is closed")
        lease = Lease(reply.lease_id, consumer, list(reply.samples), reply.dropped_stale)
        if lease.samples:
            self._leases[lease.lease_id] = lease
        return lease

    async def fetch(self, indices: Sequence[int], columns: Sequence[str]) -> dict[str, list[Any]]:
        """Column values of ``indices`` (in that order), from their warehouses in parallel."""
        out: dict[str, list[Any]] = {c: [None] * len(indices) for c in columns}

        async def get(wid: int, pos: list[int]) -> None:
            idx = [indices[k] for k in pos]
            reply, frames = await self._request(self._warehouses[wid], p.Get(self._next_id(), idx, list(columns)))
            reply = _expect(reply, p.Fetched, f"warehouse {wid}")
            try:
                if reply.indices != idx:
                    raise WireFormatError(f"asked for indices {idx[:8]}..., got {reply.indices[:8]}...")
                values = decode_columns(reply.columns, frames, len(idx), exact=True)
            except WireFormatError as exc:
                raise WireFormatError(f"warehouse {wid} sent a bad reply: {exc}") from exc
            if len(pos) == len(indices) and values.keys() == out.keys():  # all from one warehouse, in order
                out.update(values)
                return
            for name, vals in values.items():
                col = out[name]
                for k, v in zip(pos, vals, strict=True):
                    col[k] = v

        with tracer().span("fetch", "dock_in", "dock", samples=len(indices)):
            await self._fan_out(get, self._split(indices))
        return out

    async def ack(self, lease: Lease, indices: Sequence[int] | None = None, *, discard: bool = False) -> None:
        """Done with (some of) the lease's samples: they are never delivered to this consumer again.
        ``discard``: nor to any other consumer that has not claimed them yet (they leave the run)."""
        assert self._ctl is not None
        async with self._out_lane:
            with tracer().span("ack", "dock_out", "dock", samples=len(indices) if indices is not None else len(lease)):
                await self._request(
                    self._ctl,
                    p.Ack(self._next_id(), self.client_id, lease.lease_id,
                          list(indices) if indices is not None else None, discard=discard),
                )
        self._acked(lease, indices)

    def _acked(self, lease: Lease, indices: Sequence[int] | None) -> None:
        """``indices`` of ``lease`` (None: all) were acked: once all are, the lease is not held."""
        done = self._partly_acked.pop(lease.lease_id, set())
        if indices is not None:
            done |= set(indices)
            if not done >= set(lease.indices):
                self._partly_acked[lease.lease_id] = done
                return
        self._leases.pop(lease.lease_id, None)

    async def release(self, lease: Lease) -> None:
        """Give the lease's unacked samples back to the pool (e.g. a stage failed on them)."""
        assert self._ctl is not None
        self._leases.pop(lease.lease_id, None)
        self._partly_acked.pop(lease.lease_id, None)
        async with self._out_lane:
            with tracer().span("release", "dock_out", "dock", samples=len(lease)):
                await self._request(self._ctl, p.Release(self._next_id(), self.client_id, lease.lease_id))

    async def stream(
        self,
        consumer: str,
        reads: Sequence[str],
        n: int,
        *,
        min_n: int = 1,
        whole_groups: bool = False,
        balance_by_length: bool = False,
        min_version: int | None = None,
        idle_timeout: float | None = None,
    ) -> AsyncIterator[MicroBatch]:
        """Micro-batches for ``consumer`` until the input is closed and all were delivered.

        The caller acks (or releases) each ``batch.lease``; an unacked lease is re-delivered
        after the TTL if this client dies.
        """
        while True:
            try:
                lease = await self.claim(consumer, reads, n, min_n=min_n, whole_groups=whole_groups,
                                         balance_by_length=balance_by_length, min_version=min_version,
                                         timeout=idle_timeout)
            except EndOfStream:
                return
            try:
                columns = await self.fetch(lease.indices, list(reads)) if reads else {}
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await self.release(lease)  # nothing lost: another worker gets these samples
                raise
            yield MicroBatch(lease, columns)

    # ------------------------------------------------------------------ helpers
    async def _fan_out(self, fn: Any, parts: dict[int, list[int]]) -> None:
        if len(parts) == 1:
            (wid, pos), = parts.items()
            await fn(wid, pos)
            return
        async with anyio.create_task_group() as tg:
            for wid, pos in parts.items():
                tg.start_soon(fn, wid, pos)

    async def server_statistics(self) -> dict[str, Any]:
        """Controller and warehouse statistics (in flight, ready, claimed, bytes held, counters)."""
        assert self._ctl is not None
        ctl, _ = await self._request(self._ctl, p.StatsRequest(self._next_id()))
        whs = []
        for conn in self._warehouses:
            reply, _ = await self._request(conn, p.StatsRequest(self._next_id()))
            whs.append(reply.stats)
        return {"controller": ctl.stats, "warehouses": whs}

    async def controller_statistics(self, watch: Sequence[str] | None = None, seen: int | None = None,
                                    timeout: float = 0.0) -> dict[str, Any]:
        """The controller's statistics only (one round trip): counters such as ``samples_discarded``.

        With ``watch`` (consumer names) they carry ``watched``, a token of those consumers' ``done``
        and ``claimed`` and the dock's ``samples_discarded`` and ``dropped_stale``; given the token of
        an earlier answer as ``seen``, the controller answers only once it differs, or after
        ``timeout`` seconds (a long poll instead of polling: docs/dock-protocol.md §5.9)."""
        assert self._ctl is not None
        req = p.StatsRequest(self._next_id(), watch=list(watch) if watch is not None else None, seen=seen,
                             timeout_s=timeout)
        reply, _ = await self._request(self._ctl, req, timeout=timeout + self.request_timeout_s)
        return _expect(reply, p.Stats, "controller").stats

    def statistics(self) -> dict[str, Any]:
        """This client's own counters (no round trip)."""
        return {
            "client_id": self.client_id,
            "leases_held": len(self._leases),
            "in_flight": sum(len(c.pending) for c in self._conns),
            **self._counters,
        }


def _expire(fut: asyncio.Future[Any]) -> None:
    """A request's deadline passed: its wait ends in TimeoutError (unless the reply just came)."""
    if not fut.done():
        fut.set_exception(TimeoutError())


def _stop_monitor(conn: _Conn) -> None:
    """Stop ``conn``'s link monitor, then close its reading end (idempotent).

    In that order: libzmq's I/O thread hands each monitor event to the monitor's PAIR with a
    blocking send. Were the reading end closed first while the socket lives on (lingering on close,
    reconnecting, failing CURVE/PLAIN handshakes against a dock that refuses it), the next event's
    send would block the context's I/O thread for good, and every later socket on that context
    (``zmq.asyncio.Context.instance()``, shared by all clients of a process) would never connect."""
    if conn.monitor is None:
        return
    if not conn.link.closed:
        try:
            conn.link.socket.disable_monitor()
        except zmq.ZMQError:
            pass
    conn.monitor.close(linger=0)
    conn.monitor = None


def _pick(values: Sequence[int] | None, pos: list[int], whole: bool) -> list[int] | None:
    """``values`` at positions ``pos`` (all of them, in order, when ``whole``), or None."""
    if values is None:
        return None
    return list(values) if whole else [values[k] for k in pos]


def _expect(reply: Any, kind: type[_R], server: str) -> _R:
    """The reply if it has the type this request is answered with; a misbehaving server's other
    reply becomes a :class:`WireFormatError` naming it, not an AttributeError later."""
    if type(reply) is not kind:
        raise WireFormatError(f"{server} answered with {type(reply).__name__}, expected {kind.__name__}")
    return reply
