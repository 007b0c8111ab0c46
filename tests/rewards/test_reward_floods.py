"""What a large or endless input does to a reward server process (issue 25): heartbeats keep being
answered, new clients keep getting in, and what a stranger can and cannot make it hold.

Everything is loopback, bounded in bytes and time; each test starts its own server process.
"""

from __future__ import annotations

import time

import msgpack
import pytest
import zmq

from tests.rewards.conftest import Servers

pytestmark = pytest.mark.timeout(120)

LENGTH = "tests.rewards.reward_test_functions:length"
#: Far below the 12.7 s the tester saw and the client's 10 s heartbeat timeout; loose enough for
#: two cores shared with other test runs.
PONG_BOUND_S = 2.0


def _score_payload(request_id: int, n_samples: int) -> bytes:
    """A score request of ``n_samples`` one-letter samples, built as bytes (packing 3·10^6 dicts
    in Python would take longer than the server needs to refuse them)."""
    head = msgpack.packb({"type": "score", "request_id": request_id})
    head = bytes([head[0] + 1]) + head[1:]  # one more map entry: "samples"
    sample = msgpack.packb({"id": 5, "prompt": "p", "response": "x"})
    return head + msgpack.packb("samples") + b"\xdd" + n_samples.to_bytes(4, "big") + sample * n_samples


def _dealer(context: zmq.Context, endpoint: str) -> zmq.Socket:
    socket = context.socket(zmq.DEALER)
    socket.linger = 0
    socket.connect(endpoint)
    return socket


def _receive(socket: zmq.Socket, timeout_s: float) -> dict:
    assert socket.poll(int(timeout_s * 1000)), f"no reply within {timeout_s} s"
    return msgpack.unpackb(socket.recv())


def test_a_huge_request_is_refused_while_pings_keep_being_answered(servers: Servers) -> None:
    server = servers.reward_server(LENGTH, "--max-request-samples", "1000")
    context = zmq.Context()
    try:
        scorer, pinger = _dealer(context, server.endpoint), _dealer(context, server.endpoint)
        # At the limit: scored as usual.
        scorer.send(_score_payload(1, 1000))
        reply = _receive(scorer, 30)
        assert reply["type"] == "score_reply" and len(reply["results"]) == 1000
        # One over: refused by count, with the request id, before a sample is decoded.
        scorer.send(_score_payload(2, 1001))
        reply = _receive(scorer, 10)
        assert (reply["type"], reply["code"], reply["request_id"]) == ("error", "bad_request", 2)
        assert "1001 samples" in reply["message"] and "max_request_samples" in reply["message"]

        # The tester's case: 3·10^6 samples (46 MiB, under the 256 MiB message limit) took the
        # loop 12.7 s to decode. Pings sent all along must come back within PONG_BOUND_S.
        scorer.send(_score_payload(3, 3_000_000))
        worst, nonce, refused = 0.0, 0, None
        deadline = time.monotonic() + 60
        while refused is None or nonce < 10:
            assert time.monotonic() < deadline, "no refusal of the huge request within 60 s"
            nonce += 1
            sent = time.monotonic()
            pinger.send(msgpack.packb({"type": "ping", "nonce": nonce}))
            pong = _receive(pinger, 30)
            worst = max(worst, time.monotonic() - sent)
            assert pong["type"] == "pong" and pong["nonce"] == nonce
            if refused is None and scorer.poll(0):
                refused = msgpack.unpackb(scorer.recv())
            time.sleep(0.02)
        assert (refused["code"], refused["request_id"]) == ("bad_request", 3), refused
        assert "3000000 samples" in refused["message"]
        assert worst < PONG_BOUND_S, f"a pong took {worst:.2f} s while the huge request was handled"
    finally:
        context.destroy(linger=0)
