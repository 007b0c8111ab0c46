"""The reward server process, driven by raw ZeroMQ sockets speaking the documented protocol."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator

import msgpack
import pytest
import zmq

from tests.rewards.conftest import ServerProcess, Servers

FUNCTIONS = "tests.rewards.reward_test_functions"


class RawClient:
    """A plain DEALER (or REQ) socket: what a client in another language would use."""

    def __init__(self, endpoint: str, socket_type: int = zmq.DEALER) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(socket_type)
        self.socket.linger = 0
        self.socket.connect(endpoint)

    def send(self, message: object) -> None:
        self.socket.send(msgpack.packb(message))

    def receive(self, timeout_s: float = 5.0) -> dict:
        if not self.socket.poll(int(timeout_s * 1000)):
            raise AssertionError(f"no reply within {timeout_s}s")
        frames = self.socket.recv_multipart()
        assert len(frames) == 1, frames
        return msgpack.unpackb(frames[0])

    def request(self, message: object) -> dict:
        self.send(message)
        return self.receive()

    def close(self) -> None:
        self.socket.close()
        self.context.term()


@pytest.fixture
def raw_clients() -> Iterator[list[RawClient]]:
    made: list[RawClient] = []
    try:
        yield made
    finally:
        for client in made:
            client.close()


def connect(raw_clients: list[RawClient], server: ServerProcess, socket_type: int = zmq.DEALER) -> RawClient:
    client = RawClient(server.endpoint, socket_type)
    raw_clients.append(client)
    return client


def score_message(request_id: int, *responses: str) -> dict:
    return {
        "type": "score",
        "request_id": request_id,
        "samples": [{"id": 10 + i, "prompt": "p", "response": r} for i, r in enumerate(responses)],
    }


def test_handshake_heartbeat_and_scoring(servers: Servers, raw_clients: list[RawClient]) -> None:
    client = connect(raw_clients, servers.reward_server(f"{FUNCTIONS}:length"))
    hello = client.request({"type": "hello", "versions": [1, 2], "client": "test"})
    assert hello["type"] == "hello_reply" and hello["version"] == 1 and hello["workers"] == 4
    assert client.request({"type": "ping", "nonce": 42}) == {"type": "pong", "nonce": 42, "in_flight": 0}
    reply = client.request(score_message(5, "abc", "boom", ""))
    assert reply["type"] == "score_reply" and reply["request_id"] == 5
    assert reply["results"] == [
        {"id": 10, "score": 3.0},
        {"id": 11, "error": "ValueError: boom requested"},
        {"id": 12, "score": 0.0},
    ]


def test_version_negotiation_refuses_unknown_versions(servers: Servers, raw_clients: list[RawClient]) -> None:
    client = connect(raw_clients, servers.reward_server(f"{FUNCTIONS}:length"))
    reply = client.request({"type": "hello", "versions": [99]})
    assert reply["type"] == "error" and reply["code"] == "unsupported_version" and reply["versions"] == [1]


def test_bad_messages_get_error_replies_and_the_server_stays_up(
    servers: Servers, raw_clients: list[RawClient]
) -> None:
    server = servers.reward_server(f"{FUNCTIONS}:length")
    client = connect(raw_clients, server)
    client.socket.send(b"\xc1 not msgpack")
    reply = client.receive()
    assert reply["code"] == "bad_request" and reply["request_id"] is None
    reply = client.request({"type": "score", "request_id": 3, "samples": [{"id": "x"}]})
    assert (
        reply["code"] == "bad_request" and reply["request_id"] == 3 and "$.samples[0].id" in reply["message"]
    )
    reply = client.request({"type": "launch_missiles"})
    assert reply["code"] == "bad_request"
    client.socket.send_multipart([b"one", b"two"])
    assert "expected one msgpack frame" in client.receive()["message"]
    assert client.request(score_message(4, "ok"))["results"] == [{"id": 10, "score": 2.0}]
    assert server.proc.poll() is None


def test_req_sockets_work_too(servers: Servers, raw_clients: list[RawClient]) -> None:
    client = connect(raw_clients, servers.reward_server(f"{FUNCTIONS}:named"), zmq.REQ)
    client.send(score_message(1, "hello"))
    assert client.receive()["results"] == [{"id": 10, "score": {"length": 5.0, "vowels": 2.0}}]


def test_concurrency_is_bounded_and_excess_is_refused(servers: Servers, raw_clients: list[RawClient]) -> None:
    server = servers.reward_server(f"{FUNCTIONS}:half_second_length", "--workers", "1", "--max-pending", "2")
    client = connect(raw_clients, server)
    for request_id in (1, 2, 3):
        client.send(score_message(request_id, "x"))
    first = client.receive()
    assert first == {
        "type": "error",
        "code": "overloaded",
        "message": "server already has 2 batches pending (max_pending)",
        "request_id": 3,
        "versions": None,
    }
    # One worker: the two accepted batches take 0.5 s each, one after the other.
    assert client.receive(timeout_s=5)["request_id"] == 1
    pong = client.request({"type": "ping", "nonce": 1})
    assert pong["in_flight"] == 1
    assert client.receive(timeout_s=5)["request_id"] == 2


def test_sigterm_finishes_in_flight_batches_and_refuses_new_ones(
    servers: Servers, raw_clients: list[RawClient]
) -> None:
    server = servers.reward_server(f"{FUNCTIONS}:half_second_length")
    client = connect(raw_clients, server)
    client.send(score_message(1, "abcd"))
    assert client.request({"type": "ping", "nonce": 1})["in_flight"] == 1
    server.signal(signal.SIGTERM)
    time.sleep(0.3)  # signal delivery is asynchronous; batch 1 still has ~0.4 s to go
    refusal = client.request(score_message(2, "late"))
    assert refusal["code"] == "shutting_down" and refusal["request_id"] == 2
    assert client.receive(timeout_s=5) == {
        "type": "score_reply",
        "request_id": 1,
        "results": [{"id": 10, "score": 4.0}],
    }
    assert server.wait(timeout_s=10) == 0
    assert "finishing 1 in-flight batch" in server.stderr()


def test_binding_beyond_loopback_without_curve_warns_loudly(servers: Servers) -> None:
    server = servers.reward_server(f"{FUNCTIONS}:length", bind="tcp://0.0.0.0:0")
    assert "WITHOUT CURVE" in server.stderr()
    quiet = servers.reward_server(f"{FUNCTIONS}:length")
    assert "WITHOUT CURVE" not in quiet.stderr()


def test_bad_function_spec_exits_with_a_clear_error(tmp_path: object) -> None:
    import subprocess
    import sys

    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "streamrl.rewards.cli",
            "reward-server",
            "nope_module:f",
            "--bind",
            "tcp://127.0.0.1:0",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2
    assert "cannot import module 'nope_module'" in done.stderr
