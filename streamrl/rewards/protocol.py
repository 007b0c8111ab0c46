"""The reward-server wire protocol (version 1): msgpack maps over ZeroMQ, one map per frame.

docs/reward-protocol.md is the normative description; this module is streamrl's implementation of
it. Every message is a msgspec Struct tagged by its ``type`` field, and each socket side has exactly
one typed decoder: the server decodes :data:`ClientMessage`, the client decodes :data:`ServerMessage`.
No pickle anywhere: a server in any language only needs ZeroMQ and msgpack.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import msgspec

#: Protocol versions this implementation speaks, newest last. A client offers all of them in its
#: ``hello``; the server answers with the newest one it also speaks.
PROTOCOL_VERSIONS: tuple[int, ...] = (1,)

ErrorCode = Literal["bad_request", "unsupported_version", "shutting_down", "overloaded", "internal"]
#: Error codes after which the client just sends the batch elsewhere: the server is healthy but
#: cannot take this request right now.
TRANSIENT_ERROR_CODES: frozenset[str] = frozenset({"shutting_down", "overloaded"})

Score = float | dict[str, float]


class RewardSample(msgspec.Struct, omit_defaults=True):
    """One sample to score. ``id`` is the caller's sample index (the dock's global index).

    At least one of ``response`` / ``response_ids`` should be set; which fields a reward function
    needs is between the user and their function. ``metadata`` values must be msgpack-able
    (numbers, strings, lists, maps): the ground-truth answer of a math task, test cases, ...
    Unknown fields are ignored on decode, so later protocol versions can add fields.
    """

    id: int
    prompt: str | None = None
    response: str | None = None
    prompt_ids: list[int] | None = None
    response_ids: list[int] | None = None
    metadata: dict[str, Any] = {}


class SampleResult(msgspec.Struct, omit_defaults=True):
    """A server's answer for one sample: exactly one of ``score`` and ``error`` is set."""

    id: int
    score: float | dict[str, float] | None = None
    error: str | None = None


# -- client -> server -------------------------------------------------------------------------------


class Hello(msgspec.Struct, tag="hello", tag_field="type"):
    """Version negotiation: the client lists the protocol versions it speaks."""

    versions: list[int]
    client: str = ""


class ScoreRequest(msgspec.Struct, tag="score", tag_field="type"):
    """A batch to score. ``request_id`` is unique per client connection; a reply carries it back."""

    request_id: int
    samples: list[RewardSample]


class Ping(msgspec.Struct, tag="ping", tag_field="type"):
    """Heartbeat; the server answers with a Pong carrying the same nonce."""

    nonce: int


# -- server -> client -------------------------------------------------------------------------------


class HelloReply(msgspec.Struct, tag="hello_reply", tag_field="type"):
    version: int
    server: str = ""
    #: How many batches the server scores concurrently (informational).
    workers: int = 1


class ScoreReply(msgspec.Struct, tag="score_reply", tag_field="type"):
    """One result per requested sample, in request order."""

    request_id: int
    results: list[SampleResult]


class Pong(msgspec.Struct, tag="pong", tag_field="type"):
    nonce: int
    #: Batches the server is scoring or has queued right now (informational).
    in_flight: int = 0


class ErrorReply(msgspec.Struct, tag="error", tag_field="type"):
    """A request-level failure. ``request_id`` is None when the request could not be parsed."""

    code: str
    message: str
    request_id: int | None = None
    #: Set with code ``unsupported_version``: the versions the server speaks.
    versions: list[int] | None = None


ClientMessage = Hello | ScoreRequest | Ping
ServerMessage = HelloReply | ScoreReply | Pong | ErrorReply

_encoder = msgspec.msgpack.Encoder()
#: The server side's one decoder.
server_decoder: msgspec.msgpack.Decoder[ClientMessage] = msgspec.msgpack.Decoder(ClientMessage)
#: The client side's one decoder.
client_decoder: msgspec.msgpack.Decoder[ServerMessage] = msgspec.msgpack.Decoder(ServerMessage)


def encode(message: ClientMessage | ServerMessage) -> bytes:
    return _encoder.encode(message)


def check_score(value: object) -> str | None:
    """Why ``value`` is not a valid score, or None if it is one.

    Valid: a finite float (ints accepted) or a non-empty dict of str -> finite float. A NaN or
    infinite reward would silently poison the advantages, so it is an error here, not later.
    """
    if isinstance(value, bool):
        return "score is a bool; expected a float or a dict of named floats"
    if isinstance(value, int | float):
        return None if math.isfinite(value) else f"score {value!r} is not finite"
    if isinstance(value, dict):
        if not value:
            return "score is an empty dict; expected at least one named score"
        for name, item in value.items():
            if not isinstance(name, str):
                return f"score name {name!r} is not a string"
            if isinstance(item, bool) or not isinstance(item, int | float):
                return f"named score {name!r} is {type(item).__name__}; expected a float"
            if not math.isfinite(item):
                return f"named score {name!r} = {item!r} is not finite"
        return None
    return f"score is {type(value).__name__}; expected a float or a dict of named floats"


def normalise_score(value: float | dict[str, float]) -> float | dict[str, float]:
    """Ints to floats, so results compare and serialise the same whichever backend made them."""
    if isinstance(value, dict):
        return {name: float(item) for name, item in value.items()}
    return float(value)


def peek_request_id(payload: bytes) -> int | None:
    """The ``request_id`` of a message that failed typed decoding, if it has a readable one.

    Lets an error be attributed to the right request (and its samples) even when the rest of the
    message is wrong.
    """
    try:
        loose = msgspec.msgpack.decode(payload)
    except (msgspec.DecodeError, ValueError):
        return None
    if isinstance(loose, dict):
        request_id = loose.get("request_id")
        if isinstance(request_id, int) and not isinstance(request_id, bool):
            return request_id
    return None
