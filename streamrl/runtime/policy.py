"""Numbered policy versions, from the trainer to whoever needs them.

This is the full-state weight path: the trainer publishes version v (a snapshot of its
weights) after each optimizer step; generators fetch the newest version at or above the one
they need; sources only wait for a version number. The allgather-swap reshard
(:mod:`streamrl.reshard`) moves weights between layouts without a full copy; this module is
the interface the pipeline talks to either way: ``publish`` / ``wait_version`` / ``fetch``.

Wire: ROUTER in the trainer, DEALER in each subscriber; msgspec headers; weights as tensor
frames through the dock codec (large tensors zero-copy). Requests long-poll: the publisher
holds a request until a version >= ``need`` exists or ``timeout_s`` passes.

Buffer lifetime: ``publish`` snapshots (clones) the weights, so the optimizer may update the
live parameters while earlier snapshots are still being sent; a snapshot is freed once it is
replaced and every send that references it has completed (pyzmq holds references until then).

Limits (the publisher serves every generator from the trainer's process, so no request may hurt
it): requests are at most ``MAX_REQUEST_BYTES`` (ZMQ_MAXMSGSIZE: a request is ~50 bytes), decoded
through :func:`streamrl.wire.decode` with ``timeout_s`` in [0, 3600]; each peer has at most one
request waiting (a newer one replaces it: a subscriber only ever waits for its latest), and at
most ``MAX_WAITING`` peers wait at once (beyond that the longest-waiting is answered at once
with the current version, which a subscriber treats as a timed-out long poll and asks again).
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated

import anyio
import msgspec
import torch
import zmq
import zmq.asyncio

from streamrl import wire
from streamrl.dock.codec import decode_columns, encode_columns
from streamrl.dock.protocol import TensorColumn
from streamrl.metrics.trace import tracer
from streamrl.security import ClientAuth, ServerAuth, release_context, secure_client, secure_server

log = logging.getLogger("streamrl.policy")


class _Msg(msgspec.Struct, tag_field="type", forbid_unknown_fields=True):
    pass


class WeightsRequest(_Msg, tag="weights_request"):
    req_id: int
    have: int  # the version the subscriber holds (-1: none); weights come only if newer
    need: int  # answer once a version >= need exists
    want_weights: bool
    timeout_s: Annotated[float, msgspec.Meta(ge=0.0, le=3600.0)]  # long-poll wait; NaN/inf refused


class WeightsReply(_Msg, tag="weights_reply"):
    req_id: int
    version: int  # the newest version; < need means the long-poll timed out
    # One column per dtype (a state dict may mix fp32 weights, bf16 and int64 buffers);
    # names[i] are the parameter names of weights[i], in order. None = no weights in this reply.
    names: list[list[str]] | None = None
    weights: list[TensorColumn] | None = None


_request_decoder = msgspec.msgpack.Decoder(WeightsRequest)
_reply_decoder = msgspec.msgpack.Decoder(WeightsReply)
_encoder = msgspec.msgpack.Encoder()

MAX_REQUEST_BYTES = 64 * 1024
MAX_WAITING = 4096  # peers whose long poll is held at once (a run has one per generate worker)


class PolicyTimeout(TimeoutError):
    """The version a stage needs did not appear in time (is the trainer alive?)."""


@dataclass
class _Pending:
    identity: bytes
    req: WeightsRequest
    deadline: float


class PolicyPublisher:
    """Serves the newest policy version from the trainer's process."""

    def __init__(self, bind: str, context: zmq.asyncio.Context | None = None, *,
                 auth: ServerAuth | None = None) -> None:
        self.ctx = context or zmq.asyncio.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        wire.limit_socket(self.sock, MAX_REQUEST_BYTES)
        # the weights go only to processes that prove one of the run's roles
        self.allow_list = secure_server(self.sock, auth)
        self.sock.bind(bind)
        self.endpoint: str = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.version = 0
        self._names: list[str] = []
        self._tensors: list[torch.Tensor] = []
        self._pending: dict[bytes, _Pending] = {}  # by peer, oldest first: one waiting request each
        self.bytes_sent = 0
        self.dropped = 0  # requests that were not valid (counted, logged sparsely)
        self._warn = wire.SparseLog(log).warning

    async def publish(self, version: int, state: Mapping[str, torch.Tensor], *, owned: bool = False) -> None:
        """Make ``version`` current and answer everyone waiting for it at once.

        Snapshots ``state`` (see the module's buffer-lifetime note). ``owned=True``: the caller
        hands over CPU tensors it made for this version (e.g. a gathered full state dict) and never
        writes them again, so they are served as they are, without a second copy."""
        if version <= self.version and self._tensors:
            raise ValueError(f"policy versions must increase: {version} after {self.version}")
        self._names = list(state)
        if owned and all(t.device.type == "cpu" for t in state.values()):
            self._tensors = [t.detach() for t in state.values()]
        else:
            self._tensors = [t.detach().to("cpu", copy=True) for t in state.values()]
        self.version = version
        await self._answer()

    async def serve(self) -> None:
        """Answer requests forever (run it as a background task)."""
        while True:
            with anyio.move_on_after(self._next_timeout()):
                frames = await self.sock.recv_multipart()
                if len(frames) != 2:
                    self._drop(f"a weights request of {len(frames)} frames")
                    continue
                identity, payload = frames
                try:
                    req = wire.decode(_request_decoder, payload)
                except wire.WireError as exc:
                    self._drop(f"a malformed weights request: {exc}")
                    continue
                self._pending.pop(identity, None)  # its older request is abandoned: keep the newest
                self._pending[identity] = _Pending(identity, req, time.monotonic() + req.timeout_s)
                if len(self._pending) > MAX_WAITING:
                    oldest = next(iter(self._pending.values()))
                    del self._pending[oldest.identity]
                    await self._reply(oldest.identity, oldest.req)
            await self._answer()

    def _drop(self, what: str) -> None:
        self.dropped += 1
        self._warn("drop", "dropping %s (%d dropped so far)", what, self.dropped)

    def _next_timeout(self) -> float:
        if not self._pending:
            return 1.0  # nothing pending: publish() answers new waiters itself
        return max(0.0, min(0.2, min(p.deadline for p in self._pending.values()) - time.monotonic()))

    async def _answer(self) -> None:
        now = time.monotonic()
        due = [p for p in self._pending.values() if self.version >= p.req.need or now >= p.deadline]
        for item in due:
            del self._pending[item.identity]
            await self._reply(item.identity, item.req)

    async def _reply(self, identity: bytes, req: WeightsRequest) -> None:
        frames: list[object] = []
        reply = WeightsReply(req.req_id, self.version)
        if req.want_weights and self.version > req.have and self.version >= req.need and self._tensors:
            by_dtype: dict[str, list[int]] = {}
            for i, t in enumerate(self._tensors):
                by_dtype.setdefault(str(t.dtype), []).append(i)
            names, cols, frames = [], [], []
            for positions in by_dtype.values():
                part_cols, part_frames = encode_columns({"w": [self._tensors[i] for i in positions]}, len(positions))
                col = part_cols[0]
                assert isinstance(col, TensorColumn)
                # frame numbers are per message: shift this column's past the frames before it
                cols.append(msgspec.structs.replace(col, frames=[f + len(frames) for f in col.frames]))
                frames.extend(part_frames)
                names.append([self._names[i] for i in positions])
            reply = WeightsReply(req.req_id, self.version, names, cols)
            self.bytes_sent += sum(memoryview(f).nbytes for f in frames)
        try:
            await self.sock.send_multipart([identity, _encoder.encode(reply), *frames], copy=False,
                                           flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("could not answer a weights request: %s", exc)

    def close(self) -> None:
        self.sock.close(linger=0)
        if self.allow_list is not None:  # the context's ZAP handler served this run: stop it
            release_context(self.ctx)


class PolicySubscriber:
    """Asks the trainer's publisher for versions and weights. Version 0 is the initial policy,
    which every stage builds itself from the config, so waiting for it costs nothing."""

    def __init__(self, endpoint: str, context: zmq.asyncio.Context | None = None,
                 poll_s: float = 1.0, *, auth: ClientAuth | None = None) -> None:
        self.endpoint = endpoint
        self.auth = auth
        self.ctx = context or zmq.asyncio.Context.instance()
        self.sock: zmq.asyncio.Socket | None = None
        self.poll_s = poll_s
        self.known_version = 0
        self._quiet_until = 0.0  # no opportunistic version checks before this (monotonic s)
        self._ids = itertools.count(1)
        self.bytes_received = 0

    def _socket(self) -> zmq.asyncio.Socket:
        if self.sock is None:
            self.sock = self.ctx.socket(zmq.DEALER)
            self.sock.setsockopt(zmq.LINGER, 0)
            secure_client(self.sock, self.auth)
            self.sock.connect(self.endpoint)
        return self.sock

    async def _ask(self, have: int, need: int, want: bool, wait_s: float, reply_timeout_s: float = 30.0
                   ) -> tuple[WeightsReply, list[zmq.Frame]]:
        sock = self._socket()
        rid = next(self._ids)
        await sock.send(_encoder.encode(WeightsRequest(rid, have, need, want, wait_s)))
        try:
            with anyio.fail_after(wait_s + reply_timeout_s):
                while True:
                    frames = await sock.recv_multipart(copy=False)
                    try:
                        reply = wire.decode(_reply_decoder, frames[0].bytes)
                    except wire.WireError as exc:
                        log.warning("dropping an undecodable reply from the policy publisher: %s", exc)
                        continue
                    if reply.req_id == rid:  # older replies belong to requests that timed out
                        self.known_version = max(self.known_version, reply.version)
                        return reply, frames[1:]
        except TimeoutError:
            raise PolicyTimeout(f"the policy publisher at {self.endpoint} did not answer within "
                                f"{wait_s + reply_timeout_s:.0f} s (is the trainer running?)") from None

    async def wait_version(self, need: int, timeout_s: float | None = None) -> int:
        """Wait until version >= ``need`` exists; returns the newest version known."""
        if need <= self.known_version:
            return self.known_version
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else math.inf)
        with tracer().span("wait version", "policy", "policy", need=need) as span:
            while True:
                wait = min(self.poll_s, max(0.0, deadline - time.monotonic()))
                reply, _ = await self._ask(-1, need, False, wait)
                if reply.version >= need:
                    span["version"] = reply.version
                    return reply.version
                if time.monotonic() >= deadline:
                    raise PolicyTimeout(f"policy version {need} did not appear within {timeout_s} s "
                                        f"(newest: {reply.version}; is the trainer running?)")

    async def fetch(
        self, have: int, need: int, timeout_s: float | None = None
    ) -> tuple[int, dict[str, torch.Tensor] | None]:
        """The newest weights if newer than ``have`` (waiting for a version >= ``need``).

        Returns (version, state) with state None when ``have`` is already the newest.
        """
        if need <= have:
            # Only asking whether something newer exists: never wait long for an answer (a
            # pipeline may have no trainer), and after a silence do not ask again for a while.
            if time.monotonic() < self._quiet_until:
                return have, None
            started = time.perf_counter()
            try:
                reply, frames = await self._ask(have, need, True, 0.0, reply_timeout_s=1.0)
            except PolicyTimeout:
                self._quiet_until = time.monotonic() + 10.0
                self.close()  # drop the unanswered request with its socket
                return have, None
            got = self._unpack(have, reply, frames)
            if got[1] is not None:  # a newer version came: a span (the mere checks are not)
                tracer().complete("fetch weights", "policy", started, time.perf_counter(), "policy", have=have,
                                  need=need, version=reply.version, bytes=sum(len(f) for f in frames))
            return got
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else math.inf)
        with tracer().span("fetch weights", "policy", "policy", have=have, need=need) as span:
            while True:
                wait = min(self.poll_s, max(0.0, deadline - time.monotonic()))
                reply, frames = await self._ask(have, need, True, wait)
                if reply.version >= need:
                    span["version"] = reply.version
                    span["bytes"] = sum(len(f) for f in frames)
                    return self._unpack(have, reply, frames)
                if time.monotonic() >= deadline:
                    raise PolicyTimeout(f"policy version {need} did not appear within {timeout_s} s "
                                        f"(newest: {reply.version}; is the trainer running?)")

    def _unpack(self, have: int, reply: WeightsReply, frames: list[zmq.Frame]
                ) -> tuple[int, dict[str, torch.Tensor] | None]:
        if reply.weights is None or reply.names is None:
            return have, None
        state: dict[str, torch.Tensor] = {}
        for names, col in zip(reply.names, reply.weights, strict=True):
            values = decode_columns([col], frames, len(names))["w"]
            state.update(zip(names, values, strict=True))
        self.bytes_received += sum(len(f) for f in frames)
        return reply.version, state

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock = None
