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

On one host the weights skip the socket: a publisher given the run's shared-memory directory
writes each version into a file there (:mod:`streamrl.runtime.policy_file`), and a subscriber
given the same directory asks for it (``WeightsRequest.files``); the reply then names the file
and its layout instead of carrying frames, and the subscriber maps it. A subscriber that cannot
open the file (it was replaced meanwhile, or the publisher is on another host) asks again for
frames; after two such misses in a row it asks for frames only. The file is the snapshot: the
publisher serves frames from the same bytes. Each request says up to which version the subscriber
maps no file any more (``WeightsRequest.done``), so the publisher can write a later version into a
file its readers are done with instead of allocating a new one (policy_file's lifetime).

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
import mmap
import threading
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import anyio
import msgspec
import torch
import zmq
import zmq.asyncio

from streamrl import wire
from streamrl.dock.codec import decode_columns, encode_columns
from streamrl.dock.protocol import TensorColumn
from streamrl.loop_socket import LoopSocket
from streamrl.metrics.trace import tracer
from streamrl.runtime import policy_file
from streamrl.runtime.policy_file import PolicyFileError, WeightSlot
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
    files: bool = False  # the subscriber shares the publisher's shm directory: name the version's file
    # the subscriber maps no policy file of a version <= done (every one it was named, it unmapped):
    # the publisher may write a later version into those files (policy_file's lifetime)
    done: int = -1


class WeightsReply(_Msg, tag="weights_reply"):
    req_id: int
    version: int  # the newest version; < need means the long-poll timed out
    # One column per dtype (a state dict may mix fp32 weights, bf16 and int64 buffers);
    # names[i] are the parameter names of weights[i], in order. None = no weights in this reply.
    names: list[list[str]] | None = None
    weights: list[TensorColumn] | None = None
    # or (a request with files, a publisher with a shm directory): the version's file in it, its size
    # in bytes and where each tensor sits (streamrl.runtime.policy_file); no frames then
    file: str | None = None
    file_bytes: int = 0
    slots: list[WeightSlot] | None = None


_request_decoder = msgspec.msgpack.Decoder(WeightsRequest)
_reply_decoder = msgspec.msgpack.Decoder(WeightsReply)
_encoder = msgspec.msgpack.Encoder()

MAX_REQUEST_BYTES = 64 * 1024
MAX_WAITING = 4096  # peers whose long poll is held at once (a run has one per generate worker)
# files a subscriber could not map in a row before it asks for frames only: one miss is a version
# replaced between the reply and the open; a second says the publisher's directory is not ours
FILE_MISSES_BEFORE_FRAMES = 2


class PolicyTimeout(TimeoutError):
    """The version a stage needs did not appear in time (is the trainer alive?)."""


@dataclass
class VersionFile:
    """A version's file as the publisher holds it: the current version's, or the one before it
    (retired: renamed to a spare's name) until a later version is written into it or it is removed."""

    name: str  # in the shm directory
    size: int  # bytes
    slots: list[WeightSlot]
    mapping: mmap.mmap  # the publisher's writable mapping of it
    version: int
    # peers a reply named it to that have not said they are done with it (WeightsRequest.done)
    readers: set[bytes] = field(default_factory=set)
    # never written again: its bytes went out as frames too (a zero-copy send may still read them),
    # or it was named to more peers than its readers keep
    frozen: bool = False

    def rewritable_as(self, size: int) -> bool:
        """A later version of ``size`` bytes may be written into it: no reader maps it any more."""
        return not self.frozen and not self.readers and self.size == size


@dataclass(frozen=True)
class PolicySnapshot:
    """One version's weights as the publisher serves them (:meth:`PolicyPublisher.snapshot`): host
    tensors nothing writes again, and the version's file where there is one."""

    version: int
    names: list[str]
    tensors: list[torch.Tensor]
    file: VersionFile | None


@dataclass
class _Pending:
    identity: bytes
    req: WeightsRequest
    deadline: float


class PolicyPublisher:
    """Serves the newest policy version from the trainer's process."""

    def __init__(self, bind: str, context: zmq.asyncio.Context | None = None, *,
                 auth: ServerAuth | None = None, shm_dir: Path | None = None) -> None:
        """``shm_dir``: the run's shared-memory scratch directory; each version is written into a
        file there for the subscribers of this host (None: weights go over the socket only)."""
        self.ctx = context or zmq.asyncio.Context.instance()
        # a plain socket served by the event loop (streamrl.loop_socket): a request a version per generator
        self.sock = self.ctx.socket(zmq.ROUTER, socket_class=zmq.Socket)
        self.sock.setsockopt(zmq.LINGER, 0)
        wire.limit_socket(self.sock, MAX_REQUEST_BYTES)
        # the weights go only to processes that prove one of the run's roles
        self.allow_list = secure_server(self.sock, auth)
        self.sock.bind(bind)
        self.endpoint: str = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.link = LoopSocket(self.sock, copy=True)
        self.version = 0
        self._names: list[str] = []
        self._tensors: list[torch.Tensor] = []
        self._pending: dict[bytes, _Pending] = {}  # by peer, oldest first: one waiting request each
        self.files_dir = shm_dir / policy_file.DIRECTORY if shm_dir is not None else None
        if self.files_dir is not None:
            # made once, here, while the run's directory exists; later writes never make it again
            # (policy_file.allocate), so one landing after the run's directories were removed fails
            # instead of leaving a directory that no one owns
            self.files_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.writes_files = self.files_dir is not None  # false once the directory could not hold a version
        self._token = policy_file.new_token()
        self._file: VersionFile | None = None  # the current version's file
        # the previous version's, renamed to a spare's name: written again once no reader maps it
        self._retired: VersionFile | None = None
        self.files_reused = 0  # versions written into a retired version's file instead of a new one
        # a file allocated ahead for the next version (name, bytes, mapping), made by a thread of its own
        # while training goes on: a fresh file's pages cost as much to zero as to fill
        self._spare: tuple[str, int, mmap.mmap] | None = None
        # _spare, _retired and the files' readers: the compute thread's snapshot, the spare's thread
        # and the event loop all touch them
        self._files_lock = threading.Lock()
        self._spare_maker: threading.Thread | None = None
        self._spares = itertools.count()
        self.bytes_sent = 0
        self.files_served = 0  # replies that named the version's file instead of sending it
        self.dropped = 0  # requests that were not valid (counted, logged sparsely)
        self._warn = wire.SparseLog(log).warning

    def snapshot(self, version: int, state: Mapping[str, torch.Tensor], *, owned: bool = False) -> PolicySnapshot:
        """``state`` copied as version ``version`` will be served, for :meth:`publish`: written into
        the version's file where the publisher has a shm directory (one copy, from any device),
        else copied to the host. ``owned=True``: the caller hands over CPU tensors it made for this
        version and never writes them again, so without a file they are served as they are.

        Blocking, and it touches no socket or other process: a trainer runs it on its compute
        thread where it is long (a large model's copy, which the event loop would do on one
        thread), and a single one on its event loop where it is brief (``StageContext.run_brief``)."""
        self._check_newer(version)
        names = list(state)
        if self.files_dir is not None and self.writes_files and state:
            # the file is the snapshot; frames for another host's subscribers are views of it
            name = policy_file.file_name(self._token, version)
            spare = self._take_spare(policy_file.layout(state)[0])
            try:
                size, slots, views, mapped = policy_file.write_snapshot(self.files_dir, name, state, spare)
            except OSError as exc:  # the shared memory cannot hold it: the socket can, from now on
                log.warning("cannot write policy version %d into %s (%s): its weights go over the socket, "
                            "as every later version's", version, self.files_dir, exc)
                self.writes_files = False
            else:
                return PolicySnapshot(version, names, list(views.values()),
                                      VersionFile(name, size, slots, mapped, version))
        if owned and all(t.device.type == "cpu" for t in state.values()):
            return PolicySnapshot(version, names, [t.detach() for t in state.values()], None)
        return PolicySnapshot(version, names, [t.detach().to("cpu", copy=True) for t in state.values()], None)

    async def publish(self, version: int, state: Mapping[str, torch.Tensor] | None = None, *, owned: bool = False,
                      snapshot: PolicySnapshot | None = None) -> None:
        """Make ``version`` current and answer everyone waiting for it at once.

        Its weights: ``state``, snapshotted here (see the module's buffer-lifetime note and
        :meth:`snapshot`), or a ``snapshot`` made beforehand; neither: a version number only."""
        if snapshot is None:
            snapshot = self.snapshot(version, state or {}, owned=owned)
        else:
            try:
                self._check_newer(version)
                if snapshot.version != version or state is not None:
                    raise ValueError(f"publish({version}) was given the snapshot of version {snapshot.version}"
                                     + (" and a state" if state is not None else ""))
            except ValueError:
                if snapshot.file is not None and self.files_dir is not None:
                    policy_file.remove(self.files_dir, snapshot.file.name)  # never served: nothing maps it
                raise
        previous = self._file
        self._names, self._tensors, self._file = snapshot.names, snapshot.tensors, snapshot.file
        self.version = version
        if previous is not None:
            self._retire(previous)
        await self._answer()
        if self._file is not None and self.writes_files:
            self._make_spare(self._file.size)

    def _check_newer(self, version: int) -> None:
        if version <= self.version and self._tensors:
            raise ValueError(f"policy versions must increase: {version} after {self.version}")

    def _retire(self, previous: VersionFile) -> None:
        """The previous version's file once the next is current: kept under a spare's name for a
        later version while its readers may still map it, unless it is frozen (removed then); the
        one retired before it is removed (its readers keep their mappings)."""
        assert self.files_dir is not None
        with self._files_lock:
            older, self._retired = self._retired, None
        if older is not None:
            policy_file.remove(self.files_dir, older.name)
        if previous.frozen:
            policy_file.remove(self.files_dir, previous.name)
            return
        spare = policy_file.spare_name(self._token, next(self._spares))
        if policy_file.retire(self.files_dir, previous.name, spare):
            previous.name = spare
            with self._files_lock:
                self._retired = previous

    def _take_spare(self, size: int) -> tuple[str, int, mmap.mmap] | None:
        """The file the next version is written into: the retired version's where no reader maps
        it any more and its size fits, else the spare allocated ahead (None: a new file)."""
        with self._files_lock:
            retired = self._retired
            if retired is not None and retired.rewritable_as(size):
                self._retired = None
                self.files_reused += 1
                return retired.name, retired.size, retired.mapping
            spare, self._spare = self._spare, None
            return spare

    def _release(self, peer: bytes, done: int) -> None:
        """``peer`` maps no file of a version <= ``done`` any more."""
        with self._files_lock:
            for f in (self._file, self._retired):
                if f is not None and f.version <= done:
                    f.readers.discard(peer)

    def _make_spare(self, size: int) -> None:
        """Allocate the next version's file in a thread of its own (unless one is being made, one of
        that size is ready, or the version just retired is free to be written again)."""
        if self._spare_maker is not None and self._spare_maker.is_alive():
            return
        with self._files_lock:
            retired, spare = self._retired, self._spare
            if (retired is not None and retired.rewritable_as(size)) or (spare is not None and spare[1] == size):
                return
        assert self.files_dir is not None
        directory, name = self.files_dir, policy_file.spare_name(self._token, next(self._spares))

        def make() -> None:
            try:
                mapped = policy_file.allocate(directory, name, size, populate=True)
            except OSError as exc:  # out of shared memory: the next snapshot allocates its own file
                log.warning("could not allocate the next policy version's file: %s", exc)
                return
            with self._files_lock:
                old, self._spare = self._spare, (name, size, mapped)
            if old is not None:
                policy_file.remove(directory, old[0])

        self._spare_maker = threading.Thread(target=make, name="streamrl-policy-spare", daemon=True)
        self._spare_maker.start()

    async def serve(self) -> None:
        """Answer requests forever (run it as a background task)."""
        while True:
            with anyio.move_on_after(self._next_timeout()):
                frames = await self.link.recv()
                if len(frames) != 2:
                    self._drop(f"a weights request of {len(frames)} frames")
                    continue
                identity, payload = frames
                try:
                    req = wire.decode(_request_decoder, payload)
                except wire.WireError as exc:
                    self._drop(f"a malformed weights request: {exc}")
                    continue
                if req.done >= 0 and self.files_dir is not None:
                    self._release(identity, req.done)
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
        if (req.want_weights and req.files and self._file is not None and self.version > req.have
                and self.version >= req.need):
            f = self._file
            with self._files_lock:
                if len(f.readers) < MAX_WAITING:
                    f.readers.add(identity)  # until it says it is done with this version (req.done)
                else:  # more peers than a run has: keep no more state for them, never rewrite this file
                    f.frozen = True
            reply = WeightsReply(req.req_id, self.version, file=f.name, file_bytes=f.size, slots=f.slots)
            self.files_served += 1
        elif req.want_weights and self.version > req.have and self.version >= req.need and self._tensors:
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
            if self._file is not None:  # the frames are views of the file: never write into it again
                self._file.frozen = True
        try:
            if not self.link.try_send([identity, _encoder.encode(reply), *frames]):
                log.warning("could not answer a weights request: the subscriber takes no more messages now")
        except zmq.ZMQError as exc:
            log.warning("could not answer a weights request: %s", exc)

    def close(self) -> None:
        self.link.close(linger=0)
        if self.files_dir is not None:
            if self._spare_maker is not None:
                self._spare_maker.join(timeout=30)
            with self._files_lock:
                spare, self._spare = self._spare, None
                retired, self._retired = self._retired, None
            names = [f.name for f in (self._file, retired) if f is not None] + ([spare[0]] if spare else [])
            for name in names:
                policy_file.remove(self.files_dir, name)
            self._file = None
        if self.allow_list is not None:  # the context's ZAP handler served this run: stop it
            release_context(self.ctx)


class PolicySubscriber:
    """Asks the trainer's publisher for versions and weights. Version 0 is the initial policy,
    which every stage builds itself from the config, so waiting for it costs nothing."""

    def __init__(self, endpoint: str, context: zmq.asyncio.Context | None = None,
                 poll_s: float = 1.0, *, auth: ClientAuth | None = None, shm_dir: Path | None = None) -> None:
        """``shm_dir``: the run's shared-memory scratch directory on this host; weights come as the
        publisher's file there where it shares it (None: over the socket)."""
        self.endpoint = endpoint
        self.auth = auth
        self.ctx = context or zmq.asyncio.Context.instance()
        self.link: LoopSocket | None = None
        self.poll_s = poll_s
        self.known_version = 0
        self._quiet_until = 0.0  # no opportunistic version checks before this (monotonic s)
        self._ids = itertools.count(1)
        self.files_dir = shm_dir / policy_file.DIRECTORY if shm_dir is not None else None
        self._file_misses = 0  # files named by replies that this process could not map, in a row
        # the files this subscriber mapped, by version, as weak references: a mapping is gone once the
        # last tensor viewing it is (its storage holds the one reference), and WeightsRequest.done says so
        self._mapped: list[tuple[int, weakref.ref[mmap.mmap]]] = []
        self._named = -1  # the newest version whose file a reply named to this subscriber
        self.bytes_received = 0  # weights over the socket
        self.files_mapped = 0  # versions taken from the publisher's file

    @property
    def asks_for_files(self) -> bool:
        return self.files_dir is not None and self._file_misses < FILE_MISSES_BEFORE_FRAMES

    def _socket(self) -> LoopSocket:
        if self.link is None:
            sock = self.ctx.socket(zmq.DEALER, socket_class=zmq.Socket)
            sock.setsockopt(zmq.LINGER, 0)
            secure_client(sock, self.auth)
            sock.connect(self.endpoint)
            self.link = LoopSocket(sock)  # zero-copy frames: the weights, when they come over the socket
        return self.link

    async def _ask(self, have: int, need: int, want: bool, wait_s: float, reply_timeout_s: float = 30.0
                   ) -> tuple[WeightsReply, list[zmq.Frame]]:
        link = self._socket()
        rid = next(self._ids)
        files = want and self.asks_for_files
        request = WeightsRequest(rid, have, need, want, wait_s, files, self._done())
        try:
            with anyio.fail_after(wait_s + reply_timeout_s):
                # inside the deadline too: a DEALER whose connection was refused (after a failed
                # handshake libzmq does not reconnect) has no peer, and its send waits for one
                link.send([_encoder.encode(request)])
                while True:
                    frames = await link.recv()
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

    def _done(self) -> int:
        """The newest version v such that this subscriber maps no policy file of a version <= v
        (-1: it has none to report)."""
        self._mapped = [(v, ref) for v, ref in self._mapped if ref() is not None]
        if self._mapped:
            return min(v for v, _ in self._mapped) - 1
        return self._named

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
            got = await self._unpack(have, reply, frames)
            if got[1] is not None:  # a newer version came: a span (the mere checks are not)
                tracer().complete("fetch weights", "policy", started, time.perf_counter(), "policy", have=have,
                                  need=need, version=got[0], bytes=_nbytes(got[1]))
            return got
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else math.inf)
        with tracer().span("fetch weights", "policy", "policy", have=have, need=need) as span:
            while True:
                wait = min(self.poll_s, max(0.0, deadline - time.monotonic()))
                reply, frames = await self._ask(have, need, True, wait)
                if reply.version >= need:
                    version, state = await self._unpack(have, reply, frames)
                    span["version"] = version
                    span["bytes"] = _nbytes(state)
                    return version, state
                if time.monotonic() >= deadline:
                    raise PolicyTimeout(f"policy version {need} did not appear within {timeout_s} s "
                                        f"(newest: {reply.version}; is the trainer running?)")

    async def _unpack(self, have: int, reply: WeightsReply, frames: list[zmq.Frame]
                      ) -> tuple[int, dict[str, torch.Tensor] | None]:
        if reply.file is not None:
            self._named = max(self._named, reply.version)
            try:
                assert self.files_dir is not None  # the request asked for files only with a directory
                mapped, mapping = policy_file.map_file(self.files_dir, reply.file, reply.file_bytes, reply.slots or [])
                self._mapped.append((reply.version, weakref.ref(mapping)))
                del mapping  # the views hold it: it goes with the last of them
            except PolicyFileError as exc:
                # replaced since the reply (a newer version is out), or the publisher's host is not ours
                self._file_misses += 1
                log.info("policy version %d: %s; asking for it over the socket", reply.version, exc)
                reply, frames = await self._ask(have, reply.version, True, 0.0)
                return await self._unpack(have, reply, frames)
            self._file_misses = 0
            self.files_mapped += 1
            return reply.version, mapped
        if reply.weights is None or reply.names is None:
            return have, None
        state: dict[str, torch.Tensor] = {}
        for names, col in zip(reply.names, reply.weights, strict=True):
            values = decode_columns([col], frames, len(names))["w"]
            state.update(zip(names, values, strict=True))
        self.bytes_received += sum(len(f) for f in frames)
        return reply.version, state

    def close(self) -> None:
        if self.link is not None:
            self.link.close(linger=0)
            self.link = None


def _nbytes(state: dict[str, torch.Tensor] | None) -> int:
    return sum(t.numel() * t.element_size() for t in state.values()) if state else 0
