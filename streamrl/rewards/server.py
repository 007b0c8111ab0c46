"""A reward server: hosts any Python reward function behind the protocol of docs/reward-protocol.md.

One ROUTER socket; the receiving loop never runs the reward function itself, so heartbeats and
version negotiation are answered while batches are being scored. At most ``workers`` batches are
scored at once (sync functions in worker threads, async ones on the loop) and at most
``max_pending`` are accepted (running + waiting); beyond that a request gets an ``overloaded`` error
and the client sends it elsewhere. A function that raises fails its samples, never the server.

Shutdown (SIGTERM/SIGINT, or :meth:`RewardServer.request_shutdown`) is graceful: new batches get a
``shutting_down`` error (clients retry them on another server), batches already accepted are
finished and their replies flushed, then the process exits. A second signal stops at once.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import msgspec
import zmq

from streamrl import __version__, wire
from streamrl.loop_socket import LoopSocket
from streamrl.rewards import keys
from streamrl.rewards.function import RewardFunction
from streamrl.rewards.latency import LatencyWindow
from streamrl.rewards.protocol import (
    PROTOCOL_VERSIONS,
    ClientMessage,
    ErrorReply,
    Hello,
    HelloReply,
    Ping,
    Pong,
    ProtocolError,
    ScoreReply,
    ScoreRequest,
    ServerMessage,
    clip_text,
    decode_client_message,
    encode,
    peek_request_id,
)
from streamrl.rewards.results import RewardConfigError
from streamrl.security import CurveAllowList

log = logging.getLogger(__name__)


LAST_REPLIES_READ_S = 0.25  # connections stay up this long after a drain's last replies (see serve)
#: Default ZMQ_MAXMSGSIZE: a frame declaring more is refused by ZeroMQ before anything is allocated
#: and its connection closed (spec §9). 64 samples of 100k-token responses with text fit easily.
DEFAULT_MAX_MESSAGE_BYTES = 256 * 2**20
#: Default per-request sample limit (docs/reward-protocol.md §9). Decoding costs ~3 µs a sample and
#: holds the loop (and the GIL), so without it one 256 MiB request of 3·10^6 tiny samples froze the
#: server for 12.7 s and its clients dropped it as dead (10 s heartbeat timeout). 16384 samples
#: decode in ~50 ms; streamrl's client sends 64 a request.
DEFAULT_MAX_REQUEST_SAMPLES = 16384
#: Frames kept of one incoming message: [routing id, b"", payload] from a REQ peer is the most a
#: valid message has; the rest of a message with more is dropped (see receive_capped).
_MAX_FRAMES = 3
#: Payloads larger than this are decoded in a worker thread, not on the socket loop: 1 MiB of
#: msgpack decodes in milliseconds, while 200 MiB of token ids in one sample took 12 s.
THREAD_DECODE_BYTES = 1 << 20


class _SampleCount(msgspec.Struct):
    """What is read of a score request before it is decoded: msgspec skips the samples in C as a
    Raw span (~25 ms per 10^6 samples, nothing allocated), so the count is known before any cost."""

    request_id: Any = None
    samples: msgspec.Raw = msgspec.Raw(b"")


_count_decoder = msgspec.msgpack.Decoder(_SampleCount)


def declared_samples(payload: bytes) -> tuple[int, Any] | None:
    """(number of samples, raw request_id) that a score request declares, read from the msgpack
    array header of ``samples`` without building them; None if that cannot be read (the full
    decode then reports what is wrong)."""
    try:
        peek = _count_decoder.decode(payload)
    except wire.DECODE_ERRORS:
        return None
    raw = bytes(memoryview(peek.samples)[:5])
    if not raw:
        return None
    head = raw[0]
    if 0x90 <= head <= 0x9F:  # fixarray
        return head & 0x0F, peek.request_id
    if head == 0xDC and len(raw) >= 3:  # array 16
        return int.from_bytes(raw[1:3], "big"), peek.request_id
    if head == 0xDD and len(raw) >= 5:  # array 32
        return int.from_bytes(raw[1:5], "big"), peek.request_id
    return None


class RewardServerStatistics(msgspec.Struct, frozen=True):
    endpoint: str
    #: Batches accepted and not yet answered (running or waiting for a worker).
    in_flight: int
    batches: int
    samples: int
    #: Samples for which the function raised or returned a non-score.
    sample_errors: int
    #: Messages that could not be decoded or were not valid requests.
    bad_requests: int
    #: Score requests refused with "overloaded" or "shutting_down".
    refused: int
    batch_latency_p50_ms: float | None
    batch_latency_p99_ms: float | None
    curve_clients_refused: int
    shutting_down: bool


class RewardServer:
    """Serve ``function`` (a :class:`RewardFunction`, a callable, or a ``module:function`` spec).

    Call :meth:`bind` (returns the endpoint actually bound: ``tcp://127.0.0.1:0`` picks a free port),
    then run :meth:`serve` (or :meth:`serve_until_signal`) in an anyio event loop.
    """

    def __init__(
        self,
        function: RewardFunction | Callable[..., Any] | str,
        bind: str,
        *,
        workers: int = 4,
        max_pending: int = 256,
        grace_s: float = 30.0,
        curve_secret_key: str | Path | None = None,
        curve_allowed_keys: Iterable[bytes] | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        max_request_samples: int = DEFAULT_MAX_REQUEST_SAMPLES,
        context: zmq.Context | None = None,
    ) -> None:
        if isinstance(function, str):
            function = RewardFunction.from_spec(function)
        elif not isinstance(function, RewardFunction):
            function = RewardFunction(function)
        if workers < 1:
            raise RewardConfigError(f"workers={workers}; need at least 1 concurrent batch")
        if max_pending < workers:
            raise RewardConfigError(f"max_pending={max_pending} must be >= workers={workers}")
        if grace_s <= 0:
            raise RewardConfigError(f"grace_s={grace_s}; seconds to finish in-flight batches, must be > 0")
        if max_message_bytes < 1024:
            raise RewardConfigError(
                f"max_message_bytes={max_message_bytes}; too small for any score request, use >= 1024"
            )
        if max_request_samples < 1:
            raise RewardConfigError(f"max_request_samples={max_request_samples}; must be >= 1")
        if curve_allowed_keys is not None and curve_secret_key is None:
            raise RewardConfigError("a CURVE allow-list needs the server's own key: pass curve_secret_key")
        self.function = function
        self.requested_endpoint = bind
        self.workers = workers
        self.max_pending = max_pending
        self.grace_s = grace_s
        self.name = f"streamrl/{__version__} {function.name}"
        self._curve_secret_key = curve_secret_key
        self._curve_allowed_keys = curve_allowed_keys
        self._max_message_bytes = max_message_bytes
        self.max_request_samples = max_request_samples
        self._context = context or zmq.Context.instance()
        self._socket: LoopSocket | None = None
        self._allow_list: CurveAllowList | None = None
        self.endpoint: str | None = None
        self._in_flight = 0
        self._shutdown_requested = False
        # Event-loop objects, created in serve(): anyio primitives belong to the loop that runs them.
        self._changed: anyio.Event | None = None
        self._slots: anyio.Semaphore | None = None
        self._thread_limiter: anyio.CapacityLimiter | None = None
        self._decode_limiter: anyio.CapacityLimiter | None = None
        self._stop_now: anyio.CancelScope | None = None
        self._latency = LatencyWindow()
        self._counts = {"batches": 0, "samples": 0, "sample_errors": 0, "bad_requests": 0, "refused": 0}
        self._warn = wire.SparseLog(log).warning  # a peer's garbage in a loop must not fill the log

    # -- lifecycle ----------------------------------------------------------------------------------

    def bind(self) -> str:
        """Create and bind the ROUTER socket; return the endpoint actually bound."""
        if self._socket is not None:
            raise RuntimeError("RewardServer.bind() called twice")
        wire.raise_fd_limit()  # one fd per connection: held connections must not lock clients out
        socket = self._context.socket(zmq.ROUTER)
        socket.setsockopt(zmq.MAXMSGSIZE, self._max_message_bytes)
        socket.setsockopt(zmq.LINGER, 0)
        if self._curve_secret_key is not None:
            self._allow_list = CurveAllowList(self._context, self._curve_allowed_keys)
            self._allow_list.start()
            keys.configure_server_socket(socket, self._curve_secret_key)
        else:
            warning = keys.plaintext_warning([self.requested_endpoint], "server")
            if warning:
                log.warning("%s", warning)
        try:
            socket.bind(self.requested_endpoint)
        except zmq.ZMQError as exc:
            socket.close(linger=0)
            self._stop_allow_list()
            raise RewardConfigError(f"cannot bind reward server to {self.requested_endpoint}: {exc}") from exc
        self.endpoint = socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._socket = LoopSocket(socket, copy=True)
        return self.endpoint

    def request_shutdown(self) -> None:
        """Refuse new batches, finish the accepted ones, then make :meth:`serve` return."""
        if not self._shutdown_requested:
            log.info("shutting down: finishing %d in-flight batch(es)", self._in_flight)
            self._shutdown_requested = True
            self._signal_change()

    def stop_now(self) -> None:
        """Stop without waiting for in-flight batches (their replies are lost; clients retry)."""
        self._shutdown_requested = True
        if self._stop_now is not None:
            self._stop_now.cancel()

    async def serve(self) -> None:
        """Serve until :meth:`request_shutdown` has drained the in-flight batches (or grace_s passed)."""
        if self._socket is None:
            self.bind()
        assert self._socket is not None
        self._changed = anyio.Event()
        self._slots = anyio.Semaphore(self.workers)
        self._thread_limiter = anyio.CapacityLimiter(self.workers)
        # One large decode at a time: they hold the GIL, so more at once would only share it.
        self._decode_limiter = anyio.CapacityLimiter(1)
        try:
            with anyio.CancelScope() as self._stop_now:
                async with anyio.create_task_group() as group:
                    group.start_soon(self._receive_loop, group)
                    while not self._shutdown_requested:
                        await self._wait_change()
                    with anyio.move_on_after(self.grace_s) as grace:
                        while self._in_flight:
                            await self._wait_change()
                    if grace.cancelled_caught:
                        log.warning(
                            "grace period of %.1f s over; %d batch(es) abandoned",
                            self.grace_s,
                            self._in_flight,
                        )
                    # Keep the connections up a moment after the last replies: a client socket
                    # with ZMQ_IMMEDIATE (as RewardClient's) discards, when its peer disconnects,
                    # the messages it has received but not yet read (seen: a drained batch's reply
                    # lost about 1 run in 4 when the server closed right after sending it).
                    await anyio.sleep(LAST_REPLIES_READ_S)
                    group.cancel_scope.cancel()
        finally:
            self._refuse_queued()
            # Linger so the replies just queued still reach their clients.
            self._socket.close(linger=2000)
            self._stop_allow_list()

    async def serve_until_signal(self, ready: Callable[[str], None] | None = None) -> None:
        """:meth:`serve`, with SIGTERM/SIGINT starting a graceful shutdown and a second one stopping."""
        endpoint = self.endpoint or self.bind()
        async with anyio.create_task_group() as group:

            async def watch_signals() -> None:
                with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                    async for signum in signals:
                        if self._shutdown_requested:
                            log.warning("second %s: stopping now", signal.Signals(signum).name)
                            self.stop_now()
                        else:
                            log.info("%s received", signal.Signals(signum).name)
                            self.request_shutdown()

            group.start_soon(watch_signals)
            # Signal handlers are installed once watch_signals has run; yield so they are in place
            # before anyone is told the server is ready.
            await anyio.sleep(0)
            if ready is not None:
                ready(endpoint)
            await self.serve()
            group.cancel_scope.cancel()

    def _stop_allow_list(self) -> None:
        if self._allow_list is not None:
            self._allow_list.stop()
            self._allow_list = None

    def _signal_change(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = anyio.Event()

    async def _wait_change(self) -> None:
        assert self._changed is not None
        await self._changed.wait()

    # -- messages -----------------------------------------------------------------------------------

    def _send(self, envelope: list[bytes], message: ServerMessage) -> None:
        assert self._socket is not None
        # ROUTER drops messages for clients that have gone away; nothing to do about those.
        self._socket.try_send([*envelope, encode(message)])

    def _bad_request(self, envelope: list[bytes], message: str, request_id: int | None = None) -> None:
        self._counts["bad_requests"] += 1
        message = clip_text(message)
        self._warn("bad_request", "bad request: %s (%d so far)", message, self._counts["bad_requests"])
        self._send(envelope, ErrorReply(code="bad_request", message=message, request_id=request_id))

    async def _receive_loop(self, group: anyio.abc.TaskGroup) -> None:
        assert self._socket is not None
        while True:
            frames, count = await self._socket.recv_capped(_MAX_FRAMES)
            self._dispatch(frames, count, group)

    def _refuse_queued(self) -> None:
        """Answer what arrived during the last moments of a shutdown (score requests get
        ``shutting_down``), so those clients retry at once instead of waiting for the disconnect."""
        assert self._socket is not None and self._shutdown_requested
        while (received := self._socket.recv_capped_nowait(_MAX_FRAMES)) is not None:
            self._dispatch(*received, None)

    def _dispatch(self, frames: list[bytes], count: int, group: anyio.abc.TaskGroup | None) -> None:
        """Handle one incoming message of ``count`` frames (the first ``_MAX_FRAMES`` in ``frames``);
        scoring is started in ``group`` (None only when refusing).

        Every payload goes through decode_client_message, the one decode-and-validate path, which
        turns anything malformed into a ProtocolError: no message can raise out of here. Payloads
        over THREAD_DECODE_BYTES are decoded in a worker thread (:meth:`_decode_off_loop`).
        """
        # [routing id, payload] from a DEALER; [routing id, b"", payload] from a REQ socket.
        if count == 2:
            envelope, payload = frames[:1], frames[1]
        elif count == 3 and frames[1] == b"":
            envelope, payload = frames[:2], frames[2]
        else:
            self._bad_request(frames[:1], f"expected one msgpack frame per message, got {count - 1}")
            return
        if len(payload) > THREAD_DECODE_BYTES:
            refusal = self._refusal()
            if refusal is not None:  # shutting down or full: answer without decoding it
                self._counts["refused"] += 1
                code, text = refusal
                self._send(envelope, ErrorReply(code=code, message=text, request_id=peek_request_id(payload)))
                return
            assert group is not None  # group is None only while shutting down, refused above
            # The decode holds a pending slot, so max_pending also bounds the payloads held here.
            self._in_flight += 1
            group.start_soon(self._decode_off_loop, envelope, payload, group)
            return
        try:
            message = self._decode(payload)
        except ProtocolError as exc:
            self._bad_request(envelope, exc.reason, exc.request_id)
            return
        self._handle(envelope, message, group)

    def _decode(self, payload: bytes) -> ClientMessage:
        """The typed message in ``payload`` or ProtocolError; touches no server state, so it may
        run in a worker thread."""
        # Count the samples before decoding them: the decode of a huge batch would hold the loop
        # (and with it every ping) for seconds; see DEFAULT_MAX_REQUEST_SAMPLES.
        if len(payload) > self.max_request_samples and (declared := declared_samples(payload)) is not None:
            count, raw_id = declared
            if count > self.max_request_samples:
                ok_id = isinstance(raw_id, int) and not isinstance(raw_id, bool) and 0 <= raw_id <= wire.INT63
                raise ProtocolError(
                    f"request has {count} samples; this server takes at most {self.max_request_samples} "
                    "per request (max_request_samples): split the batch",
                    raw_id if ok_id else None,
                )
        return decode_client_message(payload)

    async def _decode_off_loop(self, envelope: list[bytes], payload: bytes, group: anyio.abc.TaskGroup) -> None:
        """Decode a large payload in a worker thread, then handle it on the loop. msgspec holds the
        GIL while it decodes, but lets it go often enough (measured: the loop ran at least every
        0.8 s through a 12 s decode of 2·10^8 token ids) that pings keep being answered, which a
        decode on the loop itself would block for its whole length."""
        assert self._decode_limiter is not None
        try:
            message = await anyio.to_thread.run_sync(self._decode, payload, limiter=self._decode_limiter)
        except ProtocolError as exc:
            self._bad_request(envelope, exc.reason, exc.request_id)
            return
        finally:
            self._in_flight -= 1
            self._signal_change()
        self._handle(envelope, message, group)

    def _handle(self, envelope: list[bytes], message: ClientMessage, group: anyio.abc.TaskGroup | None) -> None:
        match message:
            case Hello(versions=versions):
                self._send(envelope, self._negotiate(versions))
            case Ping(nonce=nonce):
                self._send(envelope, Pong(nonce=nonce, in_flight=self._in_flight))
            case ScoreRequest(request_id=request_id):
                refusal = self._refusal()
                if refusal is not None:
                    self._counts["refused"] += 1
                    code, text = refusal
                    self._send(envelope, ErrorReply(code=code, message=text, request_id=request_id))
                    return
                assert group is not None
                self._in_flight += 1
                group.start_soon(self._score, envelope, message)

    def _negotiate(self, versions: list[int]) -> HelloReply | ErrorReply:
        common = set(versions) & set(PROTOCOL_VERSIONS)
        if common:
            return HelloReply(version=max(common), server=self.name, workers=self.workers)
        # The offer is the peer's: show a few of its versions, never a reply as large as its hello.
        offered = ", ".join(map(str, versions[:8])) + (", ..." if len(versions) > 8 else "")
        return ErrorReply(
            code="unsupported_version",
            message=f"client speaks protocol versions [{offered}]; this server speaks {list(PROTOCOL_VERSIONS)}",
            versions=list(PROTOCOL_VERSIONS),
        )

    def _refusal(self) -> tuple[str, str] | None:
        if self._shutdown_requested:
            return "shutting_down", "server is shutting down; send this batch to another server"
        if self._in_flight >= self.max_pending:
            return "overloaded", f"server already has {self._in_flight} batches pending (max_pending)"
        return None

    async def _score(self, envelope: list[bytes], request: ScoreRequest) -> None:
        assert self._slots is not None
        started = time.perf_counter()
        try:
            async with self._slots:
                results = await self.function.score(request.samples, limiter=self._thread_limiter)
        except Exception as exc:  # a bug outside the user's function: report it, keep serving
            log.exception("internal error scoring request %d", request.request_id)
            reply: ServerMessage = ErrorReply(
                code="internal", message=f"{type(exc).__name__}: {exc}", request_id=request.request_id
            )
        else:
            reply = ScoreReply(request_id=request.request_id, results=results)
            self._counts["batches"] += 1
            self._counts["samples"] += len(results)
            self._counts["sample_errors"] += sum(r.error is not None for r in results)
            self._latency.add(time.perf_counter() - started)
        finally:
            self._in_flight -= 1
            self._signal_change()
        self._send(envelope, reply)

    def statistics(self) -> RewardServerStatistics:
        return RewardServerStatistics(
            endpoint=self.endpoint or self.requested_endpoint,
            in_flight=self._in_flight,
            batch_latency_p50_ms=self._latency.percentile_ms(50),
            batch_latency_p99_ms=self._latency.percentile_ms(99),
            curve_clients_refused=self._allow_list.refused if self._allow_list else 0,
            shutting_down=self._shutdown_requested,
            **self._counts,
        )
