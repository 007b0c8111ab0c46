"""The launcher <-> worker control channel: start barrier, progress, failures, stop.

The launcher binds a ROUTER; each stage worker connects a DEALER. Workers say ``Starting`` as
they connect (from then on a ``Stop`` reaches them, also during a long set-up), ``Ready``
after setup, wait for ``Go`` (so every stage starts together and start-up is timed apart from
training), then stream ``StageBusy`` and ``StepReport`` events. A worker that fails sends
``Failed`` with the stage, worker and sample indices before it exits; one that wants the run
to end (target reached) sends ``StopRequest``. The launcher answers with ``Stop``.
"""

from __future__ import annotations

import os
from typing import Any

import anyio
import msgspec
import zmq
import zmq.asyncio


class _Msg(msgspec.Struct, tag_field="type", forbid_unknown_fields=True):
    pass


class _FromWorker(_Msg):
    """What every worker event carries: which stage worker sent it."""

    stage: str
    worker: int


class Starting(_FromWorker, tag="starting"):
    """First message of a worker: the launcher can reach it (e.g. with Stop) while it sets up."""

    pid: int


class Ready(_FromWorker, tag="ready"):
    pid: int


class StageBusy(_FromWorker, tag="busy"):
    busy_s: float  # cumulative seconds inside process()/produce()
    batches: int
    samples: int


class StageMetrics(_FromWorker, tag="stage_metrics"):
    metrics: dict[str, float]  # latest values; the launcher adds them to each step's row


class StepReport(_Msg, tag="step"):
    step: int
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


WorkerEvent = Starting | Ready | StageBusy | StageMetrics | StepReport | Failed | StopRequest | Finished
LauncherCommand = Go | Stop

encoder = msgspec.msgpack.Encoder()
event_decoder = msgspec.msgpack.Decoder(WorkerEvent)
command_decoder = msgspec.msgpack.Decoder(LauncherCommand)


class ControlClient:
    """A worker's end. Sends are fire-and-forget from the event loop thread."""

    def __init__(self, endpoint: str, stage: str, worker: int, context: zmq.asyncio.Context | None = None) -> None:
        self.stage = stage
        self.worker = worker
        self.ctx = context or zmq.asyncio.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 2000)  # let the final Failed/Finished reach the launcher
        self.sock.connect(endpoint)
        self.stop_reason: str | None = None
        self._send(Starting(stage, worker, os.getpid()))

    def _send(self, msg: _Msg) -> None:
        self.sock.send(encoder.encode(msg))

    def ready(self) -> None:
        self._send(Ready(self.stage, self.worker, os.getpid()))

    async def wait_go(self, timeout_s: float) -> bool:
        """True on Go, False on Stop (the run ended before this worker started)."""
        with anyio.fail_after(timeout_s):
            while True:
                cmd = command_decoder.decode(await self.sock.recv())
                match cmd:
                    case Go():
                        return True
                    case Stop(reason=reason):
                        self.stop_reason = reason
                        return False

    async def wait_stop(self) -> str:
        while True:
            cmd = command_decoder.decode(await self.sock.recv())
            if isinstance(cmd, Stop):
                self.stop_reason = cmd.reason
                return cmd.reason

    def busy(self, busy_s: float, batches: int, samples: int) -> None:
        self._send(StageBusy(self.stage, self.worker, busy_s, batches, samples))

    def stage_metrics(self, metrics: dict[str, float]) -> None:
        self._send(StageMetrics(self.stage, self.worker, {k: float(v) for k, v in metrics.items()}))

    def step(self, step: int, metrics: dict[str, float]) -> None:
        self._send(StepReport(step, {k: float(v) for k, v in metrics.items()}))

    def failed(self, indices: list[int], message: str, traceback: str) -> None:
        self._send(Failed(self.stage, self.worker, indices, message, traceback))

    def stop_request(self, reason: str) -> None:
        self._send(StopRequest(self.stage, self.worker, reason))

    def finished(self) -> None:
        self._send(Finished(self.stage, self.worker))

    def close(self) -> None:
        self.sock.close()


class ControlServer:
    """The launcher's end."""

    def __init__(self, bind: str, context: zmq.asyncio.Context | None = None) -> None:
        self.ctx = context or zmq.asyncio.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(bind)
        self.endpoint: str = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.identities: dict[tuple[str, int], bytes] = {}

    async def recv(self) -> WorkerEvent | None:
        """The next event; None for a message that is not a valid event (logged by the caller)."""
        frames = await self.sock.recv_multipart()
        if len(frames) != 2:
            return None  # not [identity, event]: ignore it, the launcher serves everyone else
        identity, payload = frames
        try:
            event = event_decoder.decode(payload)
        except msgspec.DecodeError:
            return None
        if isinstance(event, Starting | Ready):
            self.identities[(event.stage, event.worker)] = identity
        return event

    async def broadcast(self, msg: Any) -> None:
        data = encoder.encode(msg)
        for identity in self.identities.values():
            try:
                await self.sock.send_multipart([identity, data], flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # a worker that is gone does not need the message

    def close(self) -> None:
        self.sock.close(linger=0)
