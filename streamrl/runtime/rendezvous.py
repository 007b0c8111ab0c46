"""The torch.distributed rendezvous of a run that spans hosts: a key-value store served by the launcher.

On one host the workers of a world meet through a ``FileStore`` in the run directory. Across
hosts that would need a shared filesystem, and torch's ``TCPStore`` listens on every interface,
unauthenticated, at a port someone has to choose. So ``resources.launch: ray`` has the launcher
serve the store itself: :class:`RendezvousServer` (a ROUTER in a thread of the launcher, CURVE
with the run's keys when it binds beyond loopback) and :class:`RendezvousStore`, a
``torch.distributed.Store`` whose operations are requests to it. Its address comes in each
worker's spec, discovered at run time like every other endpoint; nothing is configured by hand.

Messages are msgspec tagged Structs (msgpack), one request → one reply, each with the client's
``req_id``. The store holds at most :data:`MAX_KEYS` keys of :data:`MAX_KEY_BYTES` and
:data:`MAX_VALUE_BYTES` each; a bad or over-limit request gets an ``Error`` reply and the server
keeps serving. Gets do not block in the server: the client polls until its timeout, so the server
keeps no per-client state.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import threading
import time
from typing import Annotated, Any

import msgspec
import torch.distributed as dist
import zmq
from msgspec import Meta

from streamrl import wire
from streamrl.curve import RunKeys, release_context, secure_client, secure_server

log = logging.getLogger("streamrl.rendezvous")

MAX_KEY_BYTES = 1024
MAX_VALUE_BYTES = 1 << 20  # gloo exchanges addresses of a few hundred bytes per rank
MAX_KEYS = 100_000
MAX_MESSAGE_BYTES = MAX_VALUE_BYTES + 64 * 1024

Key = Annotated[str, Meta(min_length=1, max_length=MAX_KEY_BYTES)]
Value = Annotated[bytes, Meta(max_length=MAX_VALUE_BYTES)]
ReqId = Annotated[int, Meta(ge=0, le=2**63 - 1)]


class _Msg(msgspec.Struct, tag_field="type", forbid_unknown_fields=True):
    pass


class Set(_Msg, tag="set"):
    req_id: ReqId
    key: Key
    value: Value


class Get(_Msg, tag="get"):
    req_id: ReqId
    key: Key


class Add(_Msg, tag="add"):
    req_id: ReqId
    key: Key
    amount: Annotated[int, Meta(ge=-(2**62), le=2**62)]


class CompareSet(_Msg, tag="compare_set"):
    req_id: ReqId
    key: Key
    expected: Value
    desired: Value


class Check(_Msg, tag="check"):
    req_id: ReqId
    keys: Annotated[list[Key], Meta(max_length=1024)]


class Delete(_Msg, tag="delete"):
    req_id: ReqId
    key: Key


class NumKeys(_Msg, tag="num_keys"):
    req_id: ReqId


Request = Set | Get | Add | CompareSet | Check | Delete | NumKeys


class Found(_Msg, tag="found"):
    req_id: int
    value: bytes | None  # None: no such key (yet)


class Number(_Msg, tag="number"):
    req_id: int
    value: int


class Error(_Msg, tag="error"):
    req_id: int
    message: str


Reply = Found | Number | Error

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)


class RendezvousServer:
    """The run's key-value store, served from a thread of the launcher until :meth:`close`."""

    def __init__(self, bind: str, *, curve: RunKeys | None = None) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        wire.limit_socket(self.sock, MAX_MESSAGE_BYTES)
        self.allow_list = secure_server(self.sock, curve)
        self.sock.bind(bind)
        self.endpoint: str = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.data: dict[str, bytes] = {}
        self.refused = 0
        self._warn = wire.SparseLog(log).warning
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="streamrl-rendezvous", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            frames = self.sock.recv_multipart()
            if len(frames) != 2:
                self.refused += 1
                continue
            identity, body = frames
            try:
                req = wire.decode(_request_decoder, body)
            except wire.WireError as exc:
                self.refused += 1
                self._warn("rendezvous: dropped an undecodable request: %s", exc)
                self.sock.send_multipart([identity, _encoder.encode(Error(-1, str(exc)[:1000]))])
                continue
            self.sock.send_multipart([identity, _encoder.encode(self._answer(req))])

    def _answer(self, req: Any) -> Any:
        match req:
            case Set(req_id=rid, key=key, value=value):
                if key not in self.data and len(self.data) >= MAX_KEYS:
                    return Error(rid, f"the rendezvous store holds {MAX_KEYS} keys already")
                self.data[key] = value
                return Found(rid, value)
            case Get(req_id=rid, key=key):
                return Found(rid, self.data.get(key))
            case Add(req_id=rid, key=key, amount=amount):
                try:
                    value = int(self.data.get(key, b"0")) + amount
                except ValueError:
                    return Error(rid, f"key {key!r} does not hold an integer")
                if key not in self.data and len(self.data) >= MAX_KEYS:
                    return Error(rid, f"the rendezvous store holds {MAX_KEYS} keys already")
                self.data[key] = str(value).encode()
                return Number(rid, value)
            case CompareSet(req_id=rid, key=key, expected=expected, desired=desired):
                current = self.data.get(key)
                if (current is None and not expected) or current == expected:
                    if current is None and len(self.data) >= MAX_KEYS:
                        return Error(rid, f"the rendezvous store holds {MAX_KEYS} keys already")
                    self.data[key] = desired
                    return Found(rid, desired)
                return Found(rid, expected if current is None else current)
            case Check(req_id=rid, keys=keys):
                return Number(rid, int(all(k in self.data for k in keys)))
            case Delete(req_id=rid, key=key):
                return Number(rid, int(self.data.pop(key, None) is not None))
            case NumKeys(req_id=rid):
                return Number(rid, len(self.data))
        raise AssertionError(req)  # the decoder admits only the cases above

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close(linger=0)
        release_context(self.ctx)
        self.ctx.term()


class RendezvousError(RuntimeError):
    """The rendezvous server refused a request or did not answer in time."""


class RendezvousStore(dist.Store):
    """A ``torch.distributed.Store`` over a :class:`RendezvousServer`; keys are prefixed with
    ``prefix`` (one world per prefix). Thread-safe: one request at a time."""

    POLL_S = (0.005, 0.2)  # a missing key is asked for again after this, doubling

    def __init__(self, endpoint: str, prefix: str, *, curve: RunKeys | None = None,
                 timeout_s: float = 300.0, request_timeout_s: float = 30.0) -> None:
        super().__init__()
        self.endpoint = endpoint
        self.prefix = prefix.rstrip("/") + "/"
        self.request_timeout_s = request_timeout_s
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        wire.limit_socket(self._sock, MAX_MESSAGE_BYTES)
        secure_client(self._sock, curve)
        self._sock.connect(endpoint)

    # torch.distributed reads and sets the store's timeout through these
    @property
    def timeout(self) -> datetime.timedelta:  # type: ignore[override]
        return datetime.timedelta(seconds=self._timeout_s)

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._timeout_s = timeout.total_seconds()

    def _ask(self, msg: Any) -> Any:
        with self._lock:
            self._sock.send(_encoder.encode(msg))
            deadline = time.monotonic() + self.request_timeout_s
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not self._sock.poll(int(left * 1000)):
                    raise RendezvousError(f"the rendezvous server at {self.endpoint} did not answer within "
                                          f"{self.request_timeout_s:g} s (is the launcher alive?)")
                try:
                    reply = wire.decode(_reply_decoder, self._sock.recv())
                except wire.WireError:
                    continue
                if reply.req_id == msg.req_id:
                    break  # an older reply (of a request that timed out) is skipped
        if isinstance(reply, Error):
            raise RendezvousError(f"the rendezvous server refused {type(msg).__name__}: {reply.message}")
        return reply

    def _key(self, key: str) -> str:
        return self.prefix + key

    def set(self, key: str, value: bytes | str) -> None:  # type: ignore[override]
        data = value.encode() if isinstance(value, str) else bytes(value)
        self._ask(Set(next(self._ids), self._key(key), data))

    def get(self, key: str) -> bytes:  # type: ignore[override]
        self.wait([key])
        value = self._ask(Get(next(self._ids), self._key(key))).value
        if value is None:
            raise RendezvousError(f"rendezvous key {key!r} was deleted while being read")
        return value

    def add(self, key: str, amount: int) -> int:  # type: ignore[override]
        return self._ask(Add(next(self._ids), self._key(key), amount)).value

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:  # type: ignore[override]
        def raw(v: bytes | str) -> bytes:
            return v.encode() if isinstance(v, str) else bytes(v)

        reply = self._ask(CompareSet(next(self._ids), self._key(key), raw(expected), raw(desired)))
        return reply.value or b""

    def check(self, keys: list[str]) -> bool:  # type: ignore[override]
        return bool(self._ask(Check(next(self._ids), [self._key(k) for k in keys])).value)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:  # type: ignore[override]
        limit = self._timeout_s if timeout is None else timeout.total_seconds()
        deadline = time.monotonic() + limit
        pause = self.POLL_S[0]
        while not self.check(keys):
            if time.monotonic() > deadline:
                raise RendezvousError(f"rendezvous keys {keys} did not appear within {limit:g} s: "
                                      "a rank of this world did not start (see the other workers' logs)")
            time.sleep(pause)
            pause = min(pause * 2, self.POLL_S[1])

    def delete_key(self, key: str) -> bool:  # type: ignore[override]
        return bool(self._ask(Delete(next(self._ids), self._key(key))).value)

    def num_keys(self) -> int:  # type: ignore[override]
        return self._ask(NumKeys(next(self._ids))).value

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()
