"""A dock warehouse: holds the column values of the samples it owns, serves put/get.

Warehouse ``w`` of ``W`` owns sample index ``k`` iff ``(k // block) % W == w`` (``block`` 1 by
default: ``k % W``, see docs/dock-protocol.md §5.1); clients compute that
themselves and talk to warehouses directly, in parallel, so tensors never pass through the
controller. After storing a put, the warehouse tells the controller which (sample, column)
pairs became ready, and answers the client ok only once the controller has accepted that
(``columns_ready`` is answered): a put that is ok is claimable. A reset of the link to the
controller loses nothing: the link reconnects under the same routing id, the warehouse
registers again, resends the readiness messages not yet answered and resyncs the samples it
holds (the controller frees those it lost the ``free`` of); docs/dock-protocol.md §5.8.

Stored tensors are views of the received zmq frames' bytes (codec rule 4; held as
:class:`~streamrl.dock.codec.RawValue`): a put costs no copy here, and a get of a large value
sends that same memory back out without copying (codec rule 1). The warehouse never imports
torch: it starts in a tenth of a second and holds no more than the bytes it stores.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import logging
import os
import signal
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from streamrl import wire
from streamrl.dock import protocol as p
from streamrl.dock.authz import AccessDenied, DockPolicy, parse_policy
from streamrl.dock.codec import decode_put, encode_columns
from streamrl.dock.errors import WireFormatError
from streamrl.dock.limits import DockLimits, secret_from_env
from streamrl.dock.state import ProtocolViolation
from streamrl.dock.watch import ParentWatch
from streamrl.loop_affinity import pin_loop_threads
from streamrl.security import (
    ClientAuth,
    RoleAuthenticator,
    ServerAuth,
    peer_role,
    secure_client,
    secure_server,
)

log = logging.getLogger("streamrl.dock.warehouse")


class _Held:
    """One received frame (or its aligned copy): its bytes stay allocated while any sample that
    views it is stored (codec rule 4), so it is counted once, and uncounted with its last user."""

    __slots__ = ("nbytes", "users")

    def __init__(self, nbytes: int, users: int) -> None:
        self.nbytes = nbytes
        self.users = users


class WarehouseStore:
    """Column values by sample index, with byte accounting. No sockets.

    ``bytes_held`` is the memory of the tensor frames the stored values keep alive (a pack frame
    counts in full until its last sample is freed), not the sum of the values' sizes: values are
    views of received frames, and an exact header (codec ``exact``) bounds the difference between
    the two to the alignment padding.
    """

    def __init__(self, warehouse_id: int, n_warehouses: int, block: int = 1) -> None:
        self.warehouse_id = warehouse_id
        self.n_warehouses = n_warehouses
        self.block = block
        self.rows: dict[int, dict[str, Any]] = {}
        self.held: dict[int, list[_Held]] = {}  # sample index -> frames its values view
        self.bytes_held = 0
        self.column_names: set[str] = set()  # distinct names ever stored, bounded by MAX_COLUMNS
        # samples_stored: samples that got their first column here, ever (what this warehouse stored)
        self.counters = dict.fromkeys(("puts", "gets", "frees", "errors", "bytes_in", "bytes_out",
                                       "samples_stored"), 0)

    def check_owned(self, indices: list[int]) -> None:
        nw, b, w = self.n_warehouses, self.block, self.warehouse_id
        if nw == 1 and (not indices or min(indices) >= 0):  # the only warehouse owns every sample
            return
        bad = [i for i in indices if i < 0 or p.owner(i, nw, b) != w]
        if bad:
            rule = "k % n_warehouses" if b == 1 else f"(k // {b}) % n_warehouses"
            raise ValueError(
                f"indices {bad[:8]} are not owned by warehouse {w} of {nw} (index k lives on warehouse {rule})"
            )

    def put(self, indices: list[int], values: dict[str, list[Any]],
            frames: list[tuple[int, set[int]]] | None = None) -> None:
        """Store ``values`` (one per index); ``frames`` are (bytes, positions in ``indices`` whose
        values view that frame), from :func:`streamrl.dock.codec.decode_put`."""
        self.check_owned(indices)
        if len(set(indices)) != len(indices):
            raise ValueError("duplicate indices in one put")
        new_names = [name for name in values if name not in self.column_names]
        if new_names and len(self.column_names) + len(new_names) > p.MAX_COLUMNS:
            raise ValueError(f"column {new_names[0]!r} would make more than {p.MAX_COLUMNS} distinct column names "
                             "in this dock (protocol limit MAX_COLUMNS): reuse column names")
        for i in indices:  # validate the whole put before storing any of it
            row = self.rows.get(i)
            dup = [name for name in values if row is not None and name in row]
            if dup:
                raise ValueError(f"column {dup[0]!r} of sample {i} is already written (columns are write-once)")
        self.column_names.update(new_names)
        for k, i in enumerate(indices):
            row = self.rows.get(i)
            if row is None:
                row = self.rows[i] = {}
                self.counters["samples_stored"] += 1
            for name, vals in values.items():
                row[name] = vals[k]
        for nbytes, users in frames or ():
            if not users:
                continue
            held = _Held(nbytes, len(users))
            self.bytes_held += nbytes
            for k in users:
                self.held.setdefault(indices[k], []).append(held)

    def get(self, indices: list[int], columns: list[str]) -> dict[str, list[Any]]:
        self.check_owned(indices)
        out: dict[str, list[Any]] = {c: [] for c in columns}
        for i in indices:
            row = self.rows.get(i)
            if row is None:
                raise KeyError(f"sample {i} holds no data here (never written, or freed after every consumer acked)")
            for c in columns:
                if c not in row:
                    raise KeyError(f"column {c!r} of sample {i} is not written yet; present: {sorted(row)}")
                out[c].append(row[c])
        return out

    def free(self, indices: list[int]) -> None:
        for i in indices:
            row = self.rows.pop(i, None)
            if row is not None:
                self.counters["frees"] += 1
            for held in self.held.pop(i, ()):
                held.users -= 1
                if held.users == 0:
                    self.bytes_held -= held.nbytes

    def statistics(self) -> dict[str, Any]:
        return {"warehouse_id": self.warehouse_id, "samples": len(self.rows), "bytes_held": self.bytes_held,
                **self.counters}


class RegistrationError(RuntimeError):
    """The controller refused (or never answered) this warehouse's registration."""


# A columns_ready not answered after this long is sent again. Only a link reset loses one, and the
# reconnect resends at once; this is the backstop for a reset the monitor did not report.
READY_RESEND_S = 2.0
ANSWERED_PUTS_KEPT = 1 << 16  # (client, req_id) of puts answered ok: a resent put is answered ok again


@dataclass(eq=False)
class _PendingReady:
    """A put stored here whose columns_ready the controller has not answered yet."""

    data: bytes  # the encoded columns_ready
    client: bytes  # routing id of the client that put, and its put's req_id: answered on the ok
    put_id: int
    sent_at: float


class WarehouseServer:
    def __init__(
        self,
        bind: str,
        controller: str,
        warehouse_id: int,
        n_warehouses: int,
        *,
        secret: str,
        limits: DockLimits | None = None,
        context: zmq.Context | None = None,
        hwm: int = 1000,
        auth: ServerAuth | None = None,
        dock_auth: ClientAuth | None = None,
        block: int = 1,
        policy: DockPolicy | None = None,
    ) -> None:
        """``policy``: the pipeline's declarations; puts and gets are checked against the sender's
        ZAP role before anything is stored or sent (docs/dock-protocol.md §6.2)."""
        wire.raise_fd_limit()  # one fd per connection: held connections must not lock clients out
        self.limits = limits or DockLimits()
        self.policy = policy
        self.store = WarehouseStore(warehouse_id, n_warehouses, block)
        self.ctx = context or zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.RCVHWM, hwm)  # finite: clients bound their in-flight requests too
        self.sock.setsockopt(zmq.SNDHWM, hwm)
        # a frame longer than this disconnects its sender inside libzmq, before the memory exists
        self.sock.setsockopt(zmq.MAXMSGSIZE, self.limits.max_message_bytes)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.BACKLOG, 1024)  # hundreds of clients connect at once at start-up
        # a launched run: only the run's roles read or write here (streamrl.security)
        self.zap: RoleAuthenticator | None = secure_server(self.sock, auth)
        # a client reconnecting after a link reset keeps its routing id: the new link takes it over
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        wire.watch_link(self.sock)
        self.sock.bind(bind)
        self.endpoint: str = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.ctl = self.ctx.socket(zmq.DEALER)
        self.ctl.setsockopt(zmq.LINGER, 0)
        self.ctl.setsockopt(zmq.MAXMSGSIZE, self.limits.max_header_bytes)  # the controller sends headers only
        secure_client(self.ctl, dock_auth)  # to the controller as role `dock`
        # the same routing id on every reconnect: the controller keeps knowing this link as the
        # registered warehouse (ROUTER_HANDOVER there), and its frees reach the new connection
        wire.fixed_routing_id(self.ctl, b"wh-")
        wire.watch_link(self.ctl)
        # connects and disconnects of the controller link: a reconnect is followed by a new hello
        self.ctl_monitor = self.ctl.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED,
                                                       f"inproc://warehouse-link-{os.urandom(8).hex()}")
        self.ctl.connect(controller)
        self.registered = False
        self._secret = secret
        self._ctl_ids = itertools.count(1)
        self._hello_ids: set[int] = set()  # req_ids of the hellos not answered yet: any answer counts
        self._hello_at = 0.0
        self._link_lost = False
        self.readies: dict[int, _PendingReady] = {}  # by columns_ready req_id, oldest first
        self.putting: dict[tuple[bytes, int], int] = {}  # (client, put req_id) -> its pending ready's req_id
        self.answered_puts: OrderedDict[tuple[bytes, int], None] = OrderedDict()
        self._next_resend = 0.0
        self.link = dict.fromkeys(("reconnects", "readies_resent", "puts_resent"), 0)
        self._warn = wire.SparseLog(log).warning  # a peer's garbage in a loop must not fill the disk
        self._hello()
        self._stop = False
        self.parent = ParentWatch()  # set .pid to stop once the launcher is gone (no orphans)

    def register(self, timeout_s: float) -> None:
        """Wait for the controller to accept this warehouse; :class:`RegistrationError` if it refuses
        (wrong secret, id taken by another warehouse, bad id) or does not answer in time."""
        deadline = time.monotonic() + timeout_s
        while not self.registered:
            left = deadline - time.monotonic()
            if left > 0 and not self.ctl.poll(int(min(left, 1.0) * 1000) + 1):
                self._hello()  # asked again each second: a hello lost with a reset link is not waited for
                continue
            if left <= 0:
                raise RegistrationError(f"warehouse {self.store.warehouse_id}: the controller did not answer the "
                                        f"registration within {timeout_s} s (is it running at that endpoint?)")
            self._handle_controller(self.ctl.recv_multipart(flags=zmq.NOBLOCK))

    def stop(self) -> None:
        self._stop = True

    def _hello(self) -> None:
        """(Re-)register: the same id, secret, block and endpoint, answered ok or error."""
        rid = next(self._ctl_ids)
        self._hello_ids.add(rid)
        self._hello_at = time.monotonic()
        st = self.store
        self._to_ctl(p.encoder.encode(p.WarehouseHello(rid, st.warehouse_id, self.endpoint,
                                                       p.PROTOCOL_VERSION, self._secret, st.block)))

    def _on_link_event(self) -> None:
        while True:
            try:
                event = recv_monitor_message(self.ctl_monitor, flags=zmq.NOBLOCK)["event"]
            except zmq.Again:
                return
            if event == zmq.EVENT_DISCONNECTED:
                self._link_lost = True
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED and self._link_lost:
                self._link_lost = False
                self.link["reconnects"] += 1
                log.warning("warehouse %d: the link to the controller was reset; registering again",
                            self.store.warehouse_id)
                self._hello()  # the answer resends what the reset may have lost

    def _reregistered(self) -> None:
        """Accepted again after a link reset: resend every readiness message not yet answered (the
        reset may have lost it or its answer), and list the samples held here in a resync (an empty
        columns_ready) so the controller frees those whose free the reset lost."""
        self._resend_readies(0.0)
        held = sorted(self.store.rows)
        for k in range(0, len(held), p.MAX_ITEMS):
            self._to_ctl(p.encoder.encode(p.ColumnsReady(self.store.warehouse_id, held[k:k + p.MAX_ITEMS], [])))

    def _resend_readies(self, older_than_s: float) -> None:
        now = time.monotonic()
        for ready in self.readies.values():
            if now - ready.sent_at >= older_than_s:
                ready.sent_at = now
                self.link["readies_resent"] += 1
                self._to_ctl(ready.data)

    def _to_ctl(self, data: bytes) -> None:
        """Never blocks the loop: with the link down long enough to fill the queue, a readiness
        message is dropped here and resent by the timer (it stays in self.readies)."""
        try:
            self.ctl.send(data, flags=zmq.NOBLOCK)
        except zmq.Again:
            self._warn("ctl_full", "the queue to the controller is full (link down?): resending later")

    def serve_forever(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.ctl, zmq.POLLIN)
        poller.register(self.ctl_monitor, zmq.POLLIN)
        while not self._stop:
            if self.parent.gone():
                break
            events = dict(poller.poll(100))
            if self.ctl_monitor in events:
                self._on_link_event()
            if self.readies and time.monotonic() >= self._next_resend:
                self._next_resend = time.monotonic() + READY_RESEND_S / 4
                self._resend_readies(READY_RESEND_S)
            if self.ctl in events:
                while True:
                    try:
                        frames = self.ctl.recv_multipart(flags=zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        self._handle_controller(frames)
                    except RegistrationError as exc:
                        log.error("%s: stopping", exc)
                        self._stop = True
                        break
            if self.sock in events:
                for _ in range(256):
                    try:
                        frames = self.sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self.handle(frames)
        self.close()

    def close(self) -> None:
        """Close every socket (``serve_forever`` does on its way out; a server that never served,
        e.g. one whose registration failed, is closed by its owner) so its context can terminate."""
        self.sock.close(linger=0)
        self.ctl.disable_monitor()
        self.ctl_monitor.close(linger=0)
        self.ctl.close(linger=0)

    def _handle_controller(self, frames: list[bytes]) -> None:
        if len(frames) != 1:
            log.warning("dropping a %d-frame message from the controller (expected 1)", len(frames))
            return
        msg, _ = p.decode_request(p.controller_to_warehouse_decoder, frames[0])
        match msg:
            case p.Free(indices=idx):
                self.store.free(idx)
            case p.Ok(req_id=rid) if rid in self._hello_ids:
                self._hello_ids.clear()
                if self.registered:
                    self._reregistered()
                self.registered = True
            case p.Ok(req_id=rid):
                ready = self.readies.pop(rid, None)
                if ready is not None:  # ready at the controller: now the put is ok
                    self._answer_put(ready, p.Ok(ready.put_id))
            case p.ErrorReply(req_id=rid, code=code, message=text):
                ready = self.readies.get(rid)
                if rid in self._hello_ids:
                    raise RegistrationError(f"the controller refused warehouse {self.store.warehouse_id} "
                                            f"({code}): {text}")
                if ready is not None and code == "unauthorized":
                    # the controller no longer knows this link as the warehouse: register again,
                    # whose answer resends this (at most once a second, however many were refused)
                    if time.monotonic() - self._hello_at > 1.0:
                        self._hello()
                elif ready is not None:  # refused for good: the client learns its put failed
                    del self.readies[rid]
                    self._answer_put(ready, p.ErrorReply(ready.put_id, code, f"columns_ready refused: {text}"))
                else:
                    log.warning("error from the controller (%s): %s", code, text)
            case None:
                log.warning("undecodable message from the controller dropped")

    def _answer_put(self, ready: _PendingReady, reply: p.Ok | p.ErrorReply) -> None:
        key = (ready.client, ready.put_id)
        self.putting.pop(key, None)
        if type(reply) is p.Ok:
            self.answered_puts[key] = None
            if len(self.answered_puts) > ANSWERED_PUTS_KEPT:
                self.answered_puts.popitem(last=False)
        self._reply(ready.client, reply)

    def _reply(self, identity: bytes, msg: msgspec.Struct, frames: list[Any] | None = None) -> None:
        try:
            self.sock.send_multipart([identity, p.encoder.encode(msg), *(frames or [])], copy=False,
                                     flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("dropping reply to %r: %s", identity, exc)

    def _error(self, identity: bytes, req_id: int, code: str, message: str) -> None:
        self.store.counters["errors"] += 1
        self._reply(identity, p.ErrorReply(req_id, code, message))

    def handle(self, frames: list[zmq.Frame]) -> None:
        """One message from a client: every one goes through this decode-and-validate path."""
        if len(frames) < 2:
            self._warn("frames", "dropping message with %d frames", len(frames))
            return
        if len(frames[1]) > self.limits.max_header_bytes:  # the length, before copying the frame out
            self._warn("header", "dropping a %d-byte header (limit %d: resources.dock.max_header_mib)",
                       len(frames[1]), self.limits.max_header_bytes)
            return
        identity, header = frames[0].bytes, frames[1].bytes
        if len(frames) - 2 > p.MAX_FRAMES:
            rid = p.salvage_req_id(header)
            if rid is not None:
                self._error(identity, rid, "bad_frames", f"{len(frames) - 2} tensor frames follow the header; "
                            f"at most {p.MAX_FRAMES} may (split the put)")
            return
        msg, error = p.decode_request(p.warehouse_request_decoder, header)
        if msg is None:
            self._warn("decode", "undecodable warehouse request from %r", identity)
            if error is not None:
                self._error(identity, error.req_id, error.code, error.message)
            return
        # the sender's role (ZAP User-Id) from a frame the peer sent: the routing id is the ROUTER's own.
        # Only on an authenticated dock, as the controller: elsewhere there is no ZAP and no role
        role = peer_role(frames[1]) if self.policy is not None and self.policy.authenticated else None
        try:
            self._authorize(msg, role)
            self._dispatch(identity, msg, frames[2:], role)
        except ProtocolViolation as exc:  # authorization: the policy's own codes (forbidden, ...)
            if isinstance(exc, AccessDenied):
                self._warn("forbidden", "refused %s from role %r: %s", type(msg).__name__, role, exc)
            self._error(identity, getattr(msg, "req_id", -1), exc.code, str(exc))
        except (WireFormatError, ValueError, KeyError) as exc:
            text = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
            self._error(identity, getattr(msg, "req_id", -1), "bad_request", str(text))
        except Exception as exc:  # never die of one request
            log.exception("internal error on %s", type(msg).__name__)
            self._error(identity, getattr(msg, "req_id", -1), "internal", f"{type(exc).__name__}: {exc}")

    def _authorize(self, msg: p.WarehouseRequest, role: str | None) -> None:
        """A put only of declared columns its role owns, a get only of columns the role's stage reads
        or writes: refused before the put is stored, so no other role burns a write-once column."""
        if self.policy is None:
            return
        self.policy.require_role(role, type(msg).__name__)
        match msg:
            case p.Put(columns=cols):
                self.policy.check_write(role, [c.name for c in cols])
            case p.Get(columns=names):
                self.policy.check_read(role, names)

    def _dispatch(self, identity: bytes, msg: p.WarehouseRequest, data: list[zmq.Frame],
                  role: str | None = None) -> None:
        st = self.store
        match msg:
            case p.Put(req_id=rid, again=True) if (identity, rid) in self.putting or (identity, rid) in self.answered_puts:
                # the client resent this put after a link reset: stored already, never twice
                self.link["puts_resent"] += 1
                if (identity, rid) in self.answered_puts:
                    self._reply(identity, p.Ok(rid))  # else: answered once its columns_ready is
            case p.Put(req_id=rid, indices=idx, columns=cols, versions=vers, lengths=lens):
                n = len(idx)
                if (vers is not None and len(vers) != n) or (lens is not None and len(lens) != n):
                    raise ValueError(f"versions/lengths must have one entry per index ({n})")
                if (msg.ack_client is None) != (msg.ack_lease is None):
                    raise ValueError("a put's ack needs both ack_client and ack_lease (the lease's holder and id)")
                if len({c.name for c in cols}) != len(cols):
                    raise ValueError("a column name appears twice in one put")
                if data and not any(type(c) is p.TensorColumn for c in cols):
                    raise WireFormatError(f"{len(data)} tensor frames follow a put with no tensor column")
                values, frames = decode_put(cols, data, n, raw=True)
                st.put(idx, values, frames)
                st.counters["puts"] += 1
                st.counters["bytes_in"] += sum(nbytes for nbytes, _ in frames)
                # ok only once the controller has the readiness: a put answered ok is claimable. The
                # writer's role goes along: the controller checks the column owners too
                ready_id = next(self._ctl_ids)
                data = p.encoder.encode(p.ColumnsReady(st.warehouse_id, idx, [c.name for c in cols], vers, lens,
                                                       writer=role, req_id=ready_id, ack_client=msg.ack_client,
                                                       ack_lease=msg.ack_lease))
                self.readies[ready_id] = _PendingReady(data, identity, rid, time.monotonic())
                self.putting[(identity, rid)] = ready_id
                self._to_ctl(data)
            case p.Get(req_id=rid, indices=idx, columns=names):
                if data:
                    raise WireFormatError("a get carries no tensor frames")
                values = st.get(idx, names)
                cols, frames = encode_columns(values, len(idx))
                st.counters["gets"] += 1
                st.counters["bytes_out"] += sum(memoryview(f).nbytes for f in frames)
                self._reply(identity, p.Fetched(rid, idx, cols), frames)
            case p.StatsRequest(req_id=rid):
                if msg.watch is not None or msg.seen is not None or msg.timeout_s:
                    raise ProtocolViolation("bad_field", "a warehouse answers stats at once: watch, seen and "
                                            "timeout_s (a long poll of the consumers' figures) are the controller's")
                stats = {**st.statistics(), **self.link, "readies_pending": len(self.readies)}
                if self.zap is not None:  # handshakes this process's ZAP handler admitted / refused
                    stats["auth"] = {"accepted": self.zap.accepted, "refused": self.zap.refused}
                self._reply(identity, p.Stats(rid, stats))
            case p.Free():
                raise ValueError("free is the controller's message; clients release via the controller")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m streamrl.dock.warehouse", description=__doc__.splitlines()[0])
    ap.add_argument("--bind", required=True, help="tcp://127.0.0.1:0 (port from the OS) or ipc:///path")
    ap.add_argument("--controller", required=True, help="the controller's endpoint")
    ap.add_argument("--id", type=int, required=True, help="this warehouse's id, 0..warehouses-1")
    ap.add_argument("--parent-pid", type=int, default=0, help="exit when this process is gone")
    ap.add_argument("--loop-core", type=int, default=None,
                    help="the core of this server's threads once it serves (streamrl.loop_affinity); default: any")
    ap.add_argument("--warehouses", type=int, default=1)
    ap.add_argument("--register-timeout", type=float, default=60.0,
                    help="seconds to wait for the controller to accept this warehouse")
    ap.add_argument("--block", type=int, default=1, help="samples per ownership block (the controller's --block)")
    ap.add_argument("--policy", default="", help="JSON DockPolicy (streamrl.dock.authz): column owners and "
                    "readers, enforced per role on put and get (default: none)")
    DockLimits.add_arguments(ap)
    args = ap.parse_args(argv)
    logging.basicConfig(level=os.environ.get("STREAMRL_LOG", "WARNING"), format="%(name)s: %(message)s")
    try:
        # I/O threads of the warehouse's context: CURVE encrypts and decrypts in them, one thread
        # per connection, so more help only a warehouse serving several busy clients
        io_threads = int(os.environ.get("STREAMRL_ZMQ_IO_THREADS", "1") or 1)
        context = zmq.Context(io_threads=io_threads) if io_threads > 1 else None
        # the secret and the credentials come from the environment (never argv: any local user
        # can read a command line)
        server = WarehouseServer(args.bind, args.controller, args.id, args.warehouses, secret=secret_from_env(),
                                 limits=DockLimits.from_args(args), auth=ServerAuth.from_env(),
                                 dock_auth=ClientAuth.from_env(), block=args.block, context=context,
                                 policy=parse_policy(args.policy) if args.policy else None)
        server.register(args.register_timeout)  # READY only once the controller accepted us
    except (ValueError, zmq.ZMQError, RegistrationError, msgspec.DecodeError) as exc:
        print(f"warehouse: {exc}", file=sys.stderr)
        return 2
    server.parent.pid = args.parent_pid

    def on_signal(*_: object) -> None:
        server.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print(f"READY {server.endpoint}", flush=True)
    if args.loop_core is not None:  # every thread of the server (streamrl.loop_affinity)
        pin_loop_threads(args.loop_core, every_thread=True)
    gc.freeze()  # start-up objects never die: the collector's full passes need not rescan them (as the controller)
    server.serve_forever()
    server.ctx.destroy(linger=0)  # any socket still open closed, the context's I/O threads ended
    return 0


if __name__ == "__main__":
    code = main()
    # Nothing is left to write once main() returns, so skip the interpreter's teardown: LocalDock.stop,
    # and with it the end of every run, waits for this process to exit.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
