"""The reward-server wire protocol (version 1): msgpack maps over ZeroMQ, one map per frame.

docs/reward-protocol.md is the normative description; this module is streamrl's implementation of
it. Every message is a msgspec Struct tagged by its ``type`` field, and each socket side has exactly
one typed decoder: the server decodes :data:`ClientMessage`, the client decodes :data:`ServerMessage`.
No pickle anywhere: a server in any language only needs ZeroMQ and msgpack.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

import msgspec

from streamrl import wire

#: Protocol versions this implementation speaks, newest last. A client offers all of them in its
#: ``hello``; the server answers with the newest one it also speaks.
PROTOCOL_VERSIONS: tuple[int, ...] = (1,)

ErrorCode = Literal["bad_request", "unsupported_version", "shutting_down", "overloaded", "internal"]
#: Error codes after which the client just sends the batch elsewhere: the server is healthy but
#: cannot take this request right now.
TRANSIENT_ERROR_CODES: frozenset[str] = frozenset({"shutting_down", "overloaded"})

Score = float | dict[str, float]

# Integer ranges (docs/reward-protocol.md §2). Ids fit int64 *and* uint64, so a server in a language
# with fixed-width integers can pick either; token ids fit int32. A float (even 3.0), a bool or a
# value out of range is a bad_request naming the field, never silently rounded.
#: request_id, sample id, ping nonce.
Id = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
TokenId = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]
Version = Annotated[int, msgspec.Meta(ge=1, le=2**31 - 1)]
#: Counts a server reports (workers, in_flight).
Count = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]

#: How deeply a sample's ``metadata`` may nest (a map inside a map ... counts one level per map or
#: array, the metadata map itself being level 1). Deeper is a bad_request: it bounds the work and
#: the recursion a single message can cause, in this decoder and in the user's reward function.
MAX_METADATA_DEPTH = 32
#: Longest error text this side keeps from a peer (the rest is cut): error strings end up in logs
#: and exceptions, and a peer must not be able to make them arbitrarily large.
MAX_ERROR_TEXT_CHARS = 2000


class ProtocolError(ValueError):
    """A message that does not follow the protocol.

    ``path`` names the offending field (``$.samples[0].id``) when known; ``request_id`` is the
    message's request id when it could be read, so the error can be charged to that request.
    """

    def __init__(self, reason: str, request_id: int | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.request_id = request_id


class RewardSample(msgspec.Struct, omit_defaults=True):
    """One sample to score. ``id`` is the caller's sample index (the dock's global index).

    At least one of ``response`` / ``response_ids`` should be set; which fields a reward function
    needs is between the user and their function. ``metadata`` values must be msgpack-able
    (numbers, strings, lists, maps): the ground-truth answer of a math task, test cases, ...
    Unknown fields are ignored on decode, so later protocol versions can add fields. Every optional
    field may arrive as nil, which means the same as absent; ``metadata`` is ``{}`` then (never
    None once constructed).
    """

    id: Id
    prompt: str | None = None
    response: str | None = None
    prompt_ids: list[TokenId] | None = None
    response_ids: list[TokenId] | None = None
    #: Typed ``| None`` only so that a nil on the wire decodes; ``__post_init__`` makes it ``{}``.
    metadata: dict[str, Any] | None = {}

    def __post_init__(self) -> None:
        # nil == absent (spec §2): msgspec would otherwise keep None in a field typed as a dict.
        if self.metadata is None:
            self.metadata = {}


class SampleResult(msgspec.Struct, omit_defaults=True):
    """A server's answer for one sample: exactly one of ``score`` and ``error`` is set."""

    id: Id
    score: float | dict[str, float] | None = None
    error: str | None = None


# -- client -> server -------------------------------------------------------------------------------


class Hello(msgspec.Struct, tag="hello", tag_field="type"):
    """Version negotiation: the client lists the protocol versions it speaks."""

    versions: list[Version]
    client: str | None = None


class ScoreRequest(msgspec.Struct, tag="score", tag_field="type"):
    """A batch to score. ``request_id`` is unique per client connection; a reply carries it back."""

    request_id: Id
    samples: list[RewardSample]


class Ping(msgspec.Struct, tag="ping", tag_field="type"):
    """Heartbeat; the server answers with a Pong carrying the same nonce."""

    nonce: Id


# -- server -> client -------------------------------------------------------------------------------
# Optional fields are ``X | None = None``: nil on the wire is the same as absent (spec §2).


class HelloReply(msgspec.Struct, tag="hello_reply", tag_field="type"):
    version: Version
    server: str | None = None
    #: How many batches the server scores concurrently (informational).
    workers: Count | None = None


class ScoreReply(msgspec.Struct, tag="score_reply", tag_field="type"):
    """One result per requested sample, in request order."""

    request_id: Id
    results: list[SampleResult]


class Pong(msgspec.Struct, tag="pong", tag_field="type"):
    nonce: Id
    #: Batches the server is scoring or has queued right now (informational).
    in_flight: Count | None = None


class ErrorReply(msgspec.Struct, tag="error", tag_field="type"):
    """A request-level failure. ``request_id`` is None when the request could not be parsed.

    ``code`` is a plain str, not :data:`ErrorCode`: a later server may add codes, and a client
    must still read (and report) the message instead of calling the whole reply undecodable.
    """

    code: str
    message: str
    request_id: Id | None = None
    #: Set with code ``unsupported_version``: the versions the server speaks.
    versions: list[Version] | None = None


ClientMessage = Hello | ScoreRequest | Ping
ServerMessage = HelloReply | ScoreReply | Pong | ErrorReply

_encoder = msgspec.msgpack.Encoder()
#: The server side's one decoder (use :func:`decode_client_message`, which also validates).
server_decoder: msgspec.msgpack.Decoder[ClientMessage] = msgspec.msgpack.Decoder(ClientMessage)
#: The client side's one decoder (use :func:`decode_server_message`, which also validates).
client_decoder: msgspec.msgpack.Decoder[ServerMessage] = msgspec.msgpack.Decoder(ServerMessage)


def encode(message: ClientMessage | ServerMessage) -> bytes:
    return _encoder.encode(message)


_TOO_DEEP = f"nested too deeply (metadata may nest at most {MAX_METADATA_DEPTH} levels)"


def decode_client_message(payload: bytes) -> ClientMessage:
    """The server's one decode-and-validate path: a typed message, or :class:`ProtocolError`.

    Beyond the types and ranges the decoder checks, it bounds metadata nesting. Never raises
    anything but ProtocolError for any payload, so one message can never stop a server.
    """
    try:
        message = server_decoder.decode(payload)
    except wire.DECODE_ERRORS as exc:
        raise ProtocolError(f"invalid message: {wire.describe(exc, _TOO_DEEP)}", peek_request_id(payload)) from None
    if isinstance(message, ScoreRequest):
        for index, sample in enumerate(message.samples):
            if wire.nests_deeper_than(sample.metadata, MAX_METADATA_DEPTH):
                raise ProtocolError(
                    f"invalid message: $.samples[{index}].metadata nests deeper than {MAX_METADATA_DEPTH} "
                    "levels; flatten it",
                    message.request_id,
                )
    return message


def decode_server_message(payload: bytes) -> ServerMessage:
    """The client's one decode path: a typed reply, or :class:`ProtocolError` (with the reply's
    request_id when readable). Error texts from the server are cut to MAX_ERROR_TEXT_CHARS."""
    try:
        message = client_decoder.decode(payload)
    except wire.DECODE_ERRORS as exc:
        raise ProtocolError(wire.describe(exc, _TOO_DEEP), peek_request_id(payload)) from None
    match message:
        case ErrorReply():
            message.message = clip_text(message.message)
            message.code = clip_text(message.code, 64)
        case ScoreReply():
            for result in message.results:
                if result.error is not None:
                    result.error = clip_text(result.error)
        case HelloReply(server=str(server)):
            message.server = clip_text(server, 200)
    return message


def clip_text(text: str, limit: int = MAX_ERROR_TEXT_CHARS) -> str:
    """``text`` cut to ``limit`` characters (with a marker), for texts a peer controls."""
    return text if len(text) <= limit else text[: max(0, limit - 3)] + "..."


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


class _RequestIdOnly(msgspec.Struct):
    request_id: Any = None


_peek_decoder = msgspec.msgpack.Decoder(_RequestIdOnly)


def peek_request_id(payload: bytes) -> int | None:
    """The ``request_id`` of a message that failed typed decoding, if it has a readable one.

    Lets an error be attributed to the right request (and its samples) even when the rest of the
    message is wrong. Reads only the top-level map (other fields are skipped, not built), and
    never raises.
    """
    return wire.peek_id(_peek_decoder, payload, "request_id")
