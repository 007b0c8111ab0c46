"""The dock's metadata controller server: who may read which sample, never the data itself.

:class:`ControllerServer` serves a :class:`~streamrl.dock.state.ControllerState` (the
bookkeeping of samples, columns, consumers, claims, leases and ownership) on one ZeroMQ ROUTER
socket. Per message it decodes the request (:mod:`streamrl.dock.protocol`), applies it to the
state and sends the reply. On top of the state it keeps what needs a clock or a peer's address:
long-polled claims, reserves and stats requests parked until they can be answered or time out,
when each client was last heard from (every message, heartbeats included, renews all its leases;
a client silent past its lease TTL loses them), the registered warehouses (told which samples to
drop once freed), the resource limits, the warehouse secret and CURVE authentication, and the
``stats`` reply.

The loop is synchronous pyzmq: serving is one process's only job, and a plain loop has less
per-message overhead than an event loop. Started as a process by
:class:`streamrl.dock.launch.LocalDock`, or by hand::

    STREAMRL_DOCK_SECRET=... python -m streamrl.dock.controller --bind tcp://127.0.0.1:0 \
        --consumers score,train --capacity 1024 --warehouses 2

It prints ``READY <endpoint>`` once bound.
"""

from __future__ import annotations

import argparse
import gc
import heapq
import hmac
import itertools
import logging
import os
import signal
import sys
import time
from collections import OrderedDict, deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from streamrl import wire
from streamrl.dock import protocol as p
from streamrl.dock.authz import AccessDenied, DockPolicy, parse_policy
from streamrl.dock.limits import DockLimits, secret_from_env
from streamrl.dock.state import ConsumerView, ControllerState, ProtocolViolation
from streamrl.dock.watch import ParentWatch
from streamrl.loop_affinity import pin_loop_threads
from streamrl.security import RoleAuthenticator, ServerAuth, peer_role, secure_server

__all__ = ["ConsumerView", "ControllerServer", "ControllerState", "ProtocolViolation", "main", "parse_views"]

log = logging.getLogger("streamrl.dock.controller")


@dataclass(eq=False)  # identity, not field equality: `in`/remove on the waiting lists stay O(1) per item
class _PendingClaim:
    identity: bytes
    req: p.Claim
    deadline: float


@dataclass(eq=False)
class _PendingReserve:
    identity: bytes
    req: p.Reserve
    deadline: float
    role: str | None = None  # the reserving client's role: what makes its samples written (state.reserve)


@dataclass(eq=False)
class _PendingStats:
    identity: bytes
    req: p.StatsRequest
    deadline: float
    watch: list[int]  # the consumer ids of req.watch


DEFAULT_TTL_S = 10.0  # lease TTL of a client that never sent hello
# Replies kept for resent requests: enough for every reply of the last seconds at full rate (a link
# reset is noticed, and the requests resent, within a reconnect interval of ~0.1 s).
REPLIES_KEPT_BYTES = 64 << 20
REPLY_OVERHEAD = 120  # bytes a kept reply costs beyond its encoding (key tuple, dict slot), for the bound
# Idle clients are forgotten only when the client limit is reached, at most this often (a scan is
# O(clients): a flood of new ids must not make every message pay for one). Not periodically:
# a forgotten client loses the TTL its hello set, so a worker that was idle for a while would
# come back with the 10 s default and could lose a lease it holds through a long step.
FORGET_AT_MOST_EVERY_S = 0.1


class ControllerServer:
    """Serves :class:`ControllerState` on a ROUTER socket. One process, one thread.

    Every message goes through :meth:`handle`: frame count, then the socket's one typed decoder
    (:func:`protocol.decode_request`: types, bounds, UTF-8, nesting), then :meth:`_dispatch`, whose
    refusals are :class:`ProtocolViolation` answered with an ``error`` reply. Per-peer state is
    bounded: at most ``limits.max_clients`` client ids (when that is reached, those holding no
    lease and silent past their TTL are forgotten) and ``limits.max_parked`` claims/reserves/stats held
    open; answered long-polls leave the deadline heap once they dominate it.
    """

    def __init__(
        self,
        bind: str,
        consumers: list[str],
        capacity: int,
        n_warehouses: int,
        *,
        secret: str,
        limits: DockLimits | None = None,
        views: Mapping[str, ConsumerView] | None = None,
        context: zmq.Context | None = None,
        hwm: int = 100_000,
        auth: ServerAuth | None = None,
        block: int = 1,
        policy: DockPolicy | None = None,
    ) -> None:
        """``policy``: the pipeline's declarations, enforced per message on the sender's ZAP role
        (docs/dock-protocol.md §6.2); None: no authorization (tests, benchmarks)."""
        if not secret:
            raise ValueError("the controller needs a non-empty warehouse secret (the launcher generates one per run)")
        if not 1 <= n_warehouses <= 65_536:
            raise ValueError(f"n_warehouses must be in [1, 65536], got {n_warehouses}")
        wire.raise_fd_limit()  # one fd per connection: held connections must not lock clients out
        self.limits = limits or DockLimits()
        self.policy = policy
        self.state = ControllerState(consumers, capacity, n_warehouses, views, block, policy=policy,
                                     reserve_ttl_s=self.limits.reserve_ttl_s)
        # roles come from each message's ZAP metadata (a zero-copy receive) only on an authenticated
        # dock: the plain receive stays the fast path everywhere else
        self.read_roles = policy is not None and policy.authenticated
        self.client_role: dict[str, str] = {}  # client id -> the role that first used it (bound)
        self.role_clients: dict[str, int] = {}  # role -> client ids known for it now
        self._secret = secret.encode()
        self.ctx = context or zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        # finite high-water marks: a flood of requests queues in bounded memory, then TCP pushes back
        self.sock.setsockopt(zmq.RCVHWM, hwm)
        self.sock.setsockopt(zmq.SNDHWM, hwm)
        # only headers come here: a longer frame disconnects its sender inside libzmq, unallocated
        self.sock.setsockopt(zmq.MAXMSGSIZE, self.limits.max_header_bytes)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a reply to a vanished peer raises, never blocks
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.BACKLOG, 1024)  # hundreds of workers connect at once at start-up
        # a launched run: only the run's roles complete a handshake (streamrl.security)
        self.zap: RoleAuthenticator | None = secure_server(self.sock, auth)
        # a peer reconnecting after a link reset keeps its (fixed, random) routing id: its new
        # connection takes the name over, so replies and frees reach it there (docs §5.8)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        wire.watch_link(self.sock)
        self.sock.bind(bind)
        self.endpoint: str = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.warehouses: dict[int, tuple[bytes, str]] = {}  # warehouse id -> (routing id, endpoint)
        self.warehouse_ids: dict[bytes, int] = {}  # routing id of a registered warehouse -> its id
        self.pending_hellos: dict[str, tuple[bytes, p.Hello]] = {}  # by client id: a repeated hello replaces
        self.pending_claims: dict[int, list[_PendingClaim]] = {}
        self.pending_reserves: deque[_PendingReserve] = deque()
        self.pending_stats: list[_PendingStats] = []  # long polls of watched figures (docs §5.9)
        self.deadlines: list[tuple[float, int, Any]] = []  # heap of (deadline, seq, pending item)
        self.stale_deadlines = 0  # heap entries of items answered before their deadline
        self.seq = itertools.count()
        self.client_ttl: dict[str, float] = {}
        self.client_seen: dict[str, float] = {}
        self.refused = dict.fromkeys(("warehouse_hello", "columns_ready", "clients", "forbidden"), 0)
        self.reregistered = 0  # warehouse_hellos for a warehouse id already registered (reconnects)
        # Replies by (routing id, req_id), newest last, bounded in bytes: a request a client resends
        # after a link reset (its reply, or the request itself, may have died with the link) is
        # answered from here instead of being applied twice (a second lease, a second reserve).
        # Keyed by routing id + req_id as one bytes object: bytes are not tracked by the garbage
        # collector, where ~10^5 kept tuple keys made every full collection slower.
        self.replies: OrderedDict[bytes, bytes] = OrderedDict()
        self.replies_bytes = 0
        self.parked_keys: set[tuple[bytes, int]] = set()  # (routing id, req_id) of parked requests
        self.resent = 0  # requests answered from self.replies (or already parked): resends after resets
        self._stop = False
        self.parent = ParentWatch()  # set .pid to stop once the launcher is gone (no orphans)
        self._next_expiry_scan = 0.0
        self._next_forget = 0.0
        self._warn = wire.SparseLog(log).warning  # a peer's garbage in a loop must not fill the disk

    # ------------------------------------------------------------------ replies
    def _send(self, identity: bytes, msg: msgspec.Struct) -> None:
        data = p.encoder.encode(msg)
        rid = getattr(msg, "req_id", -1)
        # kept even when the send fails below: the resend after the reconnect gets it. Only for a
        # peer with a fixed routing id: an id libzmq made up (it starts with a zero byte) changes
        # with every connection, so no resend could ever ask for that reply.
        if rid >= 0 and identity[:1] != b"\0":
            self._remember(identity, rid, data)
        try:
            self.sock.send_multipart([identity, data], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # peer gone or its queue full: it will resend (or time out and retry)
            self._warn("reply", "dropping reply %s to %r: %s", type(msg).__name__, identity, exc)

    def _remember(self, identity: bytes, rid: int, data: bytes) -> None:
        key = identity + rid.to_bytes(8, "little")
        old = self.replies.pop(key, None)
        self.replies[key] = data
        self.replies_bytes += len(data) + REPLY_OVERHEAD - (len(old) + REPLY_OVERHEAD if old is not None else 0)
        while self.replies_bytes > REPLIES_KEPT_BYTES and len(self.replies) > 1:
            _, dropped = self.replies.popitem(last=False)
            self.replies_bytes -= len(dropped) + REPLY_OVERHEAD

    def _answer_again(self, identity: bytes, msg: Any) -> bool:
        """True if ``msg`` is a request this peer sent before (resent after a link reset): answered
        again from the reply kept for it, or left to its parked original, and not applied twice."""
        rid = getattr(msg, "req_id", None)
        if rid is None:
            return False
        data = self.replies.get(identity + rid.to_bytes(8, "little"))
        if data is None and (identity, rid) not in self.parked_keys:
            return False
        self.resent += 1
        if data is not None:
            try:
                self.sock.send_multipart([identity, data], flags=zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                self._warn("reply", "dropping a resent reply to %r: %s", identity, exc)
        return True

    def _error(self, identity: bytes, req_id: int, code: str, message: str) -> None:
        self.state.counters["errors"] += 1
        self._send(identity, p.ErrorReply(req_id, code, message))

    # ------------------------------------------------------------------ main loop
    def stop(self) -> None:
        self._stop = True

    def serve_forever(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self._stop:
            if self.parent.gone():
                break
            timeout_ms = self._poll_timeout_ms()
            events = dict(poller.poll(timeout_ms))
            if self.sock in events:
                # drain what is queued before doing timer work: batches messages under load
                for _ in range(1000):
                    try:
                        if self.read_roles:
                            msg = self.sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
                            # frames[-1]: a frame from the peer (the routing id is the ROUTER's own)
                            self.handle([f.bytes for f in msg], peer_role(msg[-1]))
                            continue
                        frames = self.sock.recv_multipart(flags=zmq.NOBLOCK, copy=True)
                    except zmq.Again:
                        break
                    self.handle(frames)
            self._on_timers()
            self._flush_frees()
        self.sock.close(linger=0)

    def _poll_timeout_ms(self) -> int:
        now = time.monotonic()
        nxt = now + 0.1  # expiry scans at least every 100 ms
        if self.deadlines:
            nxt = min(nxt, self.deadlines[0][0])  # deadlines are finite: timeouts are bounded on the wire
        return max(0, int((nxt - now) * 1000) + 1)

    def handle(self, frames: list[bytes], role: str | None = None) -> None:
        """One message: every request goes through this decode-and-validate path. ``role``: the
        sender's ZAP User-Id (None: the connection has none)."""
        if len(frames) < 2:
            self._warn("frames", "dropping message with %d frames (need routing id + header)", len(frames))
            return
        identity, header = frames[0], frames[1]
        if len(frames) > 2:
            rid = p.salvage_req_id(header)
            if rid is not None:
                self._error(identity, rid, "bad_frames", "controller messages carry no tensor frames: send the "
                            "header alone")
            return
        msg, error = p.decode_request(p.controller_request_decoder, header)
        if msg is None:
            self._warn("decode", "undecodable controller message from %r", identity)
            if error is not None:
                self._error(identity, error.req_id, error.code, error.message)
            return
        if msg.again and self._answer_again(identity, msg):  # one attribute test on the hot path
            return
        try:
            self._authorize(msg, role)
            self._dispatch(identity, msg, role)
        except ProtocolViolation as exc:
            if isinstance(exc, AccessDenied):
                self.refused["forbidden"] += 1
                self._warn("forbidden", "refused %s from role %r: %s", type(msg).__name__, role, exc)
            self._error(identity, _req_id(msg), exc.code, str(exc))
        except Exception as exc:  # a bug must not take the controller down for everyone
            log.exception("internal error handling %s", type(msg).__name__)
            self._error(identity, _req_id(msg), "internal", f"{type(exc).__name__}: {exc}")
        if self.pending_stats:  # this message may have changed what a long poll watches
            self._serve_stats()

    # ------------------------------------------------------------------ clients
    def _touch(self, client_id: str, role: str | None = None) -> None:
        """Client ``client_id`` is alive (renews its leases); a new one counts against its role's client
        limit (a role of the policy) or max_clients (no role), and is bound to ``role``."""
        seen = self.client_seen
        if role is not None and self.policy is not None:
            self._touch_role(client_id, role)
            return
        if client_id not in seen and len(seen) >= self.limits.max_clients:
            now = time.monotonic()
            if now >= self._next_forget:
                self._forget_idle(now)
            if len(seen) >= self.limits.max_clients:
                self.refused["clients"] += 1
                raise ProtocolViolation(
                    "too_many_clients",
                    f"the controller already keeps state for {len(seen)} clients, its limit (resources.dock."
                    f"max_clients, controller flag --max-clients): client {client_id!r} refused. Raise the "
                    "limit, or reuse client ids; a client holding no lease is forgotten once silent for its "
                    "lease TTL.",
                )
        seen[client_id] = time.monotonic()

    def _touch_role(self, client_id: str, role: str) -> None:
        """Per-role client slots: a role that fills its own (squatting ids with a long TTL) never
        refuses another role's clients, and a client id is its first role's: no other role can
        renew, ack or release with it."""
        assert self.policy is not None
        seen = self.client_seen
        bound = self.client_role.get(client_id)
        if bound is not None and bound != role:
            raise AccessDenied("forbidden", f"client id {client_id!r} belongs to role {bound!r}, not {role!r}: "
                               "each worker uses its own client id")
        if client_id not in seen:
            limit = self.policy.clients.get(role, 0)
            if self.role_clients.get(role, 0) >= limit:
                now = time.monotonic()
                if now >= self._next_forget:
                    self._forget_idle(now)
                if self.role_clients.get(role, 0) >= limit:
                    self.refused["clients"] += 1
                    raise ProtocolViolation(
                        "too_many_clients",
                        f"role {role!r} already has {self.role_clients.get(role, 0)} client ids, its limit (its "
                        f"workers + margin, from the pipeline): client {client_id!r} refused. A client holding "
                        "no lease is forgotten once silent for its lease TTL; other roles are not affected.")
            self.client_role[client_id] = role
            self.role_clients[role] = self.role_clients.get(role, 0) + 1
        seen[client_id] = time.monotonic()

    def _forget(self, client_id: str) -> None:
        del self.client_seen[client_id]
        self.client_ttl.pop(client_id, None)
        self.pending_hellos.pop(client_id, None)
        self.state.client_home.pop(client_id, None)
        role = self.client_role.pop(client_id, None)
        if role is not None:
            self.role_clients[role] -= 1

    def _forget_idle(self, now: float) -> None:
        """Drop the state of clients that hold no lease and were silent longer than their TTL."""
        self._next_forget = now + FORGET_AT_MOST_EVERY_S
        holding = self.state.client_leases
        ttl = self.client_ttl
        idle = [cid for cid, seen in self.client_seen.items()
                if cid not in holding and now - seen > ttl.get(cid, DEFAULT_TTL_S)]
        for cid in idle:
            self._forget(cid)

    def _granted(self, client_id: str) -> None:
        """A parked claim was granted: its lease's TTL runs from now, even if the (possibly idle)
        client was forgotten meanwhile; otherwise the lease would never expire."""
        self.client_seen[client_id] = time.monotonic()

    def _park(self, item: _PendingClaim | _PendingReserve | _PendingStats) -> None:
        parked = (len(self.pending_reserves) + len(self.pending_stats)
                  + sum(len(v) for v in self.pending_claims.values()))
        if parked >= self.limits.max_parked:
            raise ProtocolViolation(
                "busy", f"the controller already holds {parked} claims/reserves/stats open, its limit (resources."
                "dock.max_parked, controller flag --max-parked): retry later with a shorter timeout_s, or raise it")
        heapq.heappush(self.deadlines, (item.deadline, next(self.seq), item))
        self.parked_keys.add((item.identity, item.req.req_id))

    def _answered(self, item: _PendingClaim | _PendingReserve | _PendingStats) -> None:
        """``item`` was answered before its deadline: its heap entry is stale. Rebuild the heap once
        stale entries dominate, so answered long-polls do not pile up until their deadlines."""
        item.deadline = -1.0
        self.parked_keys.discard((item.identity, item.req.req_id))
        self.stale_deadlines += 1
        if self.stale_deadlines > 1024 and 2 * self.stale_deadlines > len(self.deadlines):
            self.deadlines = [e for e in self.deadlines if e[2].deadline >= 0]
            heapq.heapify(self.deadlines)
            self.stale_deadlines = 0

    # ------------------------------------------------------------------ dispatch
    def _authorize(self, msg: p.ControllerRequest, role: str | None) -> None:
        """What a role may send at all (docs §6.2); the per-consumer, per-column and producer rules
        are the state's (it is given the role). Refusals are AccessDenied: an ErrorReply."""
        if self.policy is None:
            return
        what = type(msg).__name__
        self.policy.require_role(role, what)
        if isinstance(msg, p.WarehouseHello | p.ColumnsReady):
            self.policy.check_dock(role, what)
        elif not isinstance(msg, p.StatsRequest):
            self.policy.check_not_dock(role, what)

    def _dispatch(self, identity: bytes, msg: p.ControllerRequest, role: str | None = None) -> None:
        st = self.state
        match msg:
            case p.Heartbeat(client_id=cid):
                # no reply, and an unknown client has nothing to renew; nor has another role's client
                if cid in self.client_seen and (role is None or self.client_role.get(cid, role) == role):
                    self.client_seen[cid] = time.monotonic()
            case p.Claim():
                view = st.validate_claim(msg, role)  # before _touch: a refused role takes no client slot
                self._touch(msg.client_id, role)
                reply = st.try_claim(msg, view, force=False)
                if reply is not None:
                    self._send(identity, reply)
                elif not msg.timeout_s:
                    self._send(identity, p.Claimed(msg.req_id, 0, [], 0, False))
                else:
                    item = _PendingClaim(identity, msg, time.monotonic() + msg.timeout_s)
                    self._park(item)
                    self.pending_claims.setdefault(view.consumer, []).append(item)
            case p.Ack(client_id=cid, lease_id=lid, indices=idx, discard=discard):
                self._touch(cid, role)
                consumers = st.ack(cid, lid, idx, role, discard=discard)
                self._send(identity, p.Ok(msg.req_id))
                self._serve_reserves()
                for consumer in sorted(consumers):
                    self._serve_claims(consumer)  # this ack may be the one that ends a stream
            case p.ColumnsReady(warehouse_id=wid, indices=idx, columns=cols, versions=vers, lengths=lens):
                if self.warehouse_ids.get(identity) != wid:
                    # only the registered warehouse may say its data is stored: anyone else could
                    # make consumers claim samples whose columns exist nowhere
                    self.refused["columns_ready"] += 1
                    raise ProtocolViolation("unauthorized", f"columns_ready is accepted only from the connection "
                                            f"that registered as warehouse {wid} (warehouse_hello)")
                n = len(idx)
                if (vers is not None and len(vers) != n) or (lens is not None and len(lens) != n):
                    raise ProtocolViolation("bad_field", f"columns_ready: versions/lengths need {n} entries")
                writer = msg.writer
                if writer is None and self.read_roles and cols:  # a resync (no columns) marks nothing
                    raise AccessDenied("forbidden", "columns_ready without a writer on an authenticated dock: "
                                       "the warehouse names the role of the put's client")
                if (msg.ack_client is None) != (msg.ack_lease is None):
                    raise ProtocolViolation("bad_field", "columns_ready: a put's ack needs both ack_client and "
                                            "ack_lease")
                put_ack = ((msg.ack_client, msg.ack_lease)
                           if msg.ack_client is not None and msg.ack_lease is not None else None)
                if put_ack is not None:
                    st.check_put_ack(*put_ack, writer)  # refused before anything is marked
                touched, unknown = st.columns_ready(idx, cols, vers, lens, writer)
                if unknown:
                    self._send(identity, p.Free(unknown))  # data for dead indices: drop it
                acked: set[int] = set()
                if put_ack is not None:
                    # the put's ack, after its columns are marked (as a separate ack would come):
                    # authorized as the putter's role, which must be the lease's consumer (docs §5.7)
                    cid, lid = put_ack
                    acked = st.ack_with_put(cid, lid, idx, writer)
                    if cid in self.client_seen:
                        self.client_seen[cid] = time.monotonic()  # renews its leases, as any message
                if msg.req_id is not None:  # now the warehouse may answer the put ok (docs §5.8)
                    self._send(identity, p.Ok(msg.req_id))
                if acked:
                    self._serve_reserves()
                for consumer in sorted(touched | acked):
                    self._serve_claims(consumer)
            case p.Reserve():
                st.check_producer(role)
                self._touch(msg.client_id, role)
                self._reserve(identity, msg, role)
            case p.Release(client_id=cid, lease_id=lid):
                self._touch(cid, role)
                consumer = st.release(cid, lid, role)
                self._send(identity, p.Ok(msg.req_id))
                self._serve_claims(consumer)
            case p.Hello(client_id=cid):
                if msg.protocol != p.PROTOCOL_VERSION:
                    raise ProtocolViolation(
                        "protocol", f"client speaks protocol {msg.protocol}, controller {p.PROTOCOL_VERSION}: "
                        "upgrade the older side"
                    )
                home = msg.home_warehouse
                if home is not None and home >= st.n_warehouses:
                    raise ProtocolViolation("bad_field", f"hello home_warehouse={home} outside [0, "
                                            f"{st.n_warehouses}): this dock has that many warehouses")
                self._touch(cid, role)
                self.client_ttl[cid] = msg.lease_ttl_s  # bounds checked by the decoder (Ttl)
                if home is None:
                    st.client_home.pop(cid, None)
                else:
                    st.client_home[cid] = home
                self.pending_hellos[cid] = (identity, msg)
                self._answer_hellos()
            case p.WarehouseHello():
                self._register_warehouse(identity, msg)
            case p.CloseInput(client_id=cid):
                st.check_producer(role, "close_input")
                self._touch(cid, role)
                st.close_input(role)
                self._send(identity, p.Ok(msg.req_id))
                for consumer in range(len(st.consumers)):
                    self._serve_claims(consumer)
            case p.StatsRequest():
                self._stats(identity, msg)

    def _statistics(self, watched: int | None = None) -> dict[str, Any]:
        stats = self.state.statistics()
        stats["pending_claims"] = sum(len(v) for v in self.pending_claims.values())
        stats["pending_reserves"] = len(self.pending_reserves)
        stats["pending_stats"] = len(self.pending_stats)
        stats["clients"] = len(self.client_seen)
        if self.policy is not None:
            stats["clients_per_role"] = {r: n for r, n in self.role_clients.items() if n}
        stats["refused"] = dict(self.refused)
        stats["warehouses_registered"] = len(self.warehouses)
        stats["warehouses_reregistered"] = self.reregistered
        stats["requests_resent"] = self.resent
        if self.zap is not None:  # handshakes this process's ZAP handler admitted / refused
            stats["auth"] = {"accepted": self.zap.accepted, "refused": self.zap.refused}
        if watched is not None:
            stats["watched"] = watched
        return stats

    def _stats(self, identity: bytes, msg: p.StatsRequest) -> None:
        """A stats request: answered at once, or, with ``watch`` and the ``seen`` token still current,
        held until a watched figure changes or ``timeout_s`` passes (docs §5.9)."""
        if msg.watch is None:
            if msg.seen is not None or msg.timeout_s:
                raise ProtocolViolation("bad_field", "stats: seen and timeout_s wait for a change of the watched "
                                        "figures: name the consumers to watch in watch")
            self._send(identity, p.Stats(msg.req_id, self._statistics()))
            return
        ids = []
        for name in msg.watch:
            cid = self.state.consumer_ids.get(name)
            if cid is None:
                raise ProtocolViolation("unknown_consumer", f"stats watch: consumer {name!r} is not registered; "
                                        f"known: {self.state.consumers}")
            ids.append(cid)
        token = self.state.watched(ids)
        if msg.seen != token or not msg.timeout_s:
            self._send(identity, p.Stats(msg.req_id, self._statistics(token)))
            return
        item = _PendingStats(identity, msg, time.monotonic() + msg.timeout_s, ids)
        self._park(item)
        self.pending_stats.append(item)

    def _serve_stats(self) -> None:
        """Answer each parked stats request whose watched figures changed."""
        waiting: list[_PendingStats] = []
        for item in self.pending_stats:
            token = self.state.watched(item.watch)
            if token == item.req.seen:
                waiting.append(item)
                continue
            self._answered(item)
            self._send(item.identity, p.Stats(item.req.req_id, self._statistics(token)))
        self.pending_stats = waiting

    def _register_warehouse(self, identity: bytes, msg: p.WarehouseHello) -> None:
        wid = msg.warehouse_id
        # the secret first: a peer without it learns nothing else about the dock
        if not hmac.compare_digest(msg.secret.encode(), self._secret):
            self.refused["warehouse_hello"] += 1
            raise ProtocolViolation("unauthorized", "warehouse_hello with a wrong secret: start warehouses with "
                                    "the run's secret in STREAMRL_DOCK_SECRET (LocalDock and ThreadDock do)")
        if msg.protocol != p.PROTOCOL_VERSION:
            raise ProtocolViolation("protocol", f"warehouse speaks protocol {msg.protocol}, controller "
                                    f"{p.PROTOCOL_VERSION}: run both from the same streamrl")
        if msg.block != self.state.block:
            raise ProtocolViolation("bad_field", f"warehouse started with block={msg.block}, controller with "
                                    f"block={self.state.block}: start both with the same --block")
        if wid >= self.state.n_warehouses:
            raise ProtocolViolation("bad_field", f"warehouse_id {wid} outside [0, {self.state.n_warehouses}): this "
                                    "dock was started with that many warehouses")
        known = self.warehouses.get(wid)
        other = self.warehouse_ids.get(identity)
        if (known is not None and known[0] != identity and known[1] != msg.endpoint) or (
                other is not None and other != wid):
            self.refused["warehouse_hello"] += 1
            raise ProtocolViolation(
                "already_registered",
                f"warehouse {wid} is already registered from another connection at another endpoint (or this "
                f"connection is warehouse {other}): a warehouse id is taken once per run",
            )
        if known is not None:
            # the same warehouse (secret, id, block and endpoint) registering again: its link was
            # reset. Over a new connection name (a warehouse without a fixed routing id) it takes
            # the id over; frees sent meanwhile are recovered by its resync (docs §5.8).
            self.reregistered += 1
            if known[0] != identity:
                self.warehouse_ids.pop(known[0], None)
        self.warehouses[wid] = (identity, msg.endpoint)
        self.warehouse_ids[identity] = wid
        self._send(identity, p.Ok(msg.req_id))
        self._answer_hellos()

    def _answer_hellos(self) -> None:
        st = self.state
        if len(self.warehouses) < st.n_warehouses:
            return  # clients wait until every warehouse has registered
        eps = [self.warehouses[w][1] for w in range(st.n_warehouses)]
        for identity, hello in self.pending_hellos.values():
            self._send(identity, p.HelloReply(hello.req_id, p.PROTOCOL_VERSION, eps, st.consumers, st.capacity,
                                              st.block))
        self.pending_hellos.clear()

    def _reserve(self, identity: bytes, msg: p.Reserve, role: str | None = None) -> None:
        st = self.state
        st.check_reserve(msg.n, msg.group_size, msg.warehouse)
        if not self.pending_reserves and st.free_slots >= msg.n:
            indices, groups = st.reserve(msg.n, msg.group_size, msg.warehouse, role=role, now=time.monotonic())
            self._send(identity, p.Reserved(msg.req_id, indices, groups))
            return
        if msg.timeout_s is not None and msg.timeout_s <= 0:
            self._error(identity, msg.req_id, "full", f"dock full: {st.free_slots} free of {st.capacity}")
            return
        # backpressure: the producer waits, FIFO, until consumers free enough samples
        deadline = time.monotonic() + (msg.timeout_s if msg.timeout_s is not None else 1e9)
        item = _PendingReserve(identity, msg, deadline, role)
        self._park(item)
        self.pending_reserves.append(item)

    def _serve_reserves(self) -> None:
        st = self.state
        while self.pending_reserves and st.free_slots >= self.pending_reserves[0].req.n:
            item = self.pending_reserves.popleft()
            self._answered(item)
            try:
                indices, groups = st.reserve(item.req.n, item.req.group_size, item.req.warehouse, role=item.role,
                                             now=time.monotonic())
            except ProtocolViolation as exc:
                self._error(item.identity, item.req.req_id, exc.code, str(exc))
                continue
            self._send(item.identity, p.Reserved(item.req.req_id, indices, groups))

    def _serve_claims(self, consumer: int) -> None:
        waiting = self.pending_claims.get(consumer)
        view = self.state.views[consumer]
        while waiting and view is not None:
            item = waiting[0]
            reply = self.state.try_claim(item.req, view, force=False)
            if reply is None:
                return
            waiting.pop(0)
            self._answered(item)
            if reply.lease_id:
                self._granted(item.req.client_id)
            self._send(item.identity, reply)

    def _on_timers(self) -> None:
        now = time.monotonic()
        while self.deadlines and self.deadlines[0][0] <= now:
            _, _, item = heapq.heappop(self.deadlines)
            if item.deadline < 0:
                self.stale_deadlines = max(0, self.stale_deadlines - 1)
                continue
            self.parked_keys.discard((item.identity, item.req.req_id))
            if isinstance(item, _PendingClaim):
                cid = self.state.consumer_ids[item.req.consumer]
                waiting = self.pending_claims.get(cid, [])
                if item in waiting:
                    waiting.remove(item)
                view = self.state.views[cid]
                assert view is not None
                reply = self.state.try_claim(item.req, view, force=item.req.partial_at_timeout)
                if reply is not None and reply.lease_id:
                    self._granted(item.req.client_id)
                end = self.state.at_end(view.consumer)
                self._send(item.identity, reply or p.Claimed(item.req.req_id, 0, [], 0, end))
            elif isinstance(item, _PendingStats):  # nothing it watches changed: the figures as they are
                self.pending_stats.remove(item)
                self._send(item.identity, p.Stats(item.req.req_id, self._statistics(self.state.watched(item.watch))))
            else:
                if item in self.pending_reserves:
                    self.pending_reserves.remove(item)
                st = self.state
                self._error(item.identity, item.req.req_id, "timeout",
                            f"dock still full after {item.req.timeout_s} s ({st.free_slots} free of {st.capacity})")
        if now >= self._next_expiry_scan:
            self._next_expiry_scan = now + 0.05
            expired = self.state.expire_reservations(now)
            if expired:  # freed through _flush_frees, which also serves waiting reserves and claims
                log.warning("%d reserved samples (e.g. %s) were not written within %d s: they expire and their "
                            "capacity returns", len(expired), expired[:8], self.limits.reserve_ttl_s)
            for cid in list(self.state.client_leases):
                ttl = self.client_ttl.get(cid, DEFAULT_TTL_S)
                if now - self.client_seen.get(cid, now) > ttl:
                    log.warning("client %s silent for > %.2f s: its leases go back to the pool", cid, ttl)
                    for consumer in self.state.expire_client(cid):
                        self._serve_claims(consumer)
        if self.pending_stats:  # an expired lease changes a consumer's claimed count
            self._serve_stats()

    def _flush_frees(self) -> None:
        freed = self.state.take_freed()
        if not freed:
            return
        by_wh: dict[int, list[int]] = {}
        owner = self.state.owner
        for i in freed:
            by_wh.setdefault(owner(i), []).append(i)
        for wid, idx in by_wh.items():
            if wid in self.warehouses:
                self._send(self.warehouses[wid][0], p.Free(idx))
        for consumer in range(len(self.state.consumers)):
            if self.pending_claims.get(consumer):
                self._serve_claims(consumer)  # frees can complete the end-of-stream condition
        self._serve_reserves()


def _req_id(msg: Any) -> int:
    """The id to answer ``msg``'s error with: -1 for one without (heartbeat, a columns_ready without)."""
    rid = getattr(msg, "req_id", None)
    return -1 if rid is None else rid


def parse_views(text: str) -> dict[str, ConsumerView]:
    """``--views`` JSON: ``{"consumer": {"reads": [...], "whole_groups": false}, ...}``."""
    try:
        raw = msgspec.json.decode(text, type=dict[str, ConsumerView])
    except msgspec.DecodeError as exc:
        raise ValueError(f"--views must be JSON {{consumer: {{reads: [...], whole_groups: bool}}}}: {exc}") from None
    return raw


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m streamrl.dock.controller", description=__doc__.splitlines()[0])
    ap.add_argument("--bind", required=True, help="tcp://127.0.0.1:0 (port from the OS) or ipc:///path")
    ap.add_argument("--consumers", required=True, help="comma-separated stage names that must ack each sample")
    ap.add_argument("--capacity", type=int, required=True, help="samples in flight before producers wait")
    ap.add_argument("--parent-pid", type=int, default=0, help="exit when this process is gone")
    ap.add_argument("--loop-core", type=int, default=None,
                    help="the core of this server's threads once it serves (streamrl.loop_affinity); default: any")
    ap.add_argument("--warehouses", type=int, default=1, help="number of warehouses that will register")
    ap.add_argument("--views", default="", help='JSON {"consumer": {"reads": [...], "whole_groups": false}}: '
                    "each consumer's fixed reads (default: fixed by its first claim)")
    ap.add_argument("--block", type=int, default=1, help="samples per ownership block: sample k lives on "
                    "warehouse (k // block) %% warehouses; > 1 lets a producer reserve on its own node's warehouse")
    ap.add_argument("--policy", default="", help="JSON DockPolicy (streamrl.dock.authz): the pipeline's "
                    "column owners, consumers and producers, enforced per role (default: none)")
    DockLimits.add_arguments(ap)
    args = ap.parse_args(argv)
    logging.basicConfig(level=os.environ.get("STREAMRL_LOG", "WARNING"), format="%(name)s: %(message)s")
    try:
        server = ControllerServer(
            args.bind, [c for c in args.consumers.split(",") if c], args.capacity, args.warehouses,
            secret=secret_from_env(),  # from the environment, never argv (readable by any local user)
            limits=DockLimits.from_args(args), views=parse_views(args.views) if args.views else None,
            auth=ServerAuth.from_env(),  # like the secret: from the environment, never argv
            block=args.block, policy=parse_policy(args.policy) if args.policy else None,
        )
    except (ValueError, zmq.ZMQError, msgspec.DecodeError) as exc:
        print(f"controller: {exc}", file=sys.stderr)
        return 2
    server.parent.pid = args.parent_pid
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    signal.signal(signal.SIGINT, lambda *_: server.stop())
    print(f"READY {server.endpoint}", flush=True)
    if args.loop_core is not None:  # every thread of the server (streamrl.loop_affinity)
        pin_loop_threads(args.loop_core, every_thread=True)
    gc.freeze()  # start-up objects never die: keep the collector from rescanning them on every claim
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
