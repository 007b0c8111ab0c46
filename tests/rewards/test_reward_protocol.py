from __future__ import annotations

import math
import re

import msgpack
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamrl.rewards.protocol import (
    ErrorReply,
    Hello,
    HelloReply,
    Ping,
    Pong,
    ProtocolError,
    RewardSample,
    SampleResult,
    ScoreReply,
    ScoreRequest,
    check_score,
    client_decoder,
    decode_client_message,
    decode_server_message,
    encode,
    peek_request_id,
    server_decoder,
)

samples = st.builds(
    RewardSample,
    id=st.integers(min_value=0, max_value=2**62),
    prompt=st.none() | st.text(max_size=50),
    response=st.none() | st.text(max_size=50),
    prompt_ids=st.none() | st.lists(st.integers(0, 2**31 - 1), max_size=20),
    response_ids=st.none() | st.lists(st.integers(0, 2**31 - 1), max_size=20),
    metadata=st.dictionaries(
        st.text(max_size=8),
        st.integers(-(2**63), 2**63 - 1) | st.text(max_size=8) | st.floats(allow_nan=False),
    ),
)


@settings(max_examples=50, deadline=None)
@given(st.lists(samples, max_size=8), st.integers(min_value=0, max_value=2**63 - 1))
def test_score_request_round_trips_through_the_server_decoder(
    batch: list[RewardSample], request_id: int
) -> None:
    request = ScoreRequest(request_id=request_id, samples=batch)
    assert server_decoder.decode(encode(request)) == request


def test_messages_are_plain_msgpack_maps_with_a_type_tag() -> None:
    """What another language sees: maps, string keys, the documented field names."""
    wire = msgpack.unpackb(encode(ScoreRequest(request_id=7, samples=[RewardSample(id=3, response="hi")])))
    assert wire == {"type": "score", "request_id": 7, "samples": [{"id": 3, "response": "hi"}]}
    wire = msgpack.unpackb(encode(ScoreReply(request_id=7, results=[SampleResult(id=3, score=1.5)])))
    assert wire == {"type": "score_reply", "request_id": 7, "results": [{"id": 3, "score": 1.5}]}
    wire = msgpack.unpackb(encode(ErrorReply(code="bad_request", message="no")))
    assert wire == {
        "type": "error",
        "code": "bad_request",
        "message": "no",
        "request_id": None,
        "versions": None,
    }


def test_each_side_decodes_only_its_own_messages() -> None:
    for message in (Hello(versions=[1]), Ping(nonce=1), ScoreRequest(request_id=1, samples=[])):
        assert server_decoder.decode(encode(message)) == message
        with pytest.raises(msgspec.ValidationError):
            client_decoder.decode(encode(message))
    for message in (
        HelloReply(version=1),
        Pong(nonce=2),
        ScoreReply(request_id=1, results=[]),
        ErrorReply("x", "y"),
    ):
        assert client_decoder.decode(encode(message)) == message
        with pytest.raises(msgspec.ValidationError):
            server_decoder.decode(encode(message))


def test_named_scores_and_integer_scores_decode_as_floats() -> None:
    payload = msgpack.packb(
        {
            "type": "score_reply",
            "request_id": 1,
            "results": [{"id": 0, "score": 2}, {"id": 1, "score": {"a": 1}}],
        }
    )
    reply = client_decoder.decode(payload)
    assert isinstance(reply, ScoreReply)
    assert reply.results[0].score == 2.0 and reply.results[1].score == {"a": 1.0}


def test_unknown_fields_are_ignored_for_forward_compatibility() -> None:
    payload = msgpack.packb({"type": "ping", "nonce": 5, "added_in_v2": True})
    assert server_decoder.decode(payload) == Ping(nonce=5)


def test_validation_errors_name_the_field() -> None:
    payload = msgpack.packb({"type": "score", "request_id": 9, "samples": [{"id": "seven"}]})
    with pytest.raises(msgspec.ValidationError, match=r"\$\.samples\[0\]\.id"):
        server_decoder.decode(payload)
    assert peek_request_id(payload) == 9
    assert peek_request_id(b"\xc1 garbage") is None
    assert peek_request_id(msgpack.packb([1, 2])) is None


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        (1.0, None),
        (3, None),
        ({"a": 1.0, "b": 2}, None),
        (True, "bool"),
        (math.nan, "not finite"),
        (math.inf, "not finite"),
        ({}, "empty"),
        ({"a": "x"}, "named score 'a'"),
        ({"a": math.nan}, "not finite"),
        ("1.0", "str"),
        (None, "NoneType"),
    ],
)
def test_check_score(value: object, problem: str | None) -> None:
    result = check_score(value)
    if problem is None:
        assert result is None
    else:
        assert result is not None and problem in result


@pytest.mark.parametrize(
    "wire",
    [
        {"type": "hello", "versions": [1], "client": None},
        {"type": "ping", "nonce": 1},
        {
            "type": "score",
            "request_id": 1,
            "samples": [
                {
                    "id": 1,
                    "prompt": None,
                    "response": None,
                    "prompt_ids": None,
                    "response_ids": None,
                    "metadata": None,
                }
            ],
        },
    ],
)
def test_every_optional_client_field_may_be_nil(wire: dict) -> None:
    message = decode_client_message(msgpack.packb(wire))
    if isinstance(message, ScoreRequest):
        assert message.samples[0] == RewardSample(id=1) and message.samples[0].metadata == {}


@pytest.mark.parametrize(
    "wire",
    [
        {"type": "hello_reply", "version": 1, "server": None, "workers": None},
        {"type": "pong", "nonce": 1, "in_flight": None},
        {"type": "score_reply", "request_id": 1, "results": [{"id": 1, "score": 1.0, "error": None}]},
        {"type": "score_reply", "request_id": 1, "results": [{"id": 1, "score": None, "error": "x"}]},
        {"type": "error", "code": "internal", "message": "m", "request_id": None, "versions": None},
    ],
)
def test_every_optional_server_field_may_be_nil(wire: dict) -> None:
    decode_server_message(msgpack.packb(wire))


def test_texts_from_a_server_are_clipped() -> None:
    reply = decode_server_message(
        msgpack.packb({"type": "error", "code": "c" * 500, "message": "m" * 10**6, "request_id": 1})
    )
    assert isinstance(reply, ErrorReply) and len(reply.message) == 2000 and len(reply.code) == 64


@pytest.mark.parametrize(
    ("wire", "field"),
    [
        ({"type": "score", "request_id": 1.0, "samples": []}, "$.request_id"),
        ({"type": "score", "request_id": -1, "samples": []}, "$.request_id"),
        ({"type": "score", "request_id": 1, "samples": [{"id": 2.5}]}, "$.samples[0].id"),
        (
            {"type": "score", "request_id": 1, "samples": [{"id": 1, "prompt_ids": [2**31]}]},
            "$.samples[0].prompt_ids[0]",
        ),
        ({"type": "ping", "nonce": True}, "$.nonce"),
        ({"type": "hello", "versions": [0]}, "$.versions[0]"),
    ],
)
def test_integers_are_integers_in_range(wire: dict, field: str) -> None:
    with pytest.raises(ProtocolError, match=re.escape(f"`{field}`")):
        decode_client_message(msgpack.packb(wire))
