"""The launcher's control channel and the trainer's policy channel against hostile peers, over
real sockets: forged events are dropped, the run's workers still get through, waiting requests
stay bounded, and a 1 TiB frame declaration is refused."""

from __future__ import annotations

import os

import anyio
import msgspec
import pytest
import torch
import zmq
import zmq.asyncio

from ops.fuzz.zmtp import send_oversized_frame
from streamrl.runtime import control as c
from streamrl.runtime import policy as pol

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

TOKEN = c.new_token()


def _dealer(endpoint: str) -> zmq.asyncio.Socket:
    s = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    return s


async def _next(server: c.ControlServer) -> c.WorkerEvent | None:
    with anyio.fail_after(5):
        return await server.recv()


async def test_control_drops_what_the_run_did_not_send() -> None:
    server = c.ControlServer("tcp://127.0.0.1:0", token=TOKEN, workers={("gen", 0), ("train", 0)})
    stranger, worker = _dealer(server.endpoint), _dealer(server.endpoint)
    try:
        # a stranger: events without Starting, a wrong token, an unknown worker, garbage bytes
        await stranger.send(c.encoder.encode(c.Failed("train", 0, [1], "forged", "")))
        assert await _next(server) is None
        await stranger.send(c.encoder.encode(c.StopRequest("gen", 0, "forged")))
        assert await _next(server) is None
        await stranger.send(c.encoder.encode(c.Starting("gen", 0, os.getpid(), "0" * 32)))
        assert await _next(server) is None
        await stranger.send(c.encoder.encode(c.Starting("ghost", 7, os.getpid(), TOKEN)))
        assert await _next(server) is None
        await stranger.send(b"\xa2\xff\xfe")  # a str that is not UTF-8
        assert await _next(server) is None
        await stranger.send(b"\x91" * 100_000 + b"\x00")  # nested 100,000 deep
        assert await _next(server) is None
        await stranger.send_multipart([b"a", b"b"])
        assert await _next(server) is None
        assert server.statistics()["dropped"] == {
            "frames": 1, "undecodable": 2, "token": 1, "unknown_worker": 1, "unregistered": 2}

        # the real worker registers and is heard; it cannot speak for another worker
        await worker.send(c.encoder.encode(c.Starting("gen", 0, os.getpid(), TOKEN)))
        assert isinstance(await _next(server), c.Starting)
        await worker.send(c.encoder.encode(c.Ready("gen", 0, os.getpid())))
        assert isinstance(await _next(server), c.Ready)
        await worker.send(c.encoder.encode(c.Failed("train", 0, [], "not mine to say", "")))
        assert await _next(server) is None
        await server.broadcast(c.Go())
        with anyio.fail_after(5):
            assert isinstance(c.command_decoder.decode(await worker.recv()), c.Go)
        # the stranger, never registered, gets no command
        assert await stranger.poll(200) == 0
    finally:
        stranger.close(0)
        worker.close(0)
        server.close()


async def test_control_refuses_a_frame_declaring_a_terabyte() -> None:
    server = c.ControlServer("tcp://127.0.0.1:0", token=TOKEN)
    try:
        host, port = server.endpoint.removeprefix("tcp://").rsplit(":", 1)
        closed = await anyio.to_thread.run_sync(send_oversized_frame, host, int(port), 1 << 40)
        assert closed, "the control channel kept a connection that declared a 1 TiB frame"
    finally:
        server.close()


async def test_policy_publisher_keeps_one_waiting_request_per_peer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pol, "MAX_WAITING", 8)
    pub = pol.PolicyPublisher("tcp://127.0.0.1:0")
    peers = [_dealer(pub.endpoint) for _ in range(12)]
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(pub.serve)
            # every peer asks 5 times for a version that will not come for an hour
            for s in peers:
                for rid in range(5):
                    await s.send(msgspec.msgpack.encode(pol.WeightsRequest(rid, -1, 10, False, 3600.0)))
            with anyio.fail_after(10):
                while pub.dropped == 0 and len(pub._pending) < 8:
                    await anyio.sleep(0.05)
                await anyio.sleep(0.3)
            assert len(pub._pending) == 8, "waiting requests must be bounded by MAX_WAITING"
            # the 4 peers pushed out were answered at once with the current version (a timed-out poll)
            answered = 0
            for s in peers:
                while await s.poll(50):
                    reply = msgspec.msgpack.decode(await s.recv(), type=pol.WeightsReply)
                    assert reply.version == 0 and reply.weights is None
                    answered += 1
            assert answered >= 4
            # a hostile timeout is refused, and the publisher still serves a real subscriber
            await peers[0].send(msgspec.msgpack.encode(
                {"type": "weights_request", "req_id": 1, "have": -1, "need": 1, "want_weights": True,
                 "timeout_s": float("nan")}))
            await pub.publish(1, {"w": torch.arange(4.0)})
            sub = pol.PolicySubscriber(pub.endpoint)
            try:
                version, state = await sub.fetch(0, 1, timeout_s=5)
            finally:
                sub.close()
            assert version == 1 and state is not None and torch.equal(state["w"], torch.arange(4.0))
            assert pub.dropped >= 1
            tg.cancel_scope.cancel()
    finally:
        for s in peers:
            s.close(0)
        pub.close()
