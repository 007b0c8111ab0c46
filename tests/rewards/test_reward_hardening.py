"""A reward server survives any single message a peer can send, and the client any reply.

Every hostile message goes over a real socket to a real ``streamrl reward-server`` process (127.0.0.1,
a port the OS picks); after each one the server must still answer a normal ``score`` correctly.
The second half points RewardClient at misbehaving servers (tests/rewards/misbehaving_reward_server.py).
"""

from __future__ import annotations

import math
import struct
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import msgpack
import pytest
import zmq

from ops.fuzz.zmtp import send_oversized_frame
from streamrl.rewards import (
    RewardClient,
    RewardReplyError,
    RewardRetriesExhaustedError,
    RewardSample,
)
from tests.rewards.conftest import LOOPBACK, MISBEHAVING_SERVER, ServerProcess, Servers

pytestmark = pytest.mark.timeout(120)

LENGTH = "tests.rewards.reward_test_functions:length"
#: The server under test refuses messages above this; small, so the oversize test stays cheap.
MAX_MESSAGE_BYTES = 1 << 20
REPLY_TIMEOUT_S = 10.0


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    """One server for the whole module: every test's hostile message hits the same process, so a
    message that leaves it broken (not just dead) fails the tests after it too."""
    process = ServerProcess(
        [
            sys.executable,
            "-m",
            "streamrl.rewards.cli",
            "reward-server",
            LENGTH,
            "--bind",
            LOOPBACK,
            "--max-message-bytes",
            str(MAX_MESSAGE_BYTES),
        ]
    )
    try:
        yield process
    finally:
        process.stop()


class Peer:
    """A raw DEALER socket: sends whatever bytes a test makes, reads replies with a timeout."""

    def __init__(self, endpoint: str, routing_id: bytes | None = None) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.linger = 0
        if routing_id is not None:
            self.socket.setsockopt(zmq.ROUTING_ID, routing_id)
        self.socket.connect(endpoint)

    def send(self, *frames: bytes) -> None:
        self.socket.send_multipart(list(frames))

    def receive(self, timeout_s: float = REPLY_TIMEOUT_S) -> dict:
        if not self.socket.poll(int(timeout_s * 1000)):
            raise AssertionError(f"no reply within {timeout_s} s")
        frames = self.socket.recv_multipart()
        assert len(frames) == 1, f"a reply must be one frame, got {len(frames)}"
        return msgpack.unpackb(frames[0])

    def silent_for(self, seconds: float) -> bool:
        return not self.socket.poll(int(seconds * 1000))

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()


@pytest.fixture
def peer(server: ServerProcess) -> Iterator[Peer]:
    made = Peer(server.endpoint)
    try:
        yield made
    finally:
        made.close()


def assert_still_serving(server: ServerProcess) -> None:
    """A fresh client negotiates and gets a correct score: the server is up *and* works."""
    assert server.proc.poll() is None, f"the reward server died; stderr:\n{server.stderr()[-3000:]}"
    fresh = Peer(server.endpoint)
    try:
        fresh.send(msgpack.packb({"type": "hello", "versions": [1]}))
        assert fresh.receive()["type"] == "hello_reply"
        fresh.send(msgpack.packb(score_request(77, "abc", "")))
        assert fresh.receive() == {
            "type": "score_reply",
            "request_id": 77,
            "results": [{"id": 10, "score": 3.0}, {"id": 11, "score": 0.0}],
        }
    finally:
        fresh.close()


def score_request(request_id: int, *responses: str) -> dict:
    return {
        "type": "score",
        "request_id": request_id,
        "samples": [{"id": 10 + i, "prompt": "p", "response": r} for i, r in enumerate(responses)],
    }


# -- hand-made msgpack: what a buggy or hostile peer can put on the wire and msgpack.packb cannot ----


def mp(value: object) -> bytes:
    return msgpack.packb(value)


def raw_map(*pairs: tuple[bytes, bytes]) -> bytes:
    """A msgpack map (fewer than 16 entries) of already-encoded keys and values."""
    assert len(pairs) < 16
    return bytes([0x80 | len(pairs)]) + b"".join(k + v for k, v in pairs)


def raw_array(*items: bytes) -> bytes:
    assert len(items) < 16
    return bytes([0x90 | len(items)]) + b"".join(items)


BAD_UTF8 = b"\xa2\xff\xfe"  # a 2-byte msgpack str that is not UTF-8


def score_with_sample(request_id: int, *sample_pairs: tuple[bytes, bytes]) -> bytes:
    """A score request (request_id first, so it stays readable) with one hand-made sample."""
    return raw_map(
        (mp("type"), mp("score")),
        (mp("request_id"), mp(request_id)),
        (mp("samples"), raw_array(raw_map(*sample_pairs))),
    )


def nested(levels: int) -> dict:
    value: dict = {"leaf": 1}
    for _ in range(levels - 1):
        value = {"n": value}
    return value


HOSTILE: list[tuple[str, bytes, int | None, str]] = [
    # (case, payload, request_id the error must echo, text its message must contain)
    ("not msgpack", b"\xc1 garbage", None, "invalid message"),
    ("empty payload", b"", None, "invalid message"),
    ("nil", mp(None), None, "invalid message"),
    ("array at top level", mp([1, 2, 3]), None, "invalid message"),
    ("unknown type", mp({"type": "launch_missiles", "request_id": 4}), 4, "`$.type`"),
    ("type not a string", mp({"type": 5}), None, "`$.type`"),
    ("no type", mp({"request_id": 6, "samples": []}), 6, "`type`"),
    (
        "invalid UTF-8 in a prompt",
        score_with_sample(8, (mp("id"), mp(1)), (mp("prompt"), BAD_UTF8)),
        8,
        "UTF-8",
    ),
    (
        "invalid UTF-8 in a metadata key",
        score_with_sample(9, (mp("id"), mp(1)), (mp("metadata"), raw_map((BAD_UTF8, mp(1))))),
        9,
        "UTF-8",
    ),
    ("invalid UTF-8 in the type", raw_map((mp("type"), BAD_UTF8)), None, "UTF-8"),
    (
        "metadata nested 40 deep",
        mp({"type": "score", "request_id": 11, "samples": [{"id": 1, "metadata": nested(40)}]}),
        11,
        "$.samples[0].metadata nests deeper than 32",
    ),
    (
        "metadata nested 200000 deep",
        score_with_sample(
            12, (mp("id"), mp(1)), (mp("metadata"), b"\x81\xa1x" + b"\x91" * 200_000 + b"\xc0")
        ),
        None,
        "nested too deeply",
    ),
    ("float request_id", mp({"type": "score", "request_id": 13.0, "samples": []}), None, "`$.request_id`"),
    (
        "float sample id",
        mp({"type": "score", "request_id": 14, "samples": [{"id": 1.0}]}),
        14,
        "`$.samples[0].id`",
    ),
    (
        "NaN sample id",
        mp({"type": "score", "request_id": 15, "samples": [{"id": math.nan}]}),
        15,
        "`$.samples[0].id`",
    ),
    ("negative sample id", mp({"type": "score", "request_id": 16, "samples": [{"id": -1}]}), 16, ">= 0"),
    (
        "request_id beyond int64",
        mp({"type": "score", "request_id": 2**64 - 1, "samples": []}),
        None,
        "<= 9223372036854775807",
    ),
    ("bool request_id", mp({"type": "score", "request_id": True, "samples": []}), None, "`$.request_id`"),
    ("infinite nonce", mp({"type": "ping", "nonce": math.inf}), None, "`$.nonce`"),
    ("float version", mp({"type": "hello", "versions": [1.5]}), None, "`$.versions[0]`"),
    (
        "negative token id",
        mp({"type": "score", "request_id": 21, "samples": [{"id": 1, "response_ids": [-5]}]}),
        21,
        "`$.samples[0].response_ids[0]`",
    ),
    (
        "token id beyond int32",
        mp({"type": "score", "request_id": 22, "samples": [{"id": 1, "response_ids": [2**40]}]}),
        22,
        "`$.samples[0].response_ids[0]`",
    ),
    # Declared sizes far beyond the payload: refused as truncated, nothing of that size allocated.
    (
        "array32 of 4G samples",
        raw_map(
            (mp("type"), mp("score")), (mp("request_id"), mp(23)), (mp("samples"), b"\xdd\xff\xff\xff\xff")
        ),
        None,
        "truncated",
    ),
    (
        "str32 of 4 GiB",
        score_with_sample(24, (mp("id"), mp(1)), (mp("prompt"), b"\xdb\xff\xff\xff\xff")),
        None,
        "truncated",
    ),
    (
        "map32 of 4G metadata entries",
        score_with_sample(25, (mp("id"), mp(1)), (mp("metadata"), b"\xdf\xff\xff\xff\xff")),
        None,
        "truncated",
    ),
    (
        "bin instead of str",
        score_with_sample(26, (mp("id"), mp(1)), (mp("prompt"), b"\xc4\x01x")),
        26,
        "`$.samples[0].prompt`",
    ),
    (
        "timestamp out of range in metadata",
        score_with_sample(
            27,
            (mp("id"), mp(1)),
            (mp("metadata"), raw_map((mp("t"), b"\xc7\x0c\xff" + struct.pack(">Iq", 0, 2**62)))),
        ),
        27,
        "imestamp",
    ),
    ("nil samples", mp({"type": "score", "request_id": 28, "samples": None}), 28, "`$.samples`"),
    ("nil request_id", mp({"type": "score", "request_id": None, "samples": []}), None, "`$.request_id`"),
]


@pytest.mark.parametrize(
    ("payload", "request_id", "text"), [c[1:] for c in HOSTILE], ids=[c[0] for c in HOSTILE]
)
def test_a_hostile_message_gets_bad_request_and_the_server_keeps_serving(
    server: ServerProcess, peer: Peer, payload: bytes, request_id: int | None, text: str
) -> None:
    peer.send(payload)
    reply = peer.receive()
    assert reply["type"] == "error" and reply["code"] == "bad_request", reply
    assert reply["request_id"] == request_id, reply
    assert text in reply["message"], reply
    assert len(reply["message"]) <= 2000
    assert_still_serving(server)


def test_nil_optional_fields_are_absent_fields(server: ServerProcess, peer: Peer) -> None:
    peer.send(mp({"type": "hello", "versions": [1], "client": None}))
    assert peer.receive()["type"] == "hello_reply"
    sample = {
        "id": 5,
        "prompt": None,
        "response": "four",
        "prompt_ids": None,
        "response_ids": None,
        "metadata": None,
    }
    peer.send(mp({"type": "score", "request_id": 1, "samples": [sample], "unknown_key": None}))
    assert peer.receive() == {"type": "score_reply", "request_id": 1, "results": [{"id": 5, "score": 4.0}]}


def test_odd_but_valid_metadata_is_scored(server: ServerProcess, peer: Peer) -> None:
    """metadata is the user's: NaN, inf, ext types, 32 levels of nesting are theirs to judge."""
    metadata = raw_map(
        (mp("nan"), mp(math.nan)),
        (mp("inf"), mp(-math.inf)),
        (mp("ext"), b"\xd4\x05\x01"),
        (mp("deep"), mp(nested(31))),
        (mp("big"), mp(2**64 - 1)),
    )
    peer.send(score_with_sample(3, (mp("id"), mp(1)), (mp("response"), mp("ok")), (mp("metadata"), metadata)))
    assert peer.receive() == {"type": "score_reply", "request_id": 3, "results": [{"id": 1, "score": 2.0}]}


@pytest.mark.parametrize("frames", [2, 3, 100_000], ids=lambda n: f"{n} frames")
def test_many_frames_get_bad_request(server: ServerProcess, peer: Peer, frames: int) -> None:
    peer.send(*([mp({"type": "ping", "nonce": 1})] * frames))
    reply = peer.receive()
    assert reply["code"] == "bad_request" and f"got {frames}" in reply["message"]
    assert_still_serving(server)


def test_req_envelope_with_a_non_empty_delimiter_is_a_bad_request(server: ServerProcess, peer: Peer) -> None:
    peer.send(b"not empty", mp({"type": "ping", "nonce": 1}))
    assert peer.receive()["code"] == "bad_request"
    assert_still_serving(server)


def test_a_message_over_the_size_limit_closes_only_that_connection(server: ServerProcess, peer: Peer) -> None:
    peer.send(
        mp(
            {
                "type": "score",
                "request_id": 1,
                "samples": [{"id": 1, "response": "x" * 2 * MAX_MESSAGE_BYTES}],
            }
        )
    )
    assert peer.silent_for(1.0), "an oversized message must be dropped with its connection, not answered"
    assert_still_serving(server)


def test_a_frame_declaring_exabytes_closes_the_connection(server: ServerProcess) -> None:
    """The frame header is read by ZeroMQ itself: MAXMSGSIZE must refuse it before any allocation."""
    host, port = server.endpoint.removeprefix("tcp://").rsplit(":", 1)
    closed = send_oversized_frame(host, int(port), 2**62, body=b"\x00" * 64, timeout_s=REPLY_TIMEOUT_S)
    assert closed, "the server kept a connection that declared a 4 EiB frame"
    assert_still_serving(server)


def test_a_burst_of_garbage_is_answered_and_heartbeats_still_work(server: ServerProcess, peer: Peer) -> None:
    count = 2000
    for i in range(count):
        peer.send(b"\xc1" + i.to_bytes(4, "big"))
    peer.send(mp({"type": "ping", "nonce": 99}))
    replies = [peer.receive() for _ in range(count + 1)]
    assert sum(r["type"] == "error" for r in replies) == count
    assert replies[-1] == {"type": "pong", "nonce": 99, "in_flight": 0}
    assert_still_serving(server)


def _server_resources(server: ServerProcess) -> tuple[int, int]:
    """(open file descriptors, resident KiB) of the server process, from /proc."""
    pid = server.proc.pid
    fds = len(list(Path(f"/proc/{pid}/fd").iterdir()))
    status = Path(f"/proc/{pid}/status").read_text()
    rss_kib = int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1])
    return fds, rss_kib


def _hello_from_new_clients(server: ServerProcess, count: int, first_id: int) -> None:
    for n in range(first_id, first_id + count):
        client = Peer(server.endpoint, routing_id=b"client-%d" % n)
        try:
            client.send(mp({"type": "hello", "versions": [1], "client": f"c{n}"}))
            assert client.receive()["type"] == "hello_reply"
        finally:
            client.close()


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc")
def test_new_client_ids_leave_no_state_behind(server: ServerProcess) -> None:
    """The spec says the server keeps no per-client state: after thousands of clients have come and
    gone, its descriptors are back where they were and its memory has not grown with them."""
    _hello_from_new_clients(server, 200, 0)  # warm-up: allocator pools, lazily built objects
    fds_before, rss_before = _server_resources(server)
    _hello_from_new_clients(server, 2000, 1000)
    deadline = time.monotonic() + REPLY_TIMEOUT_S
    while (fds := _server_resources(server)[0]) > fds_before and time.monotonic() < deadline:
        time.sleep(0.05)  # disconnects are processed by ZeroMQ's I/O thread, asynchronously
    assert fds <= fds_before, f"{fds - fds_before} descriptors still open after the clients left"
    growth_kib = _server_resources(server)[1] - rss_before
    assert growth_kib < 8 * 1024, f"resident memory grew {growth_kib} KiB over 2000 clients"
    assert_still_serving(server)


# -- the client against hostile servers ---------------------------------------------------------------

SAMPLES = [RewardSample(id=40 + i, prompt="p", response="x" * i) for i in range(3)]


@pytest.mark.anyio
async def test_error_without_request_id_fails_over_at_once(servers: Servers) -> None:
    anonymous = servers.script(MISBEHAVING_SERVER, "anonymous_error", "--bind", LOOPBACK)
    good = servers.reward_server(LENGTH)
    # A 60 s timeout: the batch may only finish quickly if the anonymous error failed it over.
    async with RewardClient([anonymous.endpoint], timeout_s=60) as only_bad:
        await only_bad.wait_servers_up(timeout_s=REPLY_TIMEOUT_S)
        started = time.monotonic()
        with anyio.fail_after(REPLY_TIMEOUT_S), pytest.raises(RewardRetriesExhaustedError) as caught:
            await only_bad.score(SAMPLES)
        assert time.monotonic() - started < 5
        assert "server error bad_request: cannot read that" in str(caught.value)
    async with RewardClient([anonymous.endpoint, good.endpoint], timeout_s=60, max_batch_size=3) as client:
        await client.wait_servers_up(timeout_s=REPLY_TIMEOUT_S)
        with anyio.fail_after(5):
            # Three batches: at least one goes to the anonymous server first (least loaded).
            results = await client.score(SAMPLES * 3)
        stats = client.statistics()
    assert [r.score for r in results] == [0.0, 1.0, 2.0] * 3
    assert {r.source for r in results} == {good.endpoint}
    assert stats.servers[0].lost >= 1 and stats.timeouts == 0


@pytest.mark.anyio
async def test_nil_optional_fields_from_a_server_are_accepted(servers: Servers) -> None:
    nil_server = servers.script(MISBEHAVING_SERVER, "nil_fields", "--bind", LOOPBACK)
    async with RewardClient([nil_server.endpoint], heartbeat_interval_s=0.05) as client:
        with anyio.fail_after(REPLY_TIMEOUT_S):
            results = await client.score(SAMPLES)
            await anyio.sleep(0.3)  # pongs with in_flight nil must count as signs of life, not bad
        stats = client.statistics()
    assert [r.score for r in results] == [0.0, 1.0, 2.0]
    assert stats.bad_replies == 0 and stats.servers[0].state == "up" and stats.servers[0].last_error is None


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("mode", "reason"),
    [
        ("bad_utf8", "not valid UTF-8"),
        ("deep", "undecodable reply"),  # typed: refused at the first wrong level, no recursion
        ("many_frames", "expected one frame per message, got 1000"),
    ],
)
async def test_hostile_replies_are_bad_replies_not_crashes(servers: Servers, mode: str, reason: str) -> None:
    hostile = servers.script(MISBEHAVING_SERVER, mode, "--bind", LOOPBACK)
    async with RewardClient([hostile.endpoint], heartbeat_interval_s=0.05) as client:
        with anyio.fail_after(REPLY_TIMEOUT_S), pytest.raises(RewardReplyError) as caught:
            await client.score(SAMPLES)
        assert reason in str(caught.value) and hostile.endpoint in str(caught.value)
        # The client is still healthy: its heartbeats keep the (handshake-correct) server up.
        await anyio.sleep(0.2)
        assert client.statistics().servers[0].state == "up"


@pytest.mark.anyio
async def test_a_reply_over_the_size_limit_disconnects_that_server(servers: Servers) -> None:
    """The client takes replies up to 64 KiB per sample of max_batch_size (at least 1 MiB): a 4 MiB
    reply to a 3-sample batch is refused by ZeroMQ before it is read, and the batch fails over."""
    huge = servers.script(MISBEHAVING_SERVER, "huge_reply", "--bind", LOOPBACK)
    async with RewardClient([huge.endpoint], max_batch_size=3, max_attempts=2) as client:
        with anyio.fail_after(REPLY_TIMEOUT_S), pytest.raises(RewardRetriesExhaustedError) as caught:
            await client.score(SAMPLES)
        assert "connection lost" in str(caught.value)
        assert client.statistics().servers[0].lost == 2
