"""What a large or endless input does to a reward server process (issue 25): heartbeats keep being
answered, new clients keep getting in, and what a stranger can and cannot make it hold.

Everything is loopback, bounded in bytes and time; each test starts its own server process.
"""

from __future__ import annotations

import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import pytest
import zmq

from ops.fuzz.servers import rss_mib
from ops.fuzz.zmtp import hold_connections, send_endless_message
from streamrl import wire
from tests.rewards.conftest import LOOPBACK, ServerProcess, Servers

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


def test_a_long_decode_runs_off_the_loop(servers: Servers) -> None:
    """One sample with 4·10^7 token ids (38 MiB): few samples, but seconds of decoding. It is
    decoded in a worker thread, so pings sent meanwhile still come back within PONG_BOUND_S."""
    server = servers.reward_server(LENGTH)
    n_tokens = 40_000_000
    head = msgpack.packb({"type": "score", "request_id": 9})
    head = bytes([head[0] + 1]) + head[1:]
    one = msgpack.packb({"id": 1, "response": "abc"})
    sample = bytes([one[0] + 1]) + one[1:] + msgpack.packb("response_ids") + b"\xdd" + n_tokens.to_bytes(4, "big")
    payload = head + msgpack.packb("samples") + b"\x91" + sample + b"\x05" * n_tokens
    context = zmq.Context()
    try:
        scorer, pinger = _dealer(context, server.endpoint), _dealer(context, server.endpoint)
        scorer.send(payload, copy=False)
        del payload
        worst, nonce, reply = 0.0, 0, None
        deadline = time.monotonic() + 90
        while reply is None:
            assert time.monotonic() < deadline, "no reply to the long request within 90 s"
            nonce += 1
            sent = time.monotonic()
            pinger.send(msgpack.packb({"type": "ping", "nonce": nonce}))
            assert _receive(pinger, 30)["nonce"] == nonce
            worst = max(worst, time.monotonic() - sent)
            if scorer.poll(0):
                reply = msgpack.unpackb(scorer.recv())
            time.sleep(0.02)
        assert reply == {"type": "score_reply", "request_id": 9, "results": [{"id": 1, "score": 3.0}]}, reply
        assert worst < PONG_BOUND_S, f"a pong took {worst:.2f} s while the long request was decoded"
    finally:
        context.destroy(linger=0)


def _ping(endpoint: str, timeout_s: float) -> bool:
    """A fresh client's ping is answered within ``timeout_s``."""
    context = zmq.Context()
    try:
        socket = _dealer(context, endpoint)
        socket.send(msgpack.packb({"type": "ping", "nonce": 1}))
        return bool(socket.poll(int(timeout_s * 1000)))
    finally:
        context.destroy(linger=0)


def _port(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])



HELD = 1100  # the tester's count: past the common soft fd limit of 1024


def test_held_connections_do_not_lock_new_clients_out(servers: Servers) -> None:
    """At a soft fd limit of 1024, 1100 idle connections left libzmq unable to accept (EMFILE) and
    new clients waited until they were released. The server now raises its soft limit to the hard
    one at start, so it is the hard limit (the administrator's) that bounds connections."""
    if wire.raise_fd_limit() < HELD + 200 or resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 2 * HELD:
        pytest.skip("the hard fd limit here is too low to hold the connections")
    # Started with the common default soft limit, as the tester's server was.
    command = [sys.executable, "-m", "streamrl.rewards.cli", "reward-server", LENGTH, "--bind", LOOPBACK]
    server = ServerProcess(["bash", "-c", 'ulimit -Sn 1024 && exec "$@"', "bash", *command])
    servers.started.append(server)
    held = hold_connections("127.0.0.1", _port(server.endpoint), HELD)
    try:
        assert _ping(server.endpoint, 10), f"a new client got no pong while {HELD} connections were held"
    finally:
        for s in held:
            s.close()


def test_a_stranger_cannot_flood_a_curve_server(servers: Servers, tmp_path: Path) -> None:
    """An endless multipart message grows libzmq's buffer without bound (nothing in libzmq bounds
    a message's frame count, docs/reliability.md). Authentication is what holds: a CURVE server
    hangs up on a NULL greeting, so a stranger never gets a frame in and its memory stays flat."""
    keys = tmp_path / "keys"
    made = subprocess.run([sys.executable, "-m", "streamrl.rewards.cli", "keys", "generate", str(keys)],
                          capture_output=True, text=True, timeout=30)
    assert made.returncode == 0, made.stderr
    server = servers.reward_server(LENGTH, "--curve-secret-key", str(keys / "server.key_secret"))
    before = rss_mib(server.proc.pid)
    for _ in range(20):
        sent, closed = send_endless_message("127.0.0.1", _port(server.endpoint), 16 << 20, timeout_s=10)
        assert closed and sent == 0, f"a stranger got {sent} bytes of frames into a CURVE server"
    grown = rss_mib(server.proc.pid) - before
    assert grown < 16, f"the CURVE server grew {grown:.0f} MiB under 20 refused floods"
    assert server.proc.poll() is None


def test_an_endless_message_does_not_stop_pings(servers: Servers) -> None:
    """Without authentication the flood is buffered (about 64 bytes of memory per 3-byte frame:
    that is the documented limit, not asserted here), but libzmq does it in its I/O thread: the
    server keeps answering pings throughout, and serves new clients after the flooder leaves."""
    server = servers.reward_server(LENGTH)
    result: list[tuple[int, bool]] = []
    flood = threading.Thread(
        target=lambda: result.append(send_endless_message("127.0.0.1", _port(server.endpoint), 4 << 20)),
    )
    flood.start()
    try:
        while flood.is_alive():
            assert _ping(server.endpoint, PONG_BOUND_S), "a ping went unanswered during the flood"
    finally:
        flood.join(60)
    assert result and result[0][0] >= 4 << 20, result
    assert _ping(server.endpoint, PONG_BOUND_S)
    assert server.proc.poll() is None
