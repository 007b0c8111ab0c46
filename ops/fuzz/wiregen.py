"""Structure-aware generation of hostile msgpack messages from a socket's msgspec message types.

Each socket in streamrl decodes its messages with one msgspec decoder over a tagged union of
Structs. :class:`MessageFuzzer` reads that union with ``msgspec.inspect`` and generates, from a
seeded ``random.Random`` (fast: ~10^4-10^5 messages/s, so 10^5 frames per socket is seconds):

* **valid** messages: every field drawn from its type, respecting declared constraints;
* **mutants** of a valid message, one change each: a field dropped, retyped, replaced by an
  extreme value (NaN, inf, 2^64-1, -2^63, 10^308, a 1 MiB string, a 100k-element list), an
  unknown field added, the tag changed, a string made invalid UTF-8, a value nested 10^5 deep,
  the encoding truncated or a byte flipped;
* **raw** frames: random bytes, empty frames, lone msgpack prefixes that declare huge lengths.

Strings that are not UTF-8 and nesting deeper than any msgpack library will build need bytes no
normal encoder produces, so messages are encoded by the small :func:`pack` here, which accepts
:class:`RawStr` (a msgpack str header over arbitrary bytes) and :class:`Raw` (pre-encoded bytes).
"""

from __future__ import annotations

import math
import random
import struct
from dataclasses import dataclass
from typing import Any

import msgspec
import msgspec.inspect as mi


@dataclass(frozen=True)
class RawStr:
    """A msgpack ``str`` whose payload is these bytes, UTF-8 or not."""

    data: bytes


@dataclass(frozen=True)
class Raw:
    """Bytes spliced into the encoding as they are (e.g. ``0x91`` x 10^5: an array nested 10^5 deep)."""

    data: bytes


def pack(value: Any) -> bytes:
    """msgpack encoding of ``value`` (None, bool, int, float, str, bytes, list, tuple, dict, RawStr, Raw)."""
    out = bytearray()
    _pack(value, out)
    return bytes(out)


def _pack(v: Any, out: bytearray) -> None:
    if v is None:
        out.append(0xC0)
    elif v is True:
        out.append(0xC3)
    elif v is False:
        out.append(0xC2)
    elif isinstance(v, int):
        if 0 <= v < 128:
            out.append(v)
        elif -32 <= v < 0:
            out.append(v & 0xFF)
        elif 0 <= v < 2**64:
            out += b"\xcf" + struct.pack(">Q", v)
        elif -(2**63) <= v < 0:
            out += b"\xd3" + struct.pack(">q", v)
        else:  # beyond 64 bits: no msgpack int holds it; send the widest and let the peer see 2^64-1
            out += b"\xcf" + b"\xff" * 8
    elif isinstance(v, float):
        out += b"\xcb" + struct.pack(">d", v)
    elif isinstance(v, str | RawStr):
        data = v.data if isinstance(v, RawStr) else v.encode("utf-8", "surrogatepass")
        n = len(data)
        if n < 32:
            out.append(0xA0 | n)
        elif n < 2**8:
            out += b"\xd9" + bytes([n])
        elif n < 2**16:
            out += b"\xda" + struct.pack(">H", n)
        else:
            out += b"\xdb" + struct.pack(">I", n)
        out += data
    elif isinstance(v, bytes | bytearray | memoryview):
        data = bytes(v)
        n = len(data)
        out += (b"\xc4" + bytes([n])) if n < 2**8 else (b"\xc6" + struct.pack(">I", n))
        out += data
    elif isinstance(v, list | tuple):
        n = len(v)
        out += bytes([0x90 | n]) if n < 16 else (b"\xdc" + struct.pack(">H", n)) if n < 2**16 else (
            b"\xdd" + struct.pack(">I", n))
        for x in v:
            _pack(x, out)
    elif isinstance(v, dict):
        n = len(v)
        out += bytes([0x80 | n]) if n < 16 else (b"\xde" + struct.pack(">H", n)) if n < 2**16 else (
            b"\xdf" + struct.pack(">I", n))
        for k, x in v.items():
            _pack(k, out)
            _pack(x, out)
    elif isinstance(v, Raw):
        out += v.data
    else:
        raise TypeError(f"cannot pack {type(v).__name__}")


EXTREME_INTS = (0, -1, 1, 2**31, 2**53 + 1, 2**63 - 1, 2**64 - 1, -(2**63), -(2**31), 10**30)
EXTREME_FLOATS = (math.nan, math.inf, -math.inf, 1e308, -1e308, 5e-324, -0.0, 1e-300, 2.0**63)


_BIG: list[Raw] = []


def _big_values() -> list[Raw]:
    """The expensive extremes, encoded once: long text, deep nesting, long lists."""
    if not _BIG:
        for v in ("x" * (1 << 10), "x" * (1 << 16), "x" * (1 << 20), list(range(1_000)), list(range(100_000))):
            _BIG.append(Raw(pack(v)))
        for depth in (100, 2_000, 100_000):
            _BIG.append(Raw(b"\x91" * depth + b"\x00"))  # [[[...[0]...]]]
    return _BIG


def _extreme(rng: random.Random) -> Any:
    """A value chosen to break assumptions about sizes, ranges, encodings or depth."""
    kind = rng.randrange(8)
    if kind < 3:
        return rng.choice(EXTREME_INTS)
    if kind < 5:
        return rng.choice(EXTREME_FLOATS)
    if kind == 5:
        return RawStr(rng.choice([b"\xff\xfe", b"\xc3\x28", b"\xed\xa0\x80", b"a\x00b", rng.randbytes(16)]))
    if kind == 6:
        return rng.choice(_big_values())  # long text, deep nesting, a long list
    return rng.choice([{rng.randrange(10): 1, b"k": 2, None: 3},  # map keys that are not strings
                       rng.randbytes(rng.choice([0, 7, 4096]))])  # bin where anything else is expected


class MessageFuzzer:
    """Valid and hostile messages for the msgspec message union ``message_type``."""

    def __init__(self, message_type: Any, rng: random.Random) -> None:
        info = mi.type_info(message_type)
        self.structs: list[mi.StructType] = list(info.types) if isinstance(info, mi.UnionType) else [info]
        self.rng = rng
        self.tags = [s.tag for s in self.structs if s.tag is not None]

    # ------------------------------------------------------------------ valid values
    def valid(self, struct_type: mi.StructType | None = None) -> dict[str, Any]:
        """A message that decodes (modulo semantic checks the server makes beyond the types)."""
        st = struct_type or self.rng.choice(self.structs)
        msg: dict[str, Any] = {}
        if st.tag_field is not None:
            msg[st.tag_field] = st.tag
        for f in st.fields:
            if f.required or self.rng.random() < 0.5:
                msg[f.encode_name] = self.value(f.type, depth=0)
        return msg

    def value(self, t: mi.Type, depth: int) -> Any:
        rng = self.rng
        match t:
            case mi.IntType():
                lo = t.ge if t.ge is not None else (t.gt + 1 if t.gt is not None else -5)
                hi = t.le if t.le is not None else (t.lt - 1 if t.lt is not None else 1000)
                return rng.randint(lo, max(lo, min(hi, lo + 10_000)))
            case mi.FloatType():
                lo = t.ge if t.ge is not None else (t.gt if t.gt is not None else 0.0)
                hi = t.le if t.le is not None else (t.lt if t.lt is not None else 100.0)
                return rng.uniform(lo, min(hi, lo + 100.0))
            case mi.StrType():
                n = rng.randrange(max(t.min_length or 0, 1), max(t.min_length or 0, 1) + 12)
                return "".join(rng.choice("abcdefgh_xyz0123") for _ in range(n))
            case mi.BoolType():
                return rng.random() < 0.5
            case mi.NoneType():
                return None
            case mi.BytesType() | mi.ByteArrayType() | mi.MemoryViewType():
                return rng.randbytes(rng.randrange(16))
            case mi.LiteralType():
                return rng.choice(list(t.values))
            case mi.ListType() | mi.SetType() | mi.FrozenSetType() | mi.VarTupleType():
                n = 0 if depth > 3 else rng.randrange(0, 5)
                return [self.value(t.item_type, depth + 1) for _ in range(n)]
            case mi.TupleType():
                return [self.value(x, depth + 1) for x in t.item_types]
            case mi.DictType():
                n = 0 if depth > 3 else rng.randrange(0, 4)
                return {self.value(t.key_type, depth + 1): self.value(t.value_type, depth + 1) for _ in range(n)}
            case mi.UnionType():
                return self.value(rng.choice(t.types), depth)
            case mi.StructType():
                if t.array_like:
                    return [self.value(f.type, depth + 1) for f in t.fields]
                return self.valid(t) if depth < 4 else {}
            case mi.AnyType():
                return rng.choice([0, 1.5, "s", None, True, [1, 2], {"k": "v"}])
            case _:
                return None

    # ------------------------------------------------------------------ hostile messages
    def mutant(self) -> bytes:
        """One valid message with exactly one thing wrong with it, encoded."""
        msg = self.valid()
        rng = self.rng
        op = rng.randrange(9)
        keys = [k for k in msg if k != "type"]
        if op == 0 and keys:  # a field dropped
            del msg[rng.choice(keys)]
        elif op == 1 and keys:  # a field retyped
            msg[rng.choice(keys)] = rng.choice([None, "str", 1, 1.5, [1], {"a": 1}, b"\x00", True])
        elif op in (2, 3) and keys:  # a field replaced by an extreme value
            msg[rng.choice(keys)] = _extreme(rng)
        elif op == 4:  # an extreme value deep inside a list or map field
            self._mutate_inside(msg)
        elif op == 5:  # an unknown field
            msg[rng.choice(["zzz", "req_id2", "", "\u00e9"])] = _extreme(rng)
        elif op == 6:  # the tag changed: another message's tag, a made-up one, or not a string
            msg["type"] = rng.choice([*self.tags, "nope", 7, None, RawStr(b"\xff")])
        data = pack(msg)
        if op == 7:  # truncated
            return data[: rng.randrange(len(data))]
        if op == 8 and data:  # one byte flipped
            i = rng.randrange(len(data))
            return data[:i] + bytes([data[i] ^ (1 << rng.randrange(8))]) + data[i + 1:]
        return data

    def _mutate_inside(self, msg: dict[str, Any]) -> None:
        containers = [k for k, v in msg.items() if isinstance(v, list | dict) and v]
        if not containers:
            msg["type"] = msg.get("type")
            return
        key = self.rng.choice(containers)
        box = msg[key]
        if isinstance(box, list):
            box[self.rng.randrange(len(box))] = _extreme(self.rng)
        else:
            box[self.rng.choice(list(box))] = _extreme(self.rng)

    def raw(self) -> bytes:
        """Frames that are not built from the types at all."""
        rng = self.rng
        kind = rng.randrange(6)
        if kind == 0:
            return rng.randbytes(rng.randrange(1, 64))
        if kind == 1:
            return b""
        if kind == 2:  # a container or string that declares 4 G entries and ends
            return rng.choice([b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff",
                               b"\xc6\xff\xff\xff\xff"])
        if kind == 3:
            return b"\x91" * rng.choice([1_000, 200_000])  # nesting that never closes
        if kind == 4:
            return pack(rng.choice([1, "x", [1, 2], None, 3.5]))  # valid msgpack, not a map
        return bytes([rng.randrange(0xC1, 0xC2)]) + rng.randbytes(8)  # 0xc1: never used in msgpack

    def frame(self) -> bytes:
        """The next fuzz frame: mostly mutants, some raw bytes, a few valid messages."""
        r = self.rng.random()
        if r < 0.75:
            return self.mutant()
        if r < 0.9:
            return self.raw()
        return pack(self.valid())


def decodes(decoder: msgspec.msgpack.Decoder[Any], data: bytes) -> bool:
    """Whether ``data`` is a valid message for ``decoder`` (for the fuzzer's own statistics)."""
    try:
        decoder.decode(data)
    except (ValueError, UnicodeDecodeError, RecursionError, OverflowError):
        return False
    return True
