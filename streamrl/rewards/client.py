"""The reward client (the score stage's ``backend: zmq``): spreads batches over several reward
servers and survives slow, crashed and restarted ones without losing or double-scoring a sample.

One DEALER socket per server, so the client knows which server answered and balances by itself:
a batch goes to the server with the fewest outstanding requests (ties: least recently chosen),
never to one that already has ``max_in_flight_per_server``. Each request has a deadline; on
timeout, disconnect (seen at once through the socket monitor), heartbeat loss, or a
``shutting_down`` refusal, the batch is sent again, preferably to a server that has not failed it.
A server that comes back (same address) is used again after it answers ``hello``.

Exactly once: a batch is done at its first acceptable reply, from whichever attempt; every later
reply for it is dropped and counted as late. A request that timed out keeps its server slot until
its reply or the connection's loss, so a stuck server fills up and stops being chosen.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Literal

import anyio
import anyio.abc
import msgspec
import zmq
from zmq.utils.monitor import parse_monitor_message

from streamrl import __version__
from streamrl.loop_socket import LoopSocket
from streamrl.rewards import keys
from streamrl.rewards.latency import LatencyWindow
from streamrl.rewards.protocol import (
    PROTOCOL_VERSIONS,
    TRANSIENT_ERROR_CODES,
    ErrorReply,
    Hello,
    HelloReply,
    Ping,
    Pong,
    ProtocolError,
    RewardSample,
    SampleResult,
    Score,
    ScoreReply,
    ScoreRequest,
    check_score,
    decode_server_message,
    encode,
    normalise_score,
)
from streamrl.rewards.results import (
    OnBadReply,
    OnSampleError,
    RewardConfigError,
    RewardError,
    RewardReplyError,
    RewardResult,
    RewardRetriesExhaustedError,
    RewardServersUnavailableError,
    apply_sample_error_policy,
    validate_policies,
)

log = logging.getLogger(__name__)

ServerState = Literal["connecting", "up", "draining", "incompatible"]
_MONITORED_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)
#: How long an ``overloaded`` server is skipped before it is offered batches again.
_OVERLOADED_BACKOFF_S = 0.1
#: Upper bound on one wait for capacity: re-checks backoffs and the no-server deadline.
_CAPACITY_POLL_S = 0.1
#: ZMQ_MAXMSGSIZE of the client's sockets: this many bytes per sample of a request
#: (max_batch_size), at least MIN_REPLY_BYTES. A reply is one result per sample — a score, a few
#: named scores, or an error text (streamrl's server cuts those to 2000 characters) — so this is
#: far above any honest reply, and a server sending more is disconnected (its requests are retried
#: elsewhere) instead of making this process decode millions of results it never asked for.
REPLY_BYTES_PER_SAMPLE = 64 * 2**10
MIN_REPLY_BYTES = 2**20


class RewardEndpoint(msgspec.Struct, frozen=True):
    """A server address, with the path of its CURVE public key file when it is not the client's default."""

    address: str
    curve_server_public_key: str | None = None


class ServerStatistics(msgspec.Struct, frozen=True):
    endpoint: str
    state: str
    #: Requests sent and not answered, including timed-out ones still holding their slot.
    outstanding: int
    requests: int
    replies: int
    samples: int
    timeouts: int
    #: Requests lost to a disconnect or a heartbeat timeout (retried elsewhere).
    lost: int
    bad_replies: int
    #: Requests refused with shutting_down / overloaded (retried elsewhere, not counted as attempts).
    refusals: int
    #: Replies for batches already answered by another attempt (dropped).
    late_replies: int
    disconnects: int
    latency_p50_ms: float | None
    latency_p99_ms: float | None
    last_error: str | None


class RewardClientStatistics(msgspec.Struct, frozen=True):
    batches: int
    samples: int
    #: Requests sent again after a timeout, loss, refusal or bad reply (policy "retry").
    retries: int
    timeouts: int
    late_replies: int
    bad_replies: int
    #: Samples scored with default_score (bad replies with policy "default", failed samples with
    #: on_sample_error "default").
    defaulted_samples: int
    #: Samples for which the reward function failed on the server.
    sample_errors: int
    servers_up: int
    servers: list[ServerStatistics]


class _Attempt:
    __slots__ = ("job", "outcome", "reason", "request_id", "sent_at", "server")

    def __init__(self, request_id: int, job: _Job, server: _Server) -> None:
        self.request_id = request_id
        self.job = job
        self.server = server
        self.sent_at = time.monotonic()
        #: None while pending; then "replied", "timeout", "lost", "refused" or "bad".
        self.outcome: str | None = None
        self.reason = ""


class _Job:
    """One request's worth of samples, until one attempt answers it."""

    __slots__ = ("attempts", "failure", "finished", "results", "samples", "wake")

    def __init__(self, samples: list[RewardSample]) -> None:
        self.samples = samples
        self.attempts: list[_Attempt] = []
        self.results: list[RewardResult] | None = None
        self.failure: RewardError | None = None
        self.finished = False
        self.wake = anyio.Event()

    @property
    def sample_ids(self) -> list[int]:
        return [s.id for s in self.samples]

    def conclude(self, results: list[RewardResult] | None = None, failure: RewardError | None = None) -> None:
        if self.results is None and self.failure is None:
            self.results, self.failure = results, failure
        self.wake.set()


class _Server:
    def __init__(self, endpoint: RewardEndpoint, socket: LoopSocket, monitor: LoopSocket) -> None:
        self.endpoint = endpoint.address
        self.socket = socket
        self.monitor = monitor
        self.state: ServerState = "connecting"
        self.outstanding: dict[int, _Attempt] = {}
        self.last_seen = time.monotonic()
        self.not_before = 0.0
        self.last_chosen = 0
        self.last_error: str | None = None
        self.latency = LatencyWindow()
        self.counts = dict.fromkeys(
            (
                "requests",
                "replies",
                "samples",
                "timeouts",
                "lost",
                "bad_replies",
                "refusals",
                "late_replies",
                "disconnects",
            ),
            0,
        )

    def send(self, message: Hello | Ping | ScoreRequest) -> bool:
        return self.socket.try_send([encode(message)])

    def statistics(self) -> ServerStatistics:
        return ServerStatistics(
            endpoint=self.endpoint,
            state=self.state,
            outstanding=len(self.outstanding),
            latency_p50_ms=self.latency.percentile_ms(50),
            latency_p99_ms=self.latency.percentile_ms(99),
            last_error=self.last_error,
            **self.counts,
        )


class RewardClient:
    """Score samples on external reward servers.

    Use as ``async with RewardClient([...]) as client: results = await client.score(samples)``,
    or ``await client.start(task_group)`` … ``await client.aclose()`` when you own a task group.

    Args (units in the names):
        endpoints: server addresses (``tcp://host:port``, ``ipc://path``) or :class:`RewardEndpoint`.
        timeout_s: per-request deadline; after it the batch is sent again (the late reply, if any,
            is still accepted while no other attempt has answered).
        max_in_flight_per_server: requests outstanding on one server at most (bounds its queue).
        max_batch_size: samples per request; larger ``score`` calls are split and spread.
        max_attempts: requests per batch before :class:`RewardRetriesExhaustedError` (refusals
            from a draining/overloaded server do not count).
        on_bad_reply / on_sample_error / default_score: see :mod:`streamrl.rewards.results`.
        heartbeat_interval_s / heartbeat_timeout_s: ping period, and the silence after which a
            server is presumed dead (its requests are retried). A single-threaded server must
            answer within heartbeat_timeout_s even while scoring.
        no_server_timeout_s: how long a batch may wait with no server able to take it before
            :class:`RewardServersUnavailableError`.
        curve_client_secret_key / curve_server_public_key: paths of this client's ``.key_secret``
            and the servers' ``.key`` (per-server overrides via :class:`RewardEndpoint`).
    """

    def __init__(
        self,
        endpoints: Sequence[str | RewardEndpoint],
        *,
        timeout_s: float = 30.0,
        max_in_flight_per_server: int = 4,
        max_batch_size: int = 64,
        max_attempts: int = 4,
        on_bad_reply: OnBadReply = "fail",
        on_sample_error: OnSampleError = "fail",
        default_score: Score = 0.0,
        heartbeat_interval_s: float = 1.0,
        heartbeat_timeout_s: float = 10.0,
        no_server_timeout_s: float = 120.0,
        curve_client_secret_key: str | Path | None = None,
        curve_server_public_key: str | Path | None = None,
        context: zmq.Context | None = None,
    ) -> None:
        self._endpoints = [
            e if isinstance(e, RewardEndpoint) else RewardEndpoint(address=e) for e in endpoints
        ]
        self._validate(
            timeout_s, max_in_flight_per_server, max_batch_size, max_attempts, heartbeat_interval_s,
            heartbeat_timeout_s, no_server_timeout_s,
        )  # fmt: skip
        validate_policies(on_bad_reply, on_sample_error, default_score)
        self.timeout_s = timeout_s
        self.max_in_flight_per_server = max_in_flight_per_server
        self.max_batch_size = max_batch_size
        self.max_attempts = max_attempts
        self.on_bad_reply = on_bad_reply
        self.on_sample_error = on_sample_error
        self.default_score = normalise_score(default_score)
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.no_server_timeout_s = no_server_timeout_s
        self._curve = self._resolve_curve(curve_client_secret_key, curve_server_public_key)
        self._context = context or zmq.Context.instance()
        self._servers: list[_Server] = []
        self._attempts: dict[int, _Attempt] = {}
        self._request_ids = itertools.count(1)
        self._choices = itertools.count(1)
        self._nonces = itertools.count(1)
        self._capacity: anyio.Event | None = None
        self._scope: anyio.CancelScope | None = None
        self._stopped: anyio.Event | None = None
        self._own_group: anyio.abc.TaskGroup | None = None
        self._closed = False
        self._counts = dict.fromkeys(
            (
                "batches",
                "samples",
                "retries",
                "timeouts",
                "late_replies",
                "bad_replies",
                "defaulted_samples",
                "sample_errors",
            ),
            0,
        )

    def _validate(self, timeout_s: float, max_in_flight: int, max_batch: int, max_attempts: int,
                  hb_interval: float, hb_timeout: float, no_server: float) -> None:  # fmt: skip
        if not self._endpoints:
            raise RewardConfigError("RewardClient needs at least one reward server endpoint")
        for endpoint in self._endpoints:
            if endpoint.address.partition("://")[0] not in ("tcp", "ipc", "inproc"):
                raise RewardConfigError(
                    f"reward server endpoint {endpoint.address!r} must look like tcp://HOST:PORT or ipc://PATH"
                )
        if len({e.address for e in self._endpoints}) != len(self._endpoints):
            raise RewardConfigError(
                f"duplicate reward server endpoints in {[e.address for e in self._endpoints]}"
            )
        checks = [
            (timeout_s > 0, f"timeout_s={timeout_s} must be > 0"),
            (max_in_flight >= 1, f"max_in_flight_per_server={max_in_flight} must be >= 1"),
            (max_batch >= 1, f"max_batch_size={max_batch} must be >= 1"),
            (max_attempts >= 1, f"max_attempts={max_attempts} must be >= 1"),
            (hb_interval > 0, f"heartbeat_interval_s={hb_interval} must be > 0"),
            (hb_timeout > hb_interval, f"heartbeat_timeout_s={hb_timeout} must exceed heartbeat_interval_s={hb_interval}"),
            (no_server > 0, f"no_server_timeout_s={no_server} must be > 0"),
        ]  # fmt: skip
        for ok, message in checks:
            if not ok:
                raise RewardConfigError(message)

    def _resolve_curve(
        self, client_secret: str | Path | None, server_public: str | Path | None
    ) -> dict[str, tuple[Path, Path]] | None:
        """Per endpoint (client secret file, server public file), or None for plaintext; keys are
        read now so a wrong path fails at construction, not at the first connect."""
        wants_curve = (
            client_secret is not None
            or server_public is not None
            or any(e.curve_server_public_key for e in self._endpoints)
        )
        if not wants_curve:
            warning = keys.plaintext_warning([e.address for e in self._endpoints], "client")
            if warning:
                log.warning("%s", warning)
            return None
        if client_secret is None:
            raise RewardConfigError(
                "CURVE needs this client's key pair: pass curve_client_secret_key (a .key_secret file)"
            )
        keys.load_keypair(client_secret)
        resolved = {}
        for endpoint in self._endpoints:
            server_key = endpoint.curve_server_public_key or server_public
            if server_key is None:
                raise RewardConfigError(
                    f"no CURVE server public key for {endpoint.address}: pass curve_server_public_key or set "
                    "it on the RewardEndpoint"
                )
            keys.load_public_key(server_key)
            resolved[endpoint.address] = (Path(client_secret), Path(server_key))
        return resolved

    # -- lifecycle ----------------------------------------------------------------------------------

    async def __aenter__(self) -> RewardClient:
        group = anyio.create_task_group()
        await group.__aenter__()
        self._own_group = group
        try:
            await self.start(group)
        except BaseException as exc:
            await group.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        await self.aclose()
        assert self._own_group is not None
        return await self._own_group.__aexit__(exc_type, exc, tb)

    async def start(self, task_group: anyio.abc.TaskGroup) -> None:
        """Connect to every server and start the I/O tasks in ``task_group``; returns at once
        (servers join as they answer ``hello``; see :meth:`wait_servers_up`)."""
        if self._scope is not None:
            raise RuntimeError("RewardClient.start() called twice")
        self._capacity = anyio.Event()
        self._stopped = anyio.Event()
        await task_group.start(self._run)

    async def aclose(self) -> None:
        """Stop the I/O tasks and close the sockets; batches still waiting fail with RewardError."""
        if self._closed:
            return
        self._closed = True
        self._signal_capacity()
        if self._scope is not None and self._stopped is not None:
            self._scope.cancel()
            await self._stopped.wait()

    async def _run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        assert self._stopped is not None
        try:
            with anyio.CancelScope() as self._scope:
                for endpoint in self._endpoints:
                    self._servers.append(self._connect(endpoint))
                async with anyio.create_task_group() as group:
                    for server in self._servers:
                        group.start_soon(self._read_replies, server)
                        group.start_soon(self._read_monitor, server)
                    group.start_soon(self._heartbeat)
                    task_status.started()
        finally:
            for server in self._servers:
                self._fail_outstanding(server, "client closed")
                server.socket.socket.disable_monitor()
                server.monitor.close(linger=0)
                server.socket.close(linger=0)
            self._stopped.set()

    def _connect(self, endpoint: RewardEndpoint) -> _Server:
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, max(MIN_REPLY_BYTES, REPLY_BYTES_PER_SAMPLE * self.max_batch_size))
        # Queue nothing for a server that is not connected: a restarted server must not receive a
        # burst of stale requests, and a send to a dead one must fail now, not wait.
        socket.setsockopt(zmq.IMMEDIATE, 1)
        socket.setsockopt(zmq.RECONNECT_IVL, 100)
        socket.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        if self._curve is not None:
            keys.configure_client_socket(socket, *self._curve[endpoint.address])
        monitor = socket.get_monitor_socket(_MONITORED_EVENTS)
        socket.connect(endpoint.address)
        return _Server(endpoint, LoopSocket(socket, copy=True), LoopSocket(monitor, copy=True))

    async def wait_servers_up(self, count: int | None = None, *, timeout_s: float = 30.0) -> None:
        """Wait until ``count`` servers (default: all) have answered ``hello``."""
        needed = len(self._endpoints) if count is None else count
        with anyio.fail_after(timeout_s):
            while sum(s.state == "up" for s in self._servers) < needed:
                if self._closed:
                    raise RewardError("RewardClient is closed")
                await self._wait_capacity(_CAPACITY_POLL_S)

    # -- scoring ------------------------------------------------------------------------------------

    async def score(self, samples: Sequence[RewardSample]) -> list[RewardResult]:
        """One result per sample, in order. Raises a :class:`RewardError` subclass on failure."""
        if self._scope is None or self._closed:
            raise RewardError("RewardClient is not running: use `async with RewardClient(...)` or start()")
        for sample in samples:
            if not isinstance(sample, RewardSample):
                raise TypeError(f"score() takes RewardSample objects, got {type(sample).__name__}")
        jobs = [
            _Job(list(samples[i : i + self.max_batch_size]))
            for i in range(0, len(samples), self.max_batch_size)
        ]
        errors: list[RewardError] = []

        async def run(job: _Job, group: anyio.abc.TaskGroup) -> None:
            try:
                await self._run_job(job)
            except RewardError as exc:
                errors.append(exc)
                group.cancel_scope.cancel()  # the call fails: stop its other batches

        async with anyio.create_task_group() as group:
            for job in jobs:
                group.start_soon(run, job, group)
        if errors:
            raise errors[0]
        results = [result for job in jobs for result in job.results or ()]
        self._counts["batches"] += len(jobs)
        return apply_sample_error_policy(results, self.on_sample_error, self.default_score, self._counts)

    async def _run_job(self, job: _Job) -> None:
        failures: list[str] = []
        try:
            while True:
                server = await self._acquire(job)
                attempt = _Attempt(next(self._request_ids), job, server)
                if job.attempts:
                    self._counts["retries"] += 1
                job.attempts.append(attempt)
                job.wake = anyio.Event()
                self._attempts[attempt.request_id] = attempt
                server.outstanding[attempt.request_id] = attempt
                server.counts["requests"] += 1
                if not server.send(ScoreRequest(request_id=attempt.request_id, samples=job.samples)):
                    self._server_lost(server, "could not send: not connected")
                with anyio.move_on_after(self.timeout_s):
                    await job.wake.wait()
                if job.failure is not None:
                    raise job.failure
                if job.results is not None:
                    return
                if attempt.outcome is None:
                    # Keeps its server slot until the reply or the connection's loss (see module doc).
                    attempt.outcome, attempt.reason = "timeout", f"no reply within timeout_s={self.timeout_s}"
                    server.counts["timeouts"] += 1
                    self._counts["timeouts"] += 1
                    log.warning("reward request %d to %s timed out", attempt.request_id, server.endpoint)
                if attempt.outcome != "refused":
                    failures.append(f"{server.endpoint}: {attempt.reason}")
                if len(failures) >= self.max_attempts:
                    raise RewardRetriesExhaustedError(job.sample_ids, failures)
        finally:
            job.finished = True
            for attempt in job.attempts:
                self._attempts.pop(attempt.request_id, None)

    async def _acquire(self, job: _Job) -> _Server:
        """The least-loaded server that can take a request now, preferring ones this job has not
        failed on; waits (up to no_server_timeout_s) while there is none."""
        tried = {a.server for a in job.attempts}
        waiting_since: float | None = None
        while True:
            if self._closed:
                raise RewardError("RewardClient was closed while samples were waiting to be scored")
            now = time.monotonic()
            ready = [
                s for s in self._servers
                if s.state == "up" and len(s.outstanding) < self.max_in_flight_per_server and s.not_before <= now
            ]  # fmt: skip
            if ready:
                candidates = [s for s in ready if s not in tried] or ready
                chosen = min(candidates, key=lambda s: (len(s.outstanding), s.last_chosen))
                chosen.last_chosen = next(self._choices)
                return chosen
            if self._servers and all(s.state == "incompatible" for s in self._servers):
                raise RewardServersUnavailableError(
                    f"no reward server speaks this client's protocol: {self._describe()}"
                )
            waiting_since = now if waiting_since is None else waiting_since
            remaining = self.no_server_timeout_s - (now - waiting_since)
            if remaining <= 0:
                raise RewardServersUnavailableError(
                    f"no reward server could take samples {job.sample_ids[:8]}... for no_server_timeout_s="
                    f"{self.no_server_timeout_s}: {self._describe()}"
                )
            await self._wait_capacity(min(remaining, _CAPACITY_POLL_S))

    def _describe(self) -> str:
        return "; ".join(
            f"{s.endpoint} is {s.state} ({len(s.outstanding)} outstanding"
            + (f", last error: {s.last_error}" if s.last_error else "")
            + ")"
            for s in self._servers
        )

    async def _wait_capacity(self, timeout_s: float) -> None:
        assert self._capacity is not None
        with anyio.move_on_after(timeout_s):
            await self._capacity.wait()

    def _signal_capacity(self) -> None:
        if self._capacity is not None:
            self._capacity.set()
            self._capacity = anyio.Event()

    # -- replies ------------------------------------------------------------------------------------

    async def _read_replies(self, server: _Server) -> None:
        while True:
            # Only the first frame is kept: a valid reply has exactly one (see LoopSocket.recv_capped).
            frames, count = await server.socket.recv_capped(1)
            server.last_seen = time.monotonic()
            if count != 1:
                self._unattributable_bad_reply(server, f"expected one frame per message, got {count}")
                continue
            self._on_message(server, frames[0])

    def _on_message(self, server: _Server, payload: bytes) -> None:
        try:
            message = decode_server_message(payload)
        except ProtocolError as exc:
            if exc.request_id is None:
                self._unattributable_bad_reply(server, f"undecodable reply ({exc.reason})")
            else:
                self._bad_reply(server, exc.request_id, f"malformed reply: {exc.reason}")
            return
        match message:
            case HelloReply(version=version):
                if version in PROTOCOL_VERSIONS:
                    if server.state != "up":
                        log.info(
                            "reward server %s is up (protocol %d, %s)",
                            server.endpoint,
                            version,
                            message.server,
                        )
                    server.state = "up"
                    self._signal_capacity()
                else:
                    self._set_incompatible(
                        server, f"server chose protocol version {version}, not one we offered"
                    )
            case Pong():
                pass
            case ScoreReply(request_id=request_id, results=results):
                self._on_score_reply(server, request_id, results)
            case ErrorReply(code="unsupported_version"):
                self._set_incompatible(server, f"{message.message} (server speaks {message.versions})")
            case ErrorReply(code=code, request_id=None) if code in TRANSIENT_ERROR_CODES:
                # A refusal that names no request: honour what it says about the server (draining,
                # busy) but leave the outstanding requests be; their replies or the disconnect come.
                self._on_refusal(server, None, code, message.message)
            case ErrorReply(request_id=None):
                self._on_anonymous_error(server, f"server error {message.code}: {message.message}")
            case ErrorReply(code=code, request_id=int(request_id)) if code in TRANSIENT_ERROR_CODES:
                self._on_refusal(server, request_id, code, message.message)
            case ErrorReply(request_id=int(request_id)):
                self._bad_reply(server, request_id, f"server error {message.code}: {message.message}")

    def _on_anonymous_error(self, server: _Server, reason: str) -> None:
        """An ``error`` without a request id (the server could not read one of our messages).

        It concerns one of the requests outstanding there, but not knowably which, so every one of
        them fails over now, as if the connection had been lost: each counts as an attempt and goes
        to another server. Waiting for the deadline instead would stall the batch for timeout_s,
        and applying on_bad_reply="fail" to all of them would fail batches that were fine.
        Exactly-once makes the duplicate scoring of an innocent batch harmless.
        """
        server.last_error = reason
        pending = [a for a in server.outstanding.values() if a.outcome is None and not a.job.finished]
        log.warning(
            "reward server %s: %s; failing over its %d outstanding request(s)",
            server.endpoint,
            reason,
            len(pending),
        )
        for attempt in pending:
            server.outstanding.pop(attempt.request_id, None)
            attempt.outcome, attempt.reason = "lost", reason
            server.counts["lost"] += 1
            attempt.job.wake.set()
        self._signal_capacity()

    def _take(self, server: _Server, request_id: int) -> _Attempt | None:
        """The pending attempt this reply answers, or None (and counted) for a late/unknown reply."""
        if server.outstanding.pop(request_id, None) is not None:
            self._signal_capacity()
        attempt = self._attempts.get(request_id)
        job = None if attempt is None or attempt.server is not server else attempt.job
        if job is None or job.finished or job.results is not None or job.failure is not None:
            server.counts["late_replies"] += 1
            self._counts["late_replies"] += 1
            return None
        return attempt

    def _on_score_reply(self, server: _Server, request_id: int, results: list[SampleResult]) -> None:
        attempt = self._take(server, request_id)
        if attempt is None:
            return
        problem = _shape_problem(attempt.job.samples, results)
        if problem is not None:
            self._apply_bad_reply(server, attempt, problem)
            return
        server.latency.add(time.monotonic() - attempt.sent_at)
        server.counts["replies"] += 1
        server.counts["samples"] += len(results)
        attempt.outcome = "replied"
        tries = len(attempt.job.attempts)
        attempt.job.conclude(
            [
                RewardResult(
                    sample_id=r.id,
                    score=None if r.score is None else normalise_score(r.score),
                    error=r.error,
                    source=server.endpoint,
                    attempts=tries,
                )
                for r in results
            ]
        )

    def _on_refusal(self, server: _Server, request_id: int | None, code: str, text: str) -> None:
        attempt = None if request_id is None else self._take(server, request_id)
        server.counts["refusals"] += 1
        if code == "shutting_down":
            server.state = "draining"  # until it disconnects and a successor says hello
        else:
            server.not_before = time.monotonic() + _OVERLOADED_BACKOFF_S
        if attempt is not None and attempt.outcome is None:
            attempt.outcome, attempt.reason = "refused", f"{code}: {text}"
            attempt.job.wake.set()

    def _bad_reply(self, server: _Server, request_id: int, reason: str) -> None:
        attempt = self._take(server, request_id)
        if attempt is None:
            server.counts["bad_replies"] += 1
            self._counts["bad_replies"] += 1
            server.last_error = f"bad reply to request {request_id}: {reason}"
            return
        self._apply_bad_reply(server, attempt, reason)

    def _unattributable_bad_reply(self, server: _Server, reason: str) -> None:
        """A reply with no readable request id: every request outstanding there is suspect."""
        pending = [a for a in server.outstanding.values() if a.outcome is None and not a.job.finished]
        if not pending:
            server.counts["bad_replies"] += 1
            self._counts["bad_replies"] += 1
            server.last_error = reason
            log.warning("reward server %s sent a bad message: %s", server.endpoint, reason)
        for attempt in pending:
            server.outstanding.pop(attempt.request_id, None)
            self._apply_bad_reply(server, attempt, reason)
        self._signal_capacity()

    def _apply_bad_reply(self, server: _Server, attempt: _Attempt, reason: str) -> None:
        server.counts["bad_replies"] += 1
        self._counts["bad_replies"] += 1
        server.last_error = reason
        job = attempt.job
        log.warning(
            "bad reply from reward server %s for samples %s: %s", server.endpoint, job.sample_ids[:8], reason
        )
        attempt.outcome, attempt.reason = "bad", f"bad reply: {reason}"
        if self.on_bad_reply == "fail":
            job.conclude(failure=RewardReplyError(server.endpoint, job.sample_ids, reason))
        elif self.on_bad_reply == "default":
            self._counts["defaulted_samples"] += len(job.samples)
            defaults = [
                RewardResult(
                    sample_id=s.id, score=self.default_score, source="default", attempts=len(job.attempts)
                )
                for s in job.samples
            ]
            job.conclude(defaults)
        elif attempt is job.attempts[-1]:  # "retry": the job loop sends it elsewhere
            job.wake.set()

    # -- server health ------------------------------------------------------------------------------

    def _server_lost(self, server: _Server, reason: str) -> None:
        if server.state in ("up", "draining"):
            log.warning("reward server %s lost: %s", server.endpoint, reason)
            server.counts["disconnects"] += 1
            server.last_error = reason
        elif server.last_error is None:
            # A connection that never got up keeps its more telling error (e.g. a refused handshake).
            server.last_error = reason
        server.state = "connecting"
        self._fail_outstanding(server, reason)

    def _fail_outstanding(self, server: _Server, reason: str) -> None:
        for attempt in server.outstanding.values():
            if attempt.outcome is None:
                attempt.outcome, attempt.reason = "lost", reason
                server.counts["lost"] += 1
                attempt.job.wake.set()
        server.outstanding.clear()
        self._signal_capacity()

    def _set_incompatible(self, server: _Server, reason: str) -> None:
        log.error("reward server %s is incompatible: %s", server.endpoint, reason)
        self._server_lost(server, reason)
        server.state, server.last_error = "incompatible", reason

    def _say_hello(self, server: _Server) -> None:
        server.send(Hello(versions=list(PROTOCOL_VERSIONS), client=f"streamrl/{__version__}"))

    def _reconnect(self, server: _Server) -> None:
        """Replace the connection to ``server`` with a fresh one.

        ZeroMQ reconnects by itself after a connection drop, but not after a protocol error on
        its side — and a reply larger than the socket's MAXMSGSIZE is one: without this, one
        oversized reply would cut the client off that server for good. Disconnect-then-connect is
        right in both cases (it never leaves two connections to one server); a server that is down
        is then retried every RECONNECT_IVL as before.
        """
        socket = server.socket.socket
        try:
            socket.disconnect(server.endpoint)
        except zmq.ZMQError:  # ENOENT: ZeroMQ already dropped the endpoint
            pass
        socket.connect(server.endpoint)

    async def _read_monitor(self, server: _Server) -> None:
        while True:
            event = parse_monitor_message(await server.monitor.recv())["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                server.last_seen = time.monotonic()
                self._say_hello(server)
            elif event == zmq.EVENT_DISCONNECTED:
                self._server_lost(server, "connection lost")
                self._reconnect(server)
            elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                server.last_error = "CURVE authentication refused by the server (is this client's public key on its allow-list?)"
            elif event in (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):
                server.last_error = (
                    "security handshake failed (wrong server public key, or CURVE on one side only?)"
                )

    async def _heartbeat(self) -> None:
        while True:
            await anyio.sleep(self.heartbeat_interval_s)
            now = time.monotonic()
            for server in self._servers:
                if server.state == "connecting":
                    self._say_hello(server)  # answered once the server is reachable and healthy
                elif server.state in ("up", "draining"):
                    if now - server.last_seen > self.heartbeat_timeout_s:
                        self._server_lost(
                            server, f"silent for more than heartbeat_timeout_s={self.heartbeat_timeout_s}"
                        )
                        # Dial again: the silence may be a half-open link (it died without a RST or
                        # FIN), which ZeroMQ never drops by itself (no ZMTP heartbeat on this socket).
                        # Kept, it swallowed every hello and the server was unusable for good; a
                        # frozen server gets the fresh connection once it runs again
                        # (tests/rewards/test_reward_reconnect.py).
                        self._reconnect(server)
                    else:
                        server.send(Ping(nonce=next(self._nonces)))

    def statistics(self) -> RewardClientStatistics:
        """Counters and per-server latency; ``msgspec.to_builtins(...)`` makes it JSON-ready."""
        return RewardClientStatistics(
            servers_up=sum(s.state == "up" for s in self._servers),
            servers=[s.statistics() for s in self._servers],
            **self._counts,
        )


def _shape_problem(samples: list[RewardSample], results: list[SampleResult]) -> str | None:
    """Why ``results`` do not answer ``samples`` one-to-one, in order, with valid scores."""
    if len(results) != len(samples):
        return f"{len(results)} results for {len(samples)} samples"
    for sample, result in zip(samples, results, strict=True):
        if result.id != sample.id:
            return f"result for sample {result.id} where sample {sample.id} was expected (results must be in request order)"
        if (result.score is None) == (result.error is None):
            return f"sample {sample.id}: exactly one of 'score' and 'error' must be set"
        if result.score is not None:
            problem = check_score(result.score)
            if problem is not None:
                return f"sample {sample.id}: {problem}"
    return None
