"""Messages of the transfer dock's two sockets, as msgspec tagged-union Structs.

Every message is a multipart ZeroMQ message: ``[header, *tensor_frames]`` as seen by a DEALER
(a ROUTER sees the peer's routing id in front). The header is msgpack of one of the Structs
below, tagged by its ``type`` field; tensor frames carry raw bytes described by the header
(see :mod:`streamrl.dock.codec`). Each socket has exactly one typed decoder, and every message
goes through :func:`decode_request` / :func:`decode_reply`: a message of the wrong type, with a
value outside its bound, with text that is not UTF-8 or nested too deeply is a decode error,
answered with :class:`ErrorReply` (code ``malformed``) when a request id can be read, never an
exception that reaches a server loop.

Bounds are declared once, as ``Annotated[..., Meta(...)]`` on the fields, so msgspec checks them
in C while decoding (no Python loop per value). Every bound is listed in docs/dock-protocol.md §4.
The full byte-level spec is ``docs/dock-protocol.md``.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta

from streamrl import wire

# 2: warehouse_hello carries req_id + secret and is answered; every field has a documented bound
# 3: columns_ready carries req_id and is answered (a put is ok only once its columns are ready)
PROTOCOL_VERSION = 3

# ---------------------------------------------------------------- bounds (docs/dock-protocol.md §4.0)
INT63 = (1 << 63) - 1  # ids, indices, versions, lengths, offsets: non-negative int64, so any language's int64 fits
MAX_ITEMS = 1 << 20  # entries of any list in a header (indices, values, shapes, ...): far above a micro-batch
MAX_COLUMNS = 256  # columns per message, and distinct column names per dock (the controller keeps a bitmask)
MAX_NAME = 256  # characters of a client id, consumer or column name
MAX_NDIM = 32  # dimensions of one tensor value
MAX_FRAMES = 1 << 16  # tensor frames after one header
MAX_DEPTH = 32  # nesting of arrays/maps inside one object-column value
MAX_TIMEOUT_S = 86_400.0  # a day: any longer wait is a bug (timeout_s nil still means "for ever" on reserve)
MIN_TTL_S, MAX_TTL_S = 0.05, 3600.0

Id = Annotated[int, Meta(ge=0, le=INT63)]
Count = Annotated[int, Meta(ge=1, le=MAX_ITEMS)]
Name = Annotated[str, Meta(min_length=1, max_length=MAX_NAME)]
Seconds = Annotated[float, Meta(ge=0.0, le=MAX_TIMEOUT_S)]  # rejects NaN, inf and negatives
Ttl = Annotated[float, Meta(ge=MIN_TTL_S, le=MAX_TTL_S)]
ProtocolNo = Annotated[int, Meta(ge=0, le=65_535)]
WarehouseId = Annotated[int, Meta(ge=0, le=65_535)]
Ids = Annotated[list[Id], Meta(max_length=MAX_ITEMS)]
Names = Annotated[list[Name], Meta(max_length=MAX_COLUMNS)]
Shape = Annotated[list[Annotated[int, Meta(ge=0, le=INT63)]], Meta(max_length=MAX_NDIM)]
FrameIdx = Annotated[int, Meta(ge=0, lt=MAX_FRAMES)]
MAX_BLOCK = 1 << 30  # samples per ownership block
Block = Annotated[int, Meta(ge=1, le=MAX_BLOCK)]


def owner(index: int, n_warehouses: int, block: int = 1) -> int:
    """The warehouse that stores sample ``index``: ``(index // block) % n_warehouses`` (docs §5.1)."""
    return (index // block) % n_warehouses if block > 1 else index % n_warehouses


class _Msg(msgspec.Struct, tag_field="type", forbid_unknown_fields=True, omit_defaults=True, kw_only=True):
    # A request sent again, on the connection that replaced one that reset (docs §5.8): a server that
    # already had it answers from the reply it kept (or leaves it to its parked original) instead of
    # applying it twice. Only such resends are de-duplicated: a req_id used again without it is new.
    # Keyword-only, so every message's own fields keep their positions.
    again: bool = False


# ---------------------------------------------------------------- column payloads (in headers)
class TensorColumn(msgspec.Struct, tag="tensor", tag_field="kind", forbid_unknown_fields=True):
    """One column's tensors: value i has ``shapes[i]`` and lives in tensor frame ``frames[i]``
    starting at byte ``offsets[i]``. All values of one column share ``dtype`` (torch name)."""

    name: Name
    dtype: Annotated[str, Meta(max_length=32)]
    shapes: Annotated[list[Shape], Meta(max_length=MAX_ITEMS)]
    frames: Annotated[list[FrameIdx], Meta(max_length=MAX_ITEMS)]
    offsets: Ids


class ObjectColumn(msgspec.Struct, tag="object", tag_field="kind", forbid_unknown_fields=True):
    """One column of small msgpack-able values (numbers, strings, lists, maps), one per sample.
    Nesting is bounded (``MAX_DEPTH``) by :func:`check_depth`, which decode_request runs."""

    name: Name
    values: Annotated[list[Any], Meta(max_length=MAX_ITEMS)]


Column = TensorColumn | ObjectColumn
Columns = Annotated[list[Column], Meta(max_length=MAX_COLUMNS)]


class SampleInfo(msgspec.Struct, array_like=True):
    """What the controller knows of one claimed sample, sent as an array for compactness:
    ``[index, group, group_size, version, length, returned]``. ``returned`` counts the earlier claims
    of the sample by this consumer that ended without an ack (the lease was released or expired;
    it saturates at 255), so a consumer tells a first delivery from a redelivery after a worker
    died. A decoder reads the first six elements and ignores any after them; a 5-element array
    (an older controller) means ``returned`` 0."""

    index: Id
    group: Id
    group_size: Count
    version: Id
    length: Id
    returned: Annotated[int, Meta(ge=0, le=255)] = 0


# ---------------------------------------------------------------- controller socket: requests
class Hello(_Msg, tag="hello"):
    req_id: Id
    client_id: Name
    protocol: ProtocolNo  # no default: always on the wire, so a newer controller can tell versions apart
    lease_ttl_s: Ttl = 10.0  # leases of this client expire this long after its last message
    # the warehouse on this client's node (statistics: claims of samples owned elsewhere are remote)
    home_warehouse: WarehouseId | None = None


class WarehouseHello(_Msg, tag="warehouse_hello"):
    """A warehouse registers; only one that knows the run's secret is accepted (answered ok/error)."""

    req_id: Id
    warehouse_id: WarehouseId
    endpoint: Annotated[str, Meta(min_length=1, max_length=1024)]
    protocol: ProtocolNo  # no default: always on the wire
    secret: Annotated[str, Meta(max_length=1024)]  # the per-run secret the launcher handed to the dock
    block: Block = 1  # the ownership block this warehouse was started with: must equal the controller's


class Heartbeat(_Msg, tag="heartbeat"):
    client_id: Name  # no reply: renews every lease the client holds


class Reserve(_Msg, tag="reserve"):
    req_id: Id
    client_id: Name
    n: Count
    group_size: Count = 1
    timeout_s: Seconds | None = None  # None: wait for capacity as long as it takes; 0: fail at once
    # allocate inside blocks this warehouse owns (data locality; block > 1 only, docs §5.1)
    warehouse: WarehouseId | None = None


class Claim(_Msg, tag="claim"):
    req_id: Id
    client_id: Name
    consumer: Name
    reads: Names
    n: Count
    min_n: Count = 1
    whole_groups: bool = False
    balance_by_length: bool = False
    min_version: Id | None = None
    timeout_s: Seconds | None = 0.0  # how long the controller holds the claim open waiting for samples
    partial_at_timeout: bool = True  # at timeout, hand out fewer than min_n rather than none
    # hand out samples of one reserve only (the first one picked's): e.g. one step's prompts, so a
    # generator never holds prompts of a step whose policy version waits on its own batch
    one_reserve: bool = False


class Ack(_Msg, tag="ack"):
    req_id: Id
    client_id: Name
    lease_id: Id
    indices: Ids | None = None  # None: the whole lease
    # drop these samples from the run: every other consumer that has not claimed them never gets
    # them (they count as done for it), e.g. a dynamic-sampling filter dropping uninformative groups
    discard: bool = False


class Release(_Msg, tag="release"):
    req_id: Id
    client_id: Name
    lease_id: Id  # give the lease's unacked samples back to the pool


class ColumnsReady(_Msg, tag="columns_ready"):
    warehouse_id: WarehouseId
    indices: Ids
    columns: Names  # empty: a resync after re-registration (the controller frees the dead indices)
    versions: Ids | None = None
    lengths: Ids | None = None
    # the ZAP role of the client whose put stored these columns (authenticated docks, docs §6.2):
    # the controller accepts them only from the stage that owns each column
    writer: Name | None = None
    # answered ok (or error) when set: the warehouse answers the put that stored these columns only
    # then, and resends it after a link reset until answered (columns_ready is idempotent)
    req_id: Id | None = None
    # the put's ack (docs §5.7): these indices of lease ack_lease of client ack_client are done
    # for its consumer once their columns are ready. Applied once: resent, the indices already done
    # (or a lease gone) are skipped
    ack_client: Name | None = None
    ack_lease: Id | None = None


class CloseInput(_Msg, tag="close_input"):
    req_id: Id
    client_id: Name


class StatsRequest(_Msg, tag="stats"):
    req_id: Id
    # A long poll of a few figures (controller only, docs §5.9): the reply's stats then carry
    # ``watched``, a token of these consumers' ``done`` and ``claimed`` and the dock's
    # ``samples_discarded`` and ``dropped_stale``. Given the token of an earlier reply as ``seen``,
    # the controller holds the request until the token differs, or ``timeout_s`` passes.
    watch: Names | None = None
    seen: Id | None = None
    timeout_s: Seconds = 0.0


ControllerRequest = (
    Hello | WarehouseHello | Heartbeat | Reserve | Claim | Ack | Release | ColumnsReady | CloseInput | StatsRequest
)


# ---------------------------------------------------------------- warehouse socket: requests
class Put(_Msg, tag="put"):
    req_id: Id
    indices: Ids
    columns: Columns
    versions: Ids | None = None  # policy version of each sample, forwarded to the controller
    lengths: Ids | None = None  # length of each sample (tokens), for length-balanced claims
    # ack these indices of lease ack_lease (held by client ack_client) once the columns are ready:
    # a consumer's result and its ack in one message (docs §5.7); both or neither
    ack_client: Name | None = None
    ack_lease: Id | None = None


class Get(_Msg, tag="get"):
    req_id: Id
    indices: Ids
    columns: Names


class Free(_Msg, tag="free"):
    indices: Ids  # controller -> warehouse: every consumer acked these; drop them


WarehouseRequest = Put | Get | Free | StatsRequest


# ---------------------------------------------------------------- replies (both sockets)
class HelloReply(_Msg, tag="hello_reply"):
    req_id: Id
    protocol: ProtocolNo
    warehouses: Annotated[list[str], Meta(max_length=65_536)]  # endpoint of warehouse i; k lives on owner(k)
    consumers: Names
    capacity: Annotated[int, Meta(ge=1, le=INT63)]  # samples in flight: may exceed one message's MAX_ITEMS
    block: Block = 1  # owner(k) = (k // block) % len(warehouses); omitted on the wire when 1


class Reserved(_Msg, tag="reserved"):
    req_id: Id
    indices: Ids
    groups: Ids


class Claimed(_Msg, tag="claimed"):
    req_id: Id
    lease_id: Id
    samples: Annotated[list[SampleInfo], Meta(max_length=MAX_ITEMS)]
    dropped_stale: Annotated[int, Meta(ge=0, le=INT63)] = 0
    end: bool = False  # input closed and this consumer has had every sample


class Ok(_Msg, tag="ok"):
    req_id: Id


class Fetched(_Msg, tag="fetched"):
    req_id: Id
    indices: Ids
    columns: Columns


class Stats(_Msg, tag="stats_reply"):
    req_id: Id
    stats: dict[str, Any]


class ErrorReply(_Msg, tag="error"):
    req_id: int  # not bounded: -1 answers a request whose id could not be read
    code: Annotated[str, Meta(max_length=64)]
    message: Annotated[str, Meta(max_length=65_536)]


Reply = HelloReply | Reserved | Claimed | Ok | Fetched | Stats | ErrorReply
ControllerToWarehouse = Free | Ok | ErrorReply  # what a warehouse's DEALER receives from the controller

encoder = msgspec.msgpack.Encoder()
controller_request_decoder = msgspec.msgpack.Decoder(ControllerRequest)
warehouse_request_decoder = msgspec.msgpack.Decoder(WarehouseRequest)
controller_to_warehouse_decoder = msgspec.msgpack.Decoder(ControllerToWarehouse)
reply_decoder = msgspec.msgpack.Decoder(Reply)


class _ReqIdProbe(msgspec.Struct):
    """Reads only ``req_id``; msgspec skips the other keys without decoding them (so a bad UTF-8
    string elsewhere in the header does not stop us answering)."""

    req_id: Any = None


_req_id_probe = msgspec.msgpack.Decoder(_ReqIdProbe)
_TOO_DEEP = f"arrays/maps nested far too deep (at most {MAX_DEPTH} levels in a value)"


class TooDeep(ValueError):
    """An object-column value nests arrays/maps deeper than MAX_DEPTH."""


def check_depth(values: list[Any], limit: int = MAX_DEPTH) -> None:
    """Raise :class:`TooDeep` if any value nests containers more than ``limit`` levels."""
    if wire.nests_deeper_than(values, limit + 1):  # + 1: the list of values itself is a level
        raise TooDeep(f"an object value nests arrays/maps more than {limit} levels deep")


def _check_values(msg: Any) -> None:
    """Checks msgspec cannot declare: nesting depth of ``any`` values (put and fetched only)."""
    if type(msg) is Put or type(msg) is Fetched:
        for col in msg.columns:
            if type(col) is ObjectColumn:
                check_depth(col.values)


def decode_request(decoder: msgspec.msgpack.Decoder, header: bytes) -> tuple[Any, ErrorReply | None]:
    """(request, None), or (None, the ``malformed`` error to answer with; None when no request id
    can be read, so the sender cannot be answered and the message is only dropped). Never raises."""
    try:
        msg = decoder.decode(header)
        _check_values(msg)
        return msg, None
    except wire.DECODE_ERRORS as exc:
        rid = salvage_req_id(header)
        text = wire.describe(exc, _TOO_DEEP)
        return None, None if rid is None else ErrorReply(rid, "malformed", f"could not decode request: {text}")


def decode_reply(header: bytes) -> Any:
    """A reply (client side), or None for garbage (the waiting request then times out). Never raises."""
    try:
        msg = reply_decoder.decode(header)
        _check_values(msg)
        return msg
    except wire.DECODE_ERRORS:
        return None


def salvage_req_id(header: bytes) -> int | None:
    """Best-effort request id of a header that failed typed decoding, so the error can be answered.
    Never raises; ids outside [0, 2^63) are not echoed (the reply would be refused by the sender)."""
    return wire.peek_id(_req_id_probe, header, "req_id")
