"""Messages of the transfer dock's two sockets, as msgspec tagged-union Structs.

Every message is a multipart ZeroMQ message: ``[header, *tensor_frames]`` as seen by a DEALER
(a ROUTER sees the peer's routing id in front). The header is msgpack of one of the Structs
below, tagged by its ``type`` field; tensor frames carry raw bytes described by the header
(see :mod:`streamrl.dock.codec`). Each socket has exactly one typed decoder: a message of the
wrong type is a decode error, answered with :class:`ErrorReply` when a request id can be read.
The full byte-level spec is ``docs/dock-protocol.md``.
"""

from __future__ import annotations

from typing import Any

import msgspec

PROTOCOL_VERSION = 1


class _Msg(msgspec.Struct, tag_field="type", forbid_unknown_fields=True, omit_defaults=True):
    pass


# ---------------------------------------------------------------- column payloads (in headers)
class TensorColumn(msgspec.Struct, tag="tensor", tag_field="kind", forbid_unknown_fields=True):
    """One column's tensors: value i has ``shapes[i]`` and lives in tensor frame ``frames[i]``
    starting at byte ``offsets[i]``. All values of one column share ``dtype`` (torch name)."""

    name: str
    dtype: str
    shapes: list[list[int]]
    frames: list[int]
    offsets: list[int]


class ObjectColumn(msgspec.Struct, tag="object", tag_field="kind", forbid_unknown_fields=True):
    """One column of small msgpack-able values (numbers, strings, lists, maps), one per sample."""

    name: str
    values: list[Any]


Column = TensorColumn | ObjectColumn


class SampleInfo(msgspec.Struct, array_like=True):
    """What the controller knows of one claimed sample (sent as a 5-array for compactness)."""

    index: int
    group: int
    group_size: int
    version: int
    length: int


# ---------------------------------------------------------------- controller socket: requests
class Hello(_Msg, tag="hello"):
    req_id: int
    client_id: str
    protocol: int  # no default: always on the wire, so a newer controller can tell versions apart
    lease_ttl_s: float = 10.0  # leases of this client expire this long after its last message


class WarehouseHello(_Msg, tag="warehouse_hello"):
    warehouse_id: int
    endpoint: str
    protocol: int  # no default: always on the wire


class Heartbeat(_Msg, tag="heartbeat"):
    client_id: str  # no reply: renews every lease the client holds


class Reserve(_Msg, tag="reserve"):
    req_id: int
    client_id: str
    n: int
    group_size: int = 1
    timeout_s: float | None = None  # None: wait for capacity as long as it takes; 0: fail at once


class Claim(_Msg, tag="claim"):
    req_id: int
    client_id: str
    consumer: str
    reads: list[str]
    n: int
    min_n: int = 1
    whole_groups: bool = False
    balance_by_length: bool = False
    min_version: int | None = None
    timeout_s: float | None = 0.0  # how long the controller holds the claim open waiting for samples
    partial_at_timeout: bool = True  # at timeout, hand out fewer than min_n rather than none


class Ack(_Msg, tag="ack"):
    req_id: int
    client_id: str
    lease_id: int
    indices: list[int] | None = None  # None: the whole lease


class Release(_Msg, tag="release"):
    req_id: int
    client_id: str
    lease_id: int  # give the lease's unacked samples back to the pool


class ColumnsReady(_Msg, tag="columns_ready"):
    warehouse_id: int
    indices: list[int]
    columns: list[str]
    versions: list[int] | None = None
    lengths: list[int] | None = None


class CloseInput(_Msg, tag="close_input"):
    req_id: int
    client_id: str


class StatsRequest(_Msg, tag="stats"):
    req_id: int


ControllerRequest = (
    Hello | WarehouseHello | Heartbeat | Reserve | Claim | Ack | Release | ColumnsReady | CloseInput | StatsRequest
)


# ---------------------------------------------------------------- warehouse socket: requests
class Put(_Msg, tag="put"):
    req_id: int
    indices: list[int]
    columns: list[Column]
    versions: list[int] | None = None  # policy version of each sample, forwarded to the controller
    lengths: list[int] | None = None  # length of each sample (tokens), for length-balanced claims


class Get(_Msg, tag="get"):
    req_id: int
    indices: list[int]
    columns: list[str]


class Free(_Msg, tag="free"):
    indices: list[int]  # controller -> warehouse: every consumer acked these; drop them


WarehouseRequest = Put | Get | Free | StatsRequest


# ---------------------------------------------------------------- replies (both sockets)
class HelloReply(_Msg, tag="hello_reply"):
    req_id: int
    protocol: int
    warehouses: list[str]  # endpoint of warehouse i; sample index k lives on warehouse k % len
    consumers: list[str]
    capacity: int


class Reserved(_Msg, tag="reserved"):
    req_id: int
    indices: list[int]
    groups: list[int]


class Claimed(_Msg, tag="claimed"):
    req_id: int
    lease_id: int
    samples: list[SampleInfo]
    dropped_stale: int = 0
    end: bool = False  # input closed and this consumer has had every sample


class Ok(_Msg, tag="ok"):
    req_id: int


class Fetched(_Msg, tag="fetched"):
    req_id: int
    indices: list[int]
    columns: list[Column]


class Stats(_Msg, tag="stats_reply"):
    req_id: int
    stats: dict[str, Any]


class ErrorReply(_Msg, tag="error"):
    req_id: int
    code: str
    message: str


Reply = HelloReply | Reserved | Claimed | Ok | Fetched | Stats | ErrorReply

encoder = msgspec.msgpack.Encoder()
controller_request_decoder = msgspec.msgpack.Decoder(ControllerRequest)
warehouse_request_decoder = msgspec.msgpack.Decoder(WarehouseRequest)
reply_decoder = msgspec.msgpack.Decoder(Reply)

_req_id_probe = msgspec.msgpack.Decoder(dict[str, Any])


def decode_request(decoder: msgspec.msgpack.Decoder, header: bytes) -> tuple[Any, ErrorReply | None]:
    """(request, None), or (None, the ``malformed`` error to answer with; None when no request id
    can be read, so the sender cannot be answered and the message is only dropped)."""
    try:
        return decoder.decode(header), None
    except msgspec.DecodeError as exc:
        rid = salvage_req_id(header)
        return None, None if rid is None else ErrorReply(rid, "malformed", f"could not decode request: {exc}")


def salvage_req_id(header: bytes) -> int | None:
    """Best-effort request id of a header that failed typed decoding, so the error can be answered."""
    try:
        value = _req_id_probe.decode(header).get("req_id")
    except (msgspec.DecodeError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None
