#!/usr/bin/env python3
"""Conformance suite for reward servers: checks each MUST of docs/reward-protocol.md (version 1).

Point it at any implementation, in any language:

    python ops/conformance/reward_server.py tcp://127.0.0.1:5555
    python ops/conformance/reward_server.py tcp://host:5555 --curve-server-key keys/server.key \\
        --curve-client-key keys/client.key_secret

It prints one line per check (``PASS name`` or ``FAIL name: why``) and a final ``N passed, N failed``
line; the exit status is 0 only if every check passed (2 for bad arguments).

Scores. By default (``--scores exact-match``) the server must host the reference reward
``exact_match``: 1.0 when ``response.strip() == str(metadata["answer"]).strip()``, else 0.0, and a
per-sample ``error`` for a sample without ``response`` (samples without an answer are sent too, but
only the shape of their result is checked). streamrl's is
``streamrl reward-server streamrl.rewards.builtin:exact_match``; ops/rewards/minimal_server.py
implements it. A server hosting another function: ``--scores structure`` checks only the shape of
the results (one per sample, in order, ids echoed, exactly one of score/error, finite scores).

Only pyzmq and msgpack are used (not streamrl's client), as an outside implementer would. Each
check opens its own DEALER socket, so one check's stray replies cannot confuse the next.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import zmq

VERSION = 1
ID_MAX = 2**63 - 1  # ids, request ids and nonces: 0 ..= 2^63 - 1 (spec §2)


class CheckFailed(Exception):
    """A MUST of the spec that the server under test did not meet (the message says which)."""


class Target:
    """Where the server is and how to reach it; makes one fresh connection per check."""

    def __init__(self, endpoint: str, timeout_s: float, curve: tuple[bytes, bytes, bytes] | None) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.curve = curve  # (server public, client public, client secret), z85
        self.context = zmq.Context()

    def connect(self, socket_type: int = zmq.DEALER) -> Connection:
        socket = self.context.socket(socket_type)
        socket.setsockopt(zmq.LINGER, 0)
        # a socket whose connection the server refused (a wrong CURVE key) has no peer, and a send
        # would wait for one forever: bounded like the replies (zmq.Again, reported by main)
        socket.setsockopt(zmq.SNDTIMEO, int(self.timeout_s * 1000))
        if self.curve is not None:
            server_public, client_public, client_secret = self.curve
            socket.setsockopt(zmq.CURVE_SERVERKEY, server_public)
            socket.setsockopt(zmq.CURVE_PUBLICKEY, client_public)
            socket.setsockopt(zmq.CURVE_SECRETKEY, client_secret)
        socket.connect(self.endpoint)
        return Connection(socket, self.timeout_s)

    def close(self) -> None:
        self.context.destroy(linger=0)


class Connection:
    def __init__(self, socket: zmq.Socket, timeout_s: float) -> None:
        self.socket = socket
        self.timeout_s = timeout_s

    def send(self, message: object) -> None:
        """Send a map (packed here) or raw bytes (a hand-made payload) as one frame."""
        payload = message if isinstance(message, bytes) else msgpack.packb(message, use_bin_type=True)
        self.socket.send(payload)

    def receive(self, what: str) -> dict[str, Any]:
        """The next reply, checked to be one frame holding a msgpack map with a str ``type``."""
        if not self.socket.poll(int(self.timeout_s * 1000)):
            raise CheckFailed(f"no reply to {what} within {self.timeout_s} s")
        frames = self.socket.recv_multipart()
        if len(frames) != 1:
            raise CheckFailed(
                f"reply to {what} has {len(frames)} frames; a message is exactly one frame (§1)"
            )
        try:
            reply = msgpack.unpackb(frames[0], raw=False, strict_map_key=False)
        except Exception as exc:  # any decoding failure is the server's fault here
            raise CheckFailed(f"reply to {what} is not valid msgpack: {type(exc).__name__}: {exc}") from None
        if not isinstance(reply, dict) or not all(isinstance(k, str) for k in reply):
            raise CheckFailed(f"reply to {what} is not a msgpack map with string keys (§2): {reply!r:.200}")
        if not isinstance(reply.get("type"), str):
            raise CheckFailed(f"reply to {what} has no string field 'type' (§2): {reply!r:.200}")
        return reply

    def request(self, message: object, what: str) -> dict[str, Any]:
        self.send(message)
        return self.receive(what)

    def drain(self, seconds: float) -> int:
        """Read and discard replies for ``seconds``; how many there were."""
        count = 0
        while self.socket.poll(int(seconds * 1000)):
            self.socket.recv_multipart()
            count += 1
        return count

    def close(self) -> None:
        self.socket.close(linger=0)


# -- field checks (nil == absent everywhere, spec §2) ---------------------------------------------------


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def expect_type(reply: dict[str, Any], wanted: str, what: str) -> None:
    if reply["type"] != wanted:
        detail = (
            f" (code {reply.get('code')!r}: {reply.get('message')!r:.300})"
            if reply["type"] == "error"
            else ""
        )
        raise CheckFailed(f"{what}: expected a {wanted!r} reply, got {reply['type']!r}{detail}")


def expect_optional(reply: dict[str, Any], field: str, check: Callable[[object], bool], kind: str) -> None:
    value = reply.get(field)
    expect(
        value is None or check(value), f"{reply['type']}.{field} is {value!r:.100}; expected {kind} or nil"
    )


def expect_error(reply: dict[str, Any], code: str, request_id: int | None, what: str) -> None:
    expect_type(reply, "error", what)
    expect(reply.get("code") == code, f"{what}: expected error code {code!r}, got {reply.get('code')!r}")
    expect(isinstance(reply.get("message"), str), f"{what}: error.message must be a string")
    expect(
        reply.get("request_id") == request_id and (request_id is None or is_int(reply.get("request_id"))),
        f"{what}: error.request_id is {reply.get('request_id')!r}; expected {request_id!r}"
        + (" (echoed when readable, §3)" if request_id is not None else " (nil: it could not be read)"),
    )


def score_problem(value: object) -> str | None:
    """Why ``value`` is not a valid score (§3), or None."""

    def finite_number(x: object) -> bool:
        return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)

    if finite_number(value):
        return None
    if isinstance(value, dict):
        if not value:
            return "an empty map of named scores"
        bad = {k: v for k, v in value.items() if not isinstance(k, str) or not finite_number(v)}
        return None if not bad else f"named scores with non-string names or non-finite values: {bad!r:.100}"
    return f"{value!r:.60} is not a finite number or a map of them"


def expect_score_reply(reply: dict[str, Any], request: dict[str, Any], what: str) -> list[dict[str, Any]]:
    """The reply answers ``request``: its request_id, one result per sample, in order, ids echoed,
    exactly one of score/error, valid scores. Returns the results."""
    expect_type(reply, "score_reply", what)
    expect(
        is_int(reply.get("request_id")) and reply["request_id"] == request["request_id"],
        f"{what}: request_id {reply.get('request_id')!r} is not the request's {request['request_id']}",
    )
    results = reply.get("results")
    expect(isinstance(results, list), f"{what}: results is {type(results).__name__}, not an array")
    samples = request["samples"]
    expect(
        len(results) == len(samples),
        f"{what}: {len(results)} results for {len(samples)} samples (§3: exactly one per sample)",
    )
    for index, (sample, result) in enumerate(zip(samples, results, strict=True)):
        expect(isinstance(result, dict), f"{what}: results[{index}] is not a map")
        expect(
            is_int(result.get("id")) and result["id"] == sample["id"],
            f"{what}: results[{index}].id is {result.get('id')!r}, expected {sample['id']} (request order, ids echoed)",
        )
        score, error = result.get("score"), result.get("error")
        expect(
            (score is None) != (error is None),
            f"{what}: results[{index}] must set exactly one of score/error",
        )
        if error is not None:
            expect(isinstance(error, str), f"{what}: results[{index}].error is not a string")
        else:
            problem = score_problem(score)
            expect(problem is None, f"{what}: results[{index}].score: {problem}")
    return results


def expect_scores(
    results: list[dict[str, Any]], expected: list[float | None], exact: bool, what: str
) -> None:
    """With the exact-match reference function: the values (None = a per-sample error expected)."""
    if not exact:
        return
    got = [r.get("score") if r.get("error") is None else None for r in results]
    expect(got == expected, f"{what}: scores {got} (None = error), expected {expected} from exact_match")


# -- the checks ---------------------------------------------------------------------------------------

Check = Callable[["Target", bool], None]
CHECKS: list[tuple[str, Check]] = []


def check(name: str) -> Callable[[Check], Check]:
    def register(function: Check) -> Check:
        CHECKS.append((name, function))
        return function

    return register


def hello(versions: list[object], **extra: object) -> dict[str, object]:
    return {"type": "hello", "versions": versions, **extra}


def sample(sample_id: int, response: str | None, answer: object = None, **extra: object) -> dict[str, object]:
    made: dict[str, object] = {"id": sample_id, "prompt": "What is 2+2?", **extra}
    if response is not None:
        made["response"] = response
    if answer is not None:
        made["metadata"] = {"answer": answer}
    return made


def score_request(request_id: int, samples: list[dict[str, object]], **extra: object) -> dict[str, Any]:
    return {"type": "score", "request_id": request_id, "samples": samples, **extra}


def nested(levels: int) -> dict[str, object]:
    """A metadata map ``levels`` deep: the map itself is level 1, each map inside adds one (§2)."""
    value: dict[str, object] = {"answer": "4"}
    for _ in range(levels - 1):
        value = {"answer": "4", "inner": value}
    return value


def invalid_utf8(request_id: int, where: str) -> bytes:
    """A score request whose sample ``response`` (or a metadata key) holds bytes that are not UTF-8."""
    marker = "\u00e9\u00e9"
    if where == "response":
        request = score_request(request_id, [{"id": 1, "response": marker}])
    else:
        request = score_request(request_id, [{"id": 1, "response": "4", "metadata": {marker: 1}}])
    return msgpack.packb(request).replace(marker.encode(), b"\xff\xfe\xfd\xfc")


@check("hello: hello_reply with the offered version")
def _hello(target: Target, exact: bool) -> None:
    reply = target_request(target, hello([VERSION], client="conformance"), "hello")
    expect_type(reply, "hello_reply", "hello")
    expect(
        is_int(reply.get("version")) and reply["version"] == VERSION,
        f"hello_reply.version is {reply.get('version')!r}, expected {VERSION}",
    )
    expect_optional(reply, "server", lambda v: isinstance(v, str), "a string")
    expect_optional(reply, "workers", is_int, "an int")


@check("hello: the highest common version is chosen")
def _hello_highest(target: Target, exact: bool) -> None:
    reply = target_request(target, hello([VERSION, 4096, 0x7FFF]), "hello offering [1, 4096, 32767]")
    expect_type(reply, "hello_reply", "hello")
    expect(
        reply.get("version") == VERSION,
        f"hello_reply.version is {reply.get('version')!r}; {VERSION} is the only common one",
    )


@check("hello: no common version -> error unsupported_version with the server's versions")
def _hello_unsupported(target: Target, exact: bool) -> None:
    reply = target_request(target, hello([4096]), "hello offering [4096]")
    expect_error(reply, "unsupported_version", None, "hello offering [4096]")
    versions = reply.get("versions")
    expect(
        isinstance(versions, list) and all(is_int(v) for v in versions) and VERSION in versions,
        f"error.versions is {versions!r}; it must list the versions the server speaks (including {VERSION})",
    )


@check("hello: nil optional fields and unknown keys are accepted")
def _hello_lenient(target: Target, exact: bool) -> None:
    reply = target_request(
        target, hello([VERSION], client=None, added_in_v9={"x": [1]}), "hello with client nil"
    )
    expect_type(reply, "hello_reply", "hello with client nil and an unknown key")


@check("ping: pong echoes the nonce")
def _ping(target: Target, exact: bool) -> None:
    for nonce in (0, 7, ID_MAX):
        reply = target_request(target, {"type": "ping", "nonce": nonce}, f"ping {nonce}")
        expect_type(reply, "pong", "ping")
        expect(
            is_int(reply.get("nonce")) and reply["nonce"] == nonce,
            f"pong.nonce is {reply.get('nonce')!r}, expected {nonce}",
        )
        expect_optional(reply, "in_flight", is_int, "an int")


@check("ping: unknown keys are ignored")
def _ping_lenient(target: Target, exact: bool) -> None:
    reply = target_request(
        target, {"type": "ping", "nonce": 3, "added_in_v9": None}, "ping with an unknown key"
    )
    expect_type(reply, "pong", "ping with an unknown key")


@check("score: one result per sample, in request order, ids echoed")
def _score(target: Target, exact: bool) -> None:
    request = score_request(
        41,
        [sample(2**40 + 3, "4", "4"), sample(7, "5", "4"), sample(0, " 4 ", 4), sample(12345, "four", "4")],
    )
    results = expect_score_reply(target_request(target, request, "score"), request, "score")
    expect_scores(results, [1.0, 0.0, 1.0, 0.0], exact, "score")


@check("score: a failing sample gets its own error, the rest are scored")
def _score_sample_error(target: Target, exact: bool) -> None:
    request = score_request(42, [sample(1, "4", "4"), sample(2, None, "4"), sample(3, "3", "4")])
    results = expect_score_reply(
        target_request(target, request, "score"), request, "score with a sample lacking response"
    )
    expect_scores(results, [1.0, None, 0.0], exact, "score with a sample lacking response")


@check("score: nil optional fields are absent fields")
def _score_nil(target: Target, exact: bool) -> None:
    nil_sample = {
        "id": 5,
        "prompt": None,
        "response": "x",
        "prompt_ids": None,
        "response_ids": None,
        "metadata": None,
    }
    request = score_request(43, [nil_sample, sample(6, "x", "x", prompt_ids=None, response_ids=[1, 2])])
    results = expect_score_reply(target_request(target, request, "score"), request, "score with nil fields")
    # Sample 5 has no answer: what exact_match makes of that is not specified, only its shape is checked.
    if exact:
        expect(
            results[1].get("score") == 1.0, f"score of sample 6 is {results[1].get('score')!r}, expected 1.0"
        )


@check("score: unknown keys are ignored (message and sample)")
def _score_unknown_keys(target: Target, exact: bool) -> None:
    request = score_request(44, [sample(1, "4", "4", added_in_v9=[1, {"a": None}])], added_in_v9="later")
    results = expect_score_reply(target_request(target, request, "score"), request, "score with unknown keys")
    expect_scores(results, [1.0], exact, "score with unknown keys")


@check("score: the largest ids (2^63 - 1) are echoed exactly")
def _score_large_ids(target: Target, exact: bool) -> None:
    request = score_request(ID_MAX, [sample(ID_MAX, "1", "1"), sample(ID_MAX - 1, "1", "2")])
    results = expect_score_reply(target_request(target, request, "score"), request, "score with ids 2^63-1")
    expect_scores(results, [1.0, 0.0], exact, "score with ids 2^63-1")


@check("score: several requests in flight are each answered, matched by request_id")
def _score_pipelined(target: Target, exact: bool) -> None:
    connection = target.connect()
    try:
        requests = {
            rid: score_request(rid, [sample(rid, "4", "4"), sample(rid + 1, "x", "4")])
            for rid in (100, 101, 102)
        }
        for request in requests.values():
            connection.send(request)
        for _ in range(len(requests)):
            reply = connection.receive("one of three score requests")
            expect_type(reply, "score_reply", "pipelined score")
            request = requests.pop(reply.get("request_id"), None)  # type: ignore[arg-type]
            expect(
                request is not None,
                f"score_reply for request_id {reply.get('request_id')!r}, which is not pending",
            )
            assert request is not None
            expect_scores(
                expect_score_reply(reply, request, "pipelined score"), [1.0, 0.0], exact, "pipelined score"
            )
    finally:
        connection.close()


@check("REQ socket: the reply keeps the empty delimiter frame")
def _req_socket(target: Target, exact: bool) -> None:
    connection = target.connect(zmq.REQ)
    try:
        reply = connection.request({"type": "ping", "nonce": 11}, "ping from a REQ socket")
        expect(reply.get("type") == "pong" and reply.get("nonce") == 11, f"REQ ping got {reply!r:.200}")
    finally:
        connection.close()


BAD_REQUESTS: list[tuple[str, object, int | None]] = [
    # (what, payload, the request_id the error must carry)
    ("undecodable bytes", b"\xc1\xc1 not msgpack", None),
    ("a msgpack array, not a map", [1, 2, 3], None),
    ("a map without type", {"request_id": 51, "samples": []}, 51),
    ("an unknown type", {"type": "no_such_type", "request_id": 52}, 52),
    ("score without samples", {"type": "score", "request_id": 53}, 53),
    ("score with samples nil", {"type": "score", "request_id": 54, "samples": None}, 54),
    ("a sample id that is a string", score_request(55, [{"id": "x", "response": "4"}]), 55),
    ("a sample id that is a float", score_request(56, [{"id": 1.0, "response": "4"}]), 56),
    ("a negative sample id", score_request(57, [{"id": -1, "response": "4"}]), 57),
    ("a sample that is not a map", score_request(58, ["4"]), 58),
    ("a float request_id", score_request(3.0, [sample(1, "4", "4")]), None),  # type: ignore[arg-type]
    ("a string request_id", score_request("59", [sample(1, "4", "4")]), None),  # type: ignore[arg-type]
    ("a ping without nonce", {"type": "ping"}, None),
    ("a float nonce", {"type": "ping", "nonce": 1.5}, None),
    ("hello with versions not an array", {"type": "hello", "versions": 1}, None),
    # §2's integer ranges, at and past each edge, and bools (msgpack true is not an int)
    ("a bool sample id", score_request(60, [{"id": True, "response": "4"}]), 60),
    ("a sample id of 2^63", score_request(61, [{"id": 2**63, "response": "4"}]), 61),
    ("a token id of 2^31", score_request(62, [{"id": 1, "response": "4", "response_ids": [2**31]}]), 62),
    ("a negative token id", score_request(63, [{"id": 1, "response": "4", "prompt_ids": [-1]}]), 63),
    ("a request_id of 2^63", score_request(2**63, [sample(1, "4", "4")]), None),
    ("a bool nonce", {"type": "ping", "nonce": False}, None),
    ("a protocol version of 0", {"type": "hello", "versions": [0]}, None),
    ("a protocol version of 2^31", {"type": "hello", "versions": [2**31]}, None),
    # §2: metadata nests at most 32 levels, the metadata map itself being level 1
    ("metadata nested 33 levels", score_request(64, [{"id": 1, "response": "4", "metadata": nested(33)}]), 64),
    # §4: the id is echoed from any map whose request would be valid but for a value, i.e. nested
    # up to 35 levels (message map, samples, sample, then 32 of metadata)
    ("a bad sample id beside 32-level metadata (35 levels in all)",
     score_request(65, [{"id": "x", "response": "4", "metadata": nested(32)}]), 65),
]


def _bad_request_check(what: str, payload: object, request_id: int | None) -> Check:
    def run(target: Target, exact: bool) -> None:
        expect_error(target_request(target, payload, what), "bad_request", request_id, what)

    return run


for _what, _payload, _request_id in BAD_REQUESTS:
    check(f"bad_request: {_what}")(_bad_request_check(_what, _payload, _request_id))


@check("score: metadata nested 32 levels is accepted")
def _score_deep_metadata(target: Target, exact: bool) -> None:
    request = score_request(66, [sample(1, "4", None, metadata=nested(32))])
    results = expect_score_reply(target_request(target, request, "32-level metadata"), request, "32-level metadata")
    expect_scores(results, [1.0], exact, "32-level metadata")


for _where in ("response", "metadata key"):

    def _utf8_check(target: Target, exact: bool, where: str = _where) -> None:
        # §2/§6: bad_request. The map did not decode, so echoing request_id is allowed, not required.
        what = f"invalid UTF-8 in a sample's {where}"
        reply = target_request(target, invalid_utf8(67, where), what)
        expect_type(reply, "error", what)
        expect(reply.get("code") == "bad_request", f"{what}: expected bad_request, got {reply.get('code')!r}")
        expect(reply.get("request_id") in (None, 67), f"{what}: request_id {reply.get('request_id')!r}")

    check(f"bad_request: invalid UTF-8 in a sample's {_where}")(_utf8_check)


@check("bad_request: a message of two frames")
def _two_frames(target: Target, exact: bool) -> None:
    connection = target.connect()
    try:
        connection.socket.send_multipart(
            [msgpack.packb({"type": "ping", "nonce": 1}), msgpack.packb({"type": "ping", "nonce": 2})]
        )
        expect_error(connection.receive("a two-frame message"), "bad_request", None, "a two-frame message")
    finally:
        connection.close()


GARBAGE: list[tuple[str, list[bytes]]] = [
    ("random bytes", [bytes(range(256)) * 4]),
    ("an empty frame", [b""]),
    ("invalid UTF-8 in a string", [b"\x82\xa4type\xa5hello\xa8versions\x91\xa2\xff\xfe"]),
    ("invalid UTF-8 in the type", [b"\x81\xa4type\xa2\xff\xfe"]),
    (
        "arrays nested 100000 deep",
        [b"\x83\xa4type\xa5score\xaarequest_id\x01\xa7samples" + b"\x91" * 100_000 + b"\xc0"],
    ),
    (
        "an array declaring 4G entries",
        [b"\x83\xa4type\xa5score\xaarequest_id\x01\xa7samples\xdd\xff\xff\xff\xff"],
    ),
    ("a string declaring 4 GiB", [b"\x82\xa4type\xa4ping\xa5nonce\xdb\xff\xff\xff\xff"]),
    ("a NaN request_id", [msgpack.packb({"type": "score", "request_id": math.nan, "samples": []})]),
    ("500 frames", [msgpack.packb({"type": "ping", "nonce": 1})] * 500),
    ("a truncated map", [b"\x85\xa4type"]),
]


@check("robustness: survives garbage and still answers hello, ping and score")
def _survives_garbage(target: Target, exact: bool) -> None:
    connection = target.connect()
    try:
        for _what, frames in GARBAGE:
            connection.socket.send_multipart(frames)
        connection.drain(min(1.0, target.timeout_s))
    finally:
        connection.close()
    _hello(target, exact)
    _ping(target, exact)
    _score(target, exact)


@check("robustness: every garbage message is answered with an error (§6)")
def _garbage_answered(target: Target, exact: bool) -> None:
    connection = target.connect()
    try:
        for what, frames in GARBAGE:
            connection.socket.send_multipart(frames)
            reply = connection.receive(f"garbage: {what}")
            expect_type(reply, "error", f"garbage: {what}")
    finally:
        connection.close()


def target_request(target: Target, message: object, what: str) -> dict[str, Any]:
    """Send ``message`` on a fresh connection and return the first reply."""
    connection = target.connect()
    try:
        return connection.request(message, what)
    finally:
        connection.close()


# -- running ------------------------------------------------------------------------------------------

_Z85_KEY = re.compile(r"^[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}$")


def read_key(value: str, field: str) -> bytes:
    """A CURVE key: 40 z85 characters, or a ZeroMQ certificate file holding ``field = "..."``."""
    if _Z85_KEY.match(value) and not Path(value).exists():
        return value.encode()
    match = re.search(rf'^\s*{field}\s*=\s*"([^"]{{40}})"', Path(value).read_text(), re.MULTILINE)
    if match is None:
        raise ValueError(f'{value}: no {field} = "<40 z85 characters>" line (a ZeroMQ certificate file?)')
    return match.group(1).encode()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("endpoint", help="the server: tcp://HOST:PORT or ipc://PATH")
    parser.add_argument(
        "--curve-server-key", help="the server's CURVE public key: 40 z85 characters or its .key file"
    )
    parser.add_argument(
        "--curve-client-key",
        help="this client's .key_secret file (needed when the server has an allow-list); default: a fresh key pair",
    )
    parser.add_argument(
        "--scores",
        choices=["exact-match", "structure"],
        default="exact-match",
        help="exact-match: the server hosts the reference exact_match reward, values are checked (default); "
        "structure: only the shape of results is checked",
    )
    parser.add_argument(
        "--timeout-s", type=float, default=5.0, help="how long to wait for each reply (default 5)"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    curve = None
    try:
        if args.curve_server_key:
            if args.curve_client_key:
                client_public, client_secret = (
                    read_key(args.curve_client_key, "public-key"),
                    read_key(args.curve_client_key, "secret-key"),
                )
            else:
                client_public, client_secret = zmq.curve_keypair()
            curve = (read_key(args.curve_server_key, "public-key"), client_public, client_secret)
        elif args.curve_client_key:
            raise ValueError("--curve-client-key needs --curve-server-key")
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    target = Target(args.endpoint, args.timeout_s, curve)
    passed = failed = 0
    try:
        for index, (name, run) in enumerate(CHECKS):
            try:
                try:
                    run(target, args.scores == "exact-match")
                except zmq.Again:
                    raise CheckFailed(f"could not send within {args.timeout_s} s: the server took no connection (is "
                                      "the endpoint right? do the CURVE keys match the server's?)") from None
            except CheckFailed as exc:
                failed += 1
                print(f"FAIL {name}: {exc}", flush=True)
                if index == 0:  # the server is not there at all: say so once, not per check
                    skipped = len(CHECKS) - 1
                    print(f"FAIL the remaining {skipped} checks: the server did not answer hello", flush=True)
                    failed += skipped
                    break
            else:
                passed += 1
                print(f"PASS {name}", flush=True)
    finally:
        target.close()
    print(f"{passed} passed, {failed} failed")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
