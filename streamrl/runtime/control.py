"""The launcher <-> worker control channel: start barrier, progress, failures, stop.

The launcher binds a ROUTER; each stage worker connects a DEALER. Workers say ``Starting`` as
they connect (from then on a ``Stop`` reaches them, also during a long set-up), ``Ready``
after setup, wait for ``Go`` (so every stage starts together and start-up is timed apart from
training), then stream ``StageBusy`` (when a batch begins and ends, and every 0.5 s: also the
heartbeat) and ``StepReport`` events. A worker that fails sends
``Failed`` with the stage, worker and sample indices before it exits; one that wants the run
to end (target reached) sends ``StopRequest``. The launcher answers with ``Stop``. On SIGTERM the
launcher sends ``Save`` first: the train stage checkpoints after its current step and stops the run.
A step that saves a checkpoint is reported with ``record``: the launcher answers ``Recorded`` once
its row is in metrics.jsonl, and only then does the trainer rename the checkpoint into place.

Trust: a ``Failed`` or ``StopRequest`` ends the run, so the launcher takes events only from the
workers it started. Each worker's spec carries the run's random ``token`` (spec files are written
0600); ``Starting`` must present it, and from then on the launcher accepts events only from that
socket's routing id, and only as the (stage, worker) it registered as. Anything else (undecodable
bytes, a wrong token, an unknown worker, an event from a socket that never said ``Starting``) is
dropped and counted in :meth:`ControlServer.statistics`; the launcher keeps serving everyone else.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import time
from collections.abc import Callable
from typing import Annotated, Any

import anyio
import msgspec
import zmq
import zmq.asyncio

from streamrl import wire
from streamrl.loop_socket import LoopSocket
from streamrl.security import ClientAuth, ServerAuth, release_context, secure_client, secure_server

log = logging.getLogger("streamrl.control")

# A worker event is small: the largest is Failed, whose traceback the client trims to TRACEBACK_CHARS.
MAX_EVENT_BYTES = 1 << 20
TRACEBACK_CHARS = 64_000
WorkerIndex = Annotated[int, msgspec.Meta(ge=0, le=1 << 20)]
# After a Stop, how long a trainer still waits for the launcher to record its last step: at the run's
# normal end the answer follows within milliseconds (the Stop raced it); a launcher that stopped for
# another reason no longer records, and the checkpoint is then left uncommitted.
RECORDED_AFTER_STOP_S = 5.0


def new_token() -> str:
    """A run's control token: 128 random bits, hex."""
    return secrets.token_hex(16)


class _Msg(msgspec.Struct, tag_field="type", forbid_unknown_fields=True):
    pass


class _FromWorker(_Msg):
    """What every worker event carries: which stage worker sent it."""

    stage: str
    worker: WorkerIndex


class Starting(_FromWorker, tag="starting"):
    """First message of a worker: the launcher can reach it (e.g. with Stop) while it sets up."""

    pid: int
    token: str = ""  # the run's token from the worker's spec; see the module's note on trust


class Ready(_FromWorker, tag="ready"):
    pid: int


class StageBusy(_FromWorker, tag="busy", omit_defaults=True):
    busy_s: float  # cumulative seconds inside process()/produce()
    batches: int
    samples: int
    in_batch_s: float = 0.0  # seconds the batch now in process() has run; 0 between batches
    measured_at: float = 0.0  # the worker's time.time() when it measured these (0: unknown)
    # the stage's own figures reported in the batch this report ends (StageMetrics' metrics, one event
    # fewer per batch); measured at ``measured_at``
    metrics: dict[str, float] = msgspec.field(default_factory=dict)


class StageMetrics(_FromWorker, tag="stage_metrics"):
    metrics: dict[str, float]  # latest values; the launcher adds them to each step's row
    measured_at: float = 0.0  # the worker's time.time() when it measured them (0: unknown): they join
    # the rows of steps that ended after it (streamrl.metrics.stage_figures)


class StepReport(_Msg, tag="step"):
    step: int
    metrics: dict[str, float]
    measured_at: float = 0.0  # the trainer's time.time() when the step ended, before its version was
    # visible to generation (0: unknown)
    # answer with Recorded once the row is in metrics.jsonl (flushed to disk): the trainer commits
    # the checkpoint of this step only then, so no checkpoint is ever ahead of the run's metrics
    record: bool = False


class EvalReport(_Msg, tag="eval"):
    step: int  # the policy version evaluated (= the optimizer steps it has)
    metrics: dict[str, float]


class Failed(_FromWorker, tag="failed"):
    indices: list[int]
    message: str
    traceback: str


class StopRequest(_FromWorker, tag="stop_request"):
    reason: str


class Finished(_FromWorker, tag="finished"):
    pass


class Go(_Msg, tag="go"):
    pass


class Stop(_Msg, tag="stop"):
    reason: str


class Recorded(_Msg, tag="recorded"):
    """The row of ``step`` (a StepReport with ``record``) is in metrics.jsonl. Broadcast (the
    StepReport does not say who sent it); every worker but the reporting trainer ignores it."""

    step: int


class Save(_Msg, tag="save"):
    """Save a checkpoint after the current step, then stop (the launcher got SIGTERM). Only the
    train stage acts on it; the run then ends as after a StopRequest."""

    reason: str


WorkerEvent = (Starting | Ready | StageBusy | StageMetrics | StepReport | EvalReport | Failed | StopRequest
               | Finished)
LauncherCommand = Go | Stop | Save | Recorded

encoder = msgspec.msgpack.Encoder()
event_decoder = msgspec.msgpack.Decoder(WorkerEvent)
command_decoder = msgspec.msgpack.Decoder(LauncherCommand)


class ControlClient:
    """A worker's end. Sends are fire-and-forget from the event loop thread."""

    def __init__(self, endpoint: str, stage: str, worker: int, context: zmq.asyncio.Context | None = None,
                 *, token: str = "", auth: ClientAuth | None = None) -> None:
        self.stage = stage
        self.worker = worker
        self.ctx = context or zmq.asyncio.Context.instance()
        # a plain socket served by the event loop (streamrl.loop_socket): a few events every step
        self.sock = self.ctx.socket(zmq.DEALER, socket_class=zmq.Socket)
        self.sock.setsockopt(zmq.LINGER, 2000)  # let the final Failed/Finished reach the launcher
        wire.limit_socket(self.sock, MAX_EVENT_BYTES)  # commands are tiny; the limit keeps it so
        secure_client(self.sock, auth)  # the worker's role (streamrl.security), before the token is even read
        # the launcher knows this worker by its socket's routing id (registered by Starting): a fixed
        # one, taken over by the reconnected link (ROUTER_HANDOVER there), keeps it registered
        # through a link reset, so its events are still taken and a Stop still reaches it
        wire.fixed_routing_id(self.sock, b"wk-")
        wire.watch_link(self.sock)
        self.sock.connect(endpoint)
        self.link = LoopSocket(self.sock, copy=True)
        self.stop_reason: str | None = None
        self.save_reason: str | None = None  # a Save arrived: checkpoint after this step, then stop
        self.recorded = -1  # the newest step whose row the launcher said is in metrics.jsonl
        self.stopped_at: float | None = None  # monotonic time the Stop arrived
        self.launcher_gone = False  # the worker saw its launcher exit: no answer will come
        self._readers = 0  # tasks in wait_stop: while one runs, wait_recorded leaves the socket to it
        self._changed: anyio.Event | None = None  # made by the first waiter (an event loop runs then)
        # called before each step row: the worker's busy meter reports a batch it has not reported
        # yet, so that the row never reaches the launcher ahead of the batch it comes from
        self.before_step: Callable[[], None] | None = None
        # True while a batch runs (the busy meter sets it): stage figures wait for the busy report
        # that ends or interrupts the batch, which comes before the batch's outputs are put
        self.hold_figures = False
        self._figures: dict[str, float] = {}
        self._send(Starting(stage, worker, os.getpid(), token))

    def _send(self, msg: _Msg) -> None:
        self.link.send([encoder.encode(msg)])

    def ready(self) -> None:
        self._send(Ready(self.stage, self.worker, os.getpid()))

    async def _command(self) -> LauncherCommand | None:
        """The next command; Save and Recorded are noted here, whichever wait reads them."""
        frames = await self.link.recv()
        if len(frames) != 1:
            log.warning("dropping a control command of %d frames", len(frames))
            return None
        try:
            cmd = wire.decode(command_decoder, frames[0])
        except wire.WireError as exc:  # only the launcher is connected; still, never die of bytes
            log.warning("dropping an undecodable control command: %s", exc)
            return None
        if isinstance(cmd, Save):
            self.save_reason = cmd.reason
        elif isinstance(cmd, Stop):
            self.stop_reason, self.stopped_at = cmd.reason, time.monotonic()
            self._wake()
        elif isinstance(cmd, Recorded) and cmd.step > self.recorded:
            self.recorded = cmd.step
            self._wake()
        return cmd

    def abandon(self) -> None:
        """The launcher is gone (the worker's parent watch saw it exit): a wait_recorded ends now."""
        self.launcher_gone = True
        self._wake()

    def _wake(self) -> None:
        """Whoever waits in wait_recorded looks again (a step recorded, a Stop, the reader gone)."""
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    async def wait_go(self, timeout_s: float) -> bool:
        """True on Go, False on Stop (the run ended before this worker started)."""
        with anyio.fail_after(timeout_s):
            while True:
                match await self._command():
                    case Go():
                        return True
                    case Stop():
                        return False

    async def wait_stop(self) -> str:
        """Read commands until Stop (a worker runs this in a task of its own all along: it is also
        what delivers Save and Recorded until the Stop)."""
        self._readers += 1
        try:
            while True:
                cmd = await self._command()
                if isinstance(cmd, Stop):
                    return cmd.reason
        finally:
            self._readers -= 1
            self._wake()  # a wait_recorded now reads the socket itself

    async def wait_recorded(self, step: int, timeout_s: float, after_stop_s: float = RECORDED_AFTER_STOP_S) -> bool:
        """Until the launcher says the row of ``step`` is in metrics.jsonl (after :meth:`step` with
        ``record``): True. False when a Stop arrived and no answer within ``after_stop_s`` of it (the
        launcher stopped recording: the run failed elsewhere, or was interrupted), or when the
        launcher is gone (:meth:`abandon`); TimeoutError
        after ``timeout_s``. It reads the socket itself when no :meth:`wait_stop` runs (the Stop of
        the run's normal end can come before the answer: another train rank asked for it)."""
        deadline = time.monotonic() + timeout_s
        while self.recorded < step:
            if self.launcher_gone:
                return False
            until = deadline if self.stopped_at is None else min(deadline, self.stopped_at + after_stop_s)
            left = until - time.monotonic()
            if left <= 0:
                if until < deadline:
                    return False
                raise TimeoutError(f"step {step} not recorded within {timeout_s:g} s")
            with anyio.move_on_after(left):
                if self._readers:
                    if self._changed is None:
                        self._changed = anyio.Event()
                    await self._changed.wait()
                else:
                    await self._command()
        return True

    def busy(self, busy_s: float, batches: int, samples: int, in_batch_s: float = 0.0,
             measured_at: float = 0.0) -> None:
        figures, self._figures = self._figures, {}
        self._send(StageBusy(self.stage, self.worker, busy_s, batches, samples, in_batch_s, measured_at, figures))

    def stage_metrics(self, metrics: dict[str, float], *, defer: bool = False) -> None:
        """``defer``: ride the next busy report (of the batch that is about to run) even outside
        a batch, instead of a message of their own now."""
        values = {k: float(v) for k, v in metrics.items()}
        if self.hold_figures or defer:  # the batch's next busy report carries them
            self._figures.update(values)
        else:
            self._send(StageMetrics(self.stage, self.worker, values, time.time()))

    def step(self, step: int, metrics: dict[str, float], *, record: bool = False, ended_at: float = 0.0) -> None:
        """One optimizer step's row; ``record``: ask for Recorded (:meth:`wait_recorded`);
        ``ended_at``: when the step ended (``time.time()``; 0: now)."""
        if self.before_step is not None:
            self.before_step()
        self._send(StepReport(step, {k: float(v) for k, v in metrics.items()}, ended_at or time.time(), record))

    def eval_report(self, step: int, metrics: dict[str, float]) -> None:
        self._send(EvalReport(step, {k: float(v) for k, v in metrics.items()}))

    def failed(self, indices: list[int], message: str, traceback: str) -> None:
        # the launcher refuses events over MAX_EVENT_BYTES: keep the traceback's end (the raise)
        tb = traceback if len(traceback) <= TRACEBACK_CHARS else "...\n" + traceback[-TRACEBACK_CHARS:]
        self._send(Failed(self.stage, self.worker, indices[:10_000], message[:TRACEBACK_CHARS], tb))

    def stop_request(self, reason: str) -> None:
        self._send(StopRequest(self.stage, self.worker, reason))

    def finished(self) -> None:
        self._send(Finished(self.stage, self.worker))

    @property
    def closed(self) -> bool:
        return self.sock.closed

    def close(self) -> None:
        self.link.close()


class ControlServer:
    """The launcher's end: events from the workers it started, commands to them."""

    def __init__(self, bind: str, context: zmq.asyncio.Context | None = None, *, token: str = "",
                 workers: set[tuple[str, int]] | None = None, auth: ServerAuth | None = None) -> None:
        """``token``: what every worker's ``Starting`` must carry. ``workers``: the (stage, worker)
        pairs that may register; None accepts any (tests that drive the channel by hand)."""
        wire.raise_fd_limit()  # one fd per connection: held connections must not lock clients out
        self.ctx = context or zmq.asyncio.Context.instance()
        # a plain socket served by the event loop (streamrl.loop_socket): every worker's events
        self.sock = self.ctx.socket(zmq.ROUTER, socket_class=zmq.Socket)
        self.sock.setsockopt(zmq.LINGER, 0)
        wire.limit_socket(self.sock, MAX_EVENT_BYTES)
        # only the run's roles complete a handshake (the token is checked too, inside it)
        self.allow_list = secure_server(self.sock, auth)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a worker's reconnected link takes its name over
        wire.watch_link(self.sock)
        self.sock.bind(bind)
        self.endpoint: str = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.link = LoopSocket(self.sock, copy=True)
        self.token = token
        self.workers = workers
        self.identities: dict[tuple[str, int], bytes] = {}
        self.senders: dict[bytes, tuple[str, int]] = {}  # routing id -> the worker it registered as
        self.dropped = dict.fromkeys(("frames", "undecodable", "token", "unknown_worker", "unregistered"), 0)
        self._warn = wire.SparseLog(log).warning  # a flood of garbage must not flood the log

    async def recv(self) -> WorkerEvent | None:
        """The next event; None for a message that is not a trusted, valid event (counted)."""
        frames = await self.link.recv()
        if len(frames) != 2:
            return self._drop("frames", "a message of %d frames", len(frames))
        identity, payload = frames
        try:
            event = wire.decode(event_decoder, payload)
        except wire.WireError as exc:
            return self._drop("undecodable", "an undecodable event: %s", exc)
        if isinstance(event, Starting):
            who = (event.stage, event.worker)
            if not hmac.compare_digest(event.token.encode(), self.token.encode()):
                return self._drop("token", "Starting for %s with a wrong token", who)
            if self.workers is not None and who not in self.workers:
                return self._drop("unknown_worker", "Starting for %s, which this run did not start", who)
            old = self.identities.get(who)
            if old is not None and old != identity:
                self.senders.pop(old, None)  # a restarted worker: its new socket replaces the old one
            self.identities[who] = identity
            self.senders[identity] = who
            return event
        who = self.senders.get(identity)
        if who is None or (isinstance(event, _FromWorker) and (event.stage, event.worker) != who):
            return self._drop("unregistered", "%s from a socket not registered as its sender",
                              type(event).__name__)
        return event

    def _drop(self, reason: str, what: str, *args: object) -> None:
        self.dropped[reason] += 1
        self._warn(reason, "control channel: dropping " + what + " (%d dropped for this reason)", *args,
                   self.dropped[reason])

    def statistics(self) -> dict[str, Any]:
        return {"workers": len(self.identities), "dropped": dict(self.dropped)}

    async def broadcast(self, msg: Any) -> None:
        data = encoder.encode(msg)
        for identity in self.identities.values():
            try:
                self.link.try_send([identity, data])
            except zmq.ZMQError:
                pass  # a worker that is gone does not need the message

    async def send_to(self, who: tuple[str, int], msg: Any) -> None:
        """One command to one worker (e.g. Go to a worker restarted after the run went)."""
        identity = self.identities.get(who)
        if identity is not None:
            try:
                self.link.try_send([identity, encoder.encode(msg)])
            except zmq.ZMQError:
                pass  # gone again: its death is noticed by the launcher

    def pending(self, queue: anyio.abc.ObjectReceiveStream[Any] | None = None) -> bool:
        """Events wait to be read: on the socket, or in ``queue`` (where a reader task moves them).
        A worker that exited cleanly may have sent its last events (a StopRequest) just before."""
        if self.link.message_waiting():
            return True
        stats = getattr(queue, "statistics", None)
        return bool(stats is not None and stats().current_buffer_used)

    def close(self) -> None:
        self.link.close(linger=0)
        if self.allow_list is not None:  # the context's ZAP handler served this run: stop it
            release_context(self.ctx)
