"""Column values <-> (header columns, tensor frames), zero-copy where it pays.

Buffer-lifetime rules (each one has a test in tests/dock/test_codec.py):

1. *Large tensors are sent without copying.* A tensor of at least ``ZERO_COPY_BYTES`` goes out
   as its own frame built from a memoryview of its storage, and ``send_multipart(copy=False)``
   makes libzmq read that memory later, from its I/O thread. pyzmq keeps a reference to the
   memoryview (hence to the tensor) until libzmq is done, so the memory cannot be freed early.
   It can still be *modified* early: callers must not write to a tensor they passed to ``put``
   until the ``put`` has returned. ``put`` returns only after the warehouse replied, i.e. after
   every byte arrived there, so "await put, then mutate" is safe.
2. *Non-contiguous tensors are copied* (``contiguous()``): the copy is what rule 1 keeps alive.
3. *Small tensors are packed*: every tensor under the threshold is copied into one pack frame
   per message, because a frame per 16-byte tensor costs far more in per-frame overhead than the
   copy. A column's values lie back to back from an ``ALIGN`` boundary: one copy per column on
   the way out, one split into views on the way in, not a few torch calls per value.
4. *Received tensors are views of the received frame* (``torch.frombuffer``). The tensor keeps
   the zmq Frame alive through the buffer protocol, so the frame outlives every view of it. A
   consequence: one small value that is still referenced keeps its whole pack frame alive.
   Writing into a received tensor writes into that frame's memory, which this process owns.
5. *Misaligned frames are copied.* libzmq stores small messages inline, where the data start may
   only be 8-byte aligned; viewing it as a wider dtype needs the element size's alignment, so a
   frame whose address is not aligned for a column's dtype is copied once into fresh memory.
"""

from __future__ import annotations

import itertools
import math
import sys
import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from streamrl.dock.errors import WireFormatError
from streamrl.dock.protocol import Column, ObjectColumn, TensorColumn

if TYPE_CHECKING:
    import torch

ZERO_COPY_BYTES = 64 * 1024  # below this a tensor is packed: a frame costs more than a copy
ALIGN = 16  # byte alignment of each column's values inside a pack frame (covers every torch dtype)
# a column's small values are joined by one torch.cat below this many elements, where torch runs a
# cat on the calling thread (at::internal::GRAIN_SIZE); above, part by part, which never wakes
# torch's thread pool
SERIAL_CAT_ELEMENTS = 32768

# the dtypes the wire carries: torch's name without "torch." -> bytes per element (docs/dock-protocol.md)
ITEMSIZES: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
    "complex64": 8, "complex128": 16,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "uint16": 2, "uint32": 4, "uint64": 8,
}
_TORCH_DTYPES: dict[str, torch.dtype] = {}  # filled on first use: this module never imports torch itself

Frame = Any  # a buffer-protocol object on send (memoryview/bytes), a zmq.Frame or bytes on receive


class RawValue:
    """A tensor as a process without torch holds it (the dock's warehouse): its dtype's wire name,
    its shape, and its bytes, a view of the frame it came in (rule 4). :func:`encode_columns` sends
    it exactly as it would send the tensor it stands for."""

    __slots__ = ("data", "dtype", "shape")

    def __init__(self, dtype: str, shape: list[int], data: memoryview) -> None:
        self.dtype = dtype
        self.shape = shape
        self.data = data  # flat, format "B"

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def __repr__(self) -> str:
        return f"RawValue({self.dtype}, {self.shape})"


def torch_dtypes() -> dict[str, torch.dtype]:
    """Wire name -> torch dtype, for the names this torch has (imports torch)."""
    if not _TORCH_DTYPES:
        import torch

        _TORCH_DTYPES.update({name: getattr(torch, name) for name in ITEMSIZES if hasattr(torch, name)})
    return _TORCH_DTYPES


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype | None:
    """The dtype a wire name (:func:`dtype_name`) stands for; None for a name the codec does not carry."""
    return torch_dtypes().get(name)


def _as_bytes_view(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's bytes (0-d included)."""
    import torch

    return t.reshape(-1).view(torch.uint8)


def encode_columns(columns: Mapping[str, Sequence[Any]], n: int) -> tuple[list[Column], list[Frame]]:
    """Encode ``columns`` (name -> one value per sample, ``n`` samples) into header columns + frames.

    A column of tensors (or of :class:`RawValue`, as the warehouse keeps them) becomes a
    :class:`TensorColumn`; any other column an :class:`ObjectColumn`."""
    header: list[Column] = []
    frames: list[Frame] = []
    pack = _Pack(frames)
    # a value can only be a tensor where torch is loaded: a process without it never imports it here
    torch = sys.modules.get("torch")
    tensor_type = torch.Tensor if torch is not None else RawValue
    for name, values in columns.items():
        if len(values) != n:
            raise ValueError(f"column {name!r} has {len(values)} values for {n} samples")
        if n and all(type(v) is RawValue for v in values):
            header.append(_encode_raw(name, values, frames, pack))
        elif n and all(isinstance(v, tensor_type) for v in values):
            header.append(_encode_tensors(name, values, frames, pack))
        elif any(isinstance(v, (tensor_type, RawValue)) for v in values):
            raise ValueError(f"column {name!r} mixes tensors and other values: use one kind per column")
        else:
            header.append(ObjectColumn(name, list(values)))
    pack.close()
    return header, frames


class _Pack:
    """The one pack frame of a message: every small value, each column's values back to back from
    an ``ALIGN`` boundary (rule 3). Its frame index is taken when the first small value comes."""

    def __init__(self, frames: list[Frame]) -> None:
        self.frames = frames
        self.parts: list[Any] = []  # buffer-protocol objects, joined once by close()
        self.size = 0
        self.frame: int | None = None

    def frame_id(self) -> int:
        if self.frame is None:
            self.frame = len(self.frames)
            self.frames.append(b"")  # placeholder, filled once the pack is complete
        return self.frame

    def close(self) -> None:
        if self.frame is not None:
            # one single-threaded memcpy of every part, not torch.cat: torch copies 32-64 KiB parts
            # with its thread pool, which costs milliseconds of wake-up on a busy machine
            self.frames[self.frame] = memoryview(b"".join(self.parts))


def _layout(nbytes: list[int], itemsize: int, frames: list[Frame], pack: _Pack,
            own_frame: Any) -> tuple[list[int], list[int], list[int]]:
    """Where each of a column's values goes: its own frame from ``own_frame(k)`` (rule 1) or the
    pack (rule 3). Returns (frame ids, offsets, the positions of the packed values with bytes) and
    pads the pack up to where their run starts (aligned)."""
    frame_ids: list[int] = []
    offsets: list[int] = []
    packed: list[int] = []
    run = 0  # bytes of the packed values so far
    leading_empty: list[int] = []  # positions of empty values met before the run's first bytes
    start = -1  # where this column's run starts in the pack: aligned (rule 3), at its first bytes
    for k, size in enumerate(nbytes):
        if size >= ZERO_COPY_BYTES:
            frame_ids.append(len(frames))
            offsets.append(0)
            frames.append(own_frame(k))
            continue
        frame_ids.append(pack.frame_id())
        if size:
            if start < 0:
                start = pack.size + (-pack.size) % ALIGN
                for j in leading_empty:  # keep the run unbroken for the receiver's one split
                    offsets[j] = start
            offsets.append(start + run)
            packed.append(k)
            run += size
        elif start < 0:  # an empty value before the run: placed at its start once known,
            leading_empty.append(len(offsets))  # else at the pack's end (within the frame)
            offsets.append(pack.size - pack.size % itemsize)
        else:
            offsets.append(start + run)
    if packed:
        if start > pack.size:
            pack.parts.append(bytes(start - pack.size))
        pack.size = start + run
    return frame_ids, offsets, packed


def _encode_tensors(name: str, values: Sequence[Any], frames: list[Frame], pack: _Pack) -> TensorColumn:
    import torch

    dtype = values[0].dtype
    if any(v.dtype != dtype for v in values):
        found = sorted({dtype_name(v.dtype) for v in values})
        raise ValueError(f"column {name!r} mixes dtypes {found}: cast them to one dtype")
    if dtype_name(dtype) not in torch_dtypes():
        raise ValueError(f"column {name!r} has unsupported dtype {dtype}")
    column = _encode_small(name, values, dtype, pack)
    if column is not None:
        return column
    tensors: list[torch.Tensor] = []
    for v in values:
        if v.device.type != "cpu":
            v = v.cpu()  # device tensors are staged through host memory
        if not v.is_contiguous():
            v = v.contiguous()  # rule 2: the contiguous copy is what stays alive
        tensors.append(v)
    # rule 1: own frame, zero-copy; the memoryview pins the tensor's storage
    frame_ids, offsets, packed = _layout([v.nbytes for v in tensors], dtype.itemsize, frames, pack,
                                         lambda k: memoryview(_as_bytes_view(tensors[k]).numpy()))
    if packed:
        small = [tensors[k] if tensors[k].dim() == 1 else tensors[k].reshape(-1) for k in packed]
        # values of one dtype need no padding between them: one copy for the whole column,
        # torch.cat where it is small enough to stay on this thread (see _Pack.close)
        if sum(v.numel() for v in small) < SERIAL_CAT_ELEMENTS:
            pack.parts.append(_as_bytes_view(torch.cat(small) if len(small) > 1 else small[0]).numpy())
        else:
            pack.parts.extend(_as_bytes_view(v).numpy() for v in small)
    return TensorColumn(name, dtype_name(dtype), [list(v.shape) for v in tensors], frame_ids, offsets)


def _encode_small(name: str, values: Sequence[Any], dtype: torch.dtype, pack: _Pack) -> TensorColumn | None:
    """A column small enough to go whole into the pack (under ``ZERO_COPY_BYTES`` and
    ``SERIAL_CAT_ELEMENTS`` in all) whose values have one rank (scalars, or tensors of one rank
    that differ only in their first dimension): joined by one ``torch.stack`` or ``torch.cat`` of
    the values as they are, with no per-value device move, contiguity check or reshape (rules 2
    and 3 still hold: the join copies). None for any other column, and for one with no bytes."""
    import torch

    shapes = [list(v.shape) for v in values]
    ranks = set(map(len, shapes))
    numels = list(map(math.prod, shapes))
    total = sum(numels)
    if len(ranks) != 1 or not 0 < total < SERIAL_CAT_ELEMENTS or total * dtype.itemsize >= ZERO_COPY_BYTES:
        return None
    try:
        # a scalar column is stacked (cat takes no 0-d tensor); tensors on one device are joined
        # there and staged through host memory once (rule 2 of encode_columns, one copy in all)
        joined = torch.stack(list(values)) if ranks == {0} else torch.cat(list(values))
    except RuntimeError:  # values on different devices, or of different trailing shapes
        return None
    if joined.device.type != "cpu":
        joined = joined.cpu()
    start = pack.size + (-pack.size) % ALIGN
    fid = pack.frame_id()
    if start > pack.size:
        pack.parts.append(bytes(start - pack.size))
    itemsize = dtype.itemsize
    offsets = [start + k * itemsize for k in itertools.accumulate(numels[:-1], initial=0)]
    pack.parts.append(_as_bytes_view(joined).numpy())
    pack.size = start + total * itemsize
    return TensorColumn(name, dtype_name(dtype), shapes, [fid] * len(values), offsets)


def _encode_raw(name: str, values: Sequence[RawValue], frames: list[Frame], pack: _Pack) -> TensorColumn:
    dtype = values[0].dtype
    if any(v.dtype != dtype for v in values):
        raise ValueError(f"column {name!r} mixes dtypes {sorted({v.dtype for v in values})}: cast them to one dtype")
    # the bytes as they came (rule 4's views): large ones go out as their own frames, uncopied
    frame_ids, offsets, packed = _layout([v.data.nbytes for v in values], ITEMSIZES[dtype], frames, pack,
                                         lambda k: values[k].data)
    pack.parts.extend(values[k].data for k in packed)
    return TensorColumn(name, dtype, [list(v.shape) for v in values], frame_ids, offsets)


def _frame_tensor(frame: Frame) -> torch.Tensor:
    import torch

    buf = frame.buffer if hasattr(frame, "buffer") else frame
    if len(buf) == 0:
        return torch.zeros(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        # zmq frames may be read-only; the tensor is a view we only read (rule 4)
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=torch.uint8)


def _frame_bytes(frame: Frame) -> memoryview:
    buf = frame.buffer if hasattr(frame, "buffer") else frame
    view = memoryview(buf)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def decode_columns(
    columns: Sequence[Column], frames: Sequence[Frame], n: int, *, exact: bool = False
) -> dict[str, list[Any]]:
    """Rebuild column values from header columns and tensor frames; checks every size and bound.

    ``exact`` (for a whole message's columns: a put, a fetched reply) also refuses frames the
    header does not account for: a frame no value references, or one longer than its values
    plus the alignment padding (``ALIGN - 1`` bytes per value at most). Without it, a peer could
    make a receiver hold far more memory than the header declares (values are views of frames).
    """
    return _decode(columns, frames, n, exact, None, False)


def decode_put(
    columns: Sequence[Column], frames: Sequence[Frame], n: int, *, raw: bool = False
) -> tuple[dict[str, list[Any]], list[tuple[int, set[int]]]]:
    """:func:`decode_columns` with ``exact``, plus per frame ``(bytes, positions of the samples
    whose values view it)``: what a store needs to count the memory it really holds. ``raw``: each
    tensor as a :class:`RawValue` (no torch), as the warehouse keeps it."""
    users: list[set[int]] = [set() for _ in frames]
    values = _decode(columns, frames, n, True, users, raw)
    return values, [(_frame_len(f), u) for f, u in zip(frames, users, strict=True)]


def _frame_len(frame: Frame) -> int:
    return len(frame.buffer if hasattr(frame, "buffer") else frame)


class _Tensors:
    """Values as torch tensors: views of the received frames (rule 4), misaligned frames copied
    once (rule 5)."""

    def __init__(self, frames: Sequence[Frame]) -> None:
        self.raw = [_frame_tensor(f) for f in frames]
        self.aligned: dict[tuple[int, int], torch.Tensor] = {}

    def _frame(self, fid: int, itemsize: int) -> torch.Tensor:
        """Frame ``fid`` as bytes whose address suits ``itemsize``: rule 5 copies a misaligned
        frame once, and later values of that frame reuse the copy."""
        buf = self.raw[fid]
        if buf.data_ptr() % itemsize == 0:
            return buf
        key = (fid, itemsize)
        if key not in self.aligned:
            self.aligned[key] = buf.clone()
        return self.aligned[key]

    def run(self, dt: str, fid: int, offs: list[int], shapes: list[list[int]], numels: list[int],
            itemsize: int) -> list[torch.Tensor]:
        """A column whose values lie back to back in one frame: one typed view, one split into views."""
        import torch

        off = offs[0]
        dtype = torch_dtypes()[dt]
        total = sum(numels)
        if total == 0:
            return [torch.empty(shape, dtype=dtype) for shape in shapes]
        flat = self._frame(fid, itemsize)[off : off + total * itemsize].view(dtype)
        ranks = set(map(len, shapes))
        if ranks == {0}:  # scalars: one unbind makes every 0-d view
            return list(flat.unbind())
        parts = flat.split(numels)
        if ranks == {1}:
            return list(parts)
        return [part if len(shape) == 1 else part.reshape(shape) for part, shape in zip(parts, shapes, strict=True)]

    def each(self, dt: str, fids: list[int], offs: list[int], shapes: list[list[int]], numels: list[int],
             itemsize: int) -> list[torch.Tensor]:
        import torch

        dtype = torch_dtypes()[dt]
        return [torch.empty(shape, dtype=dtype) if numel == 0 else
                self._frame(fid, itemsize)[off : off + numel * itemsize].view(dtype).reshape(shape)
                for shape, fid, off, numel in zip(shapes, fids, offs, numels, strict=True)]


class _Raw:
    """Values as :class:`RawValue`: views of the received frames' bytes, never copied."""

    def __init__(self, frames: Sequence[Frame]) -> None:
        self.raw = [_frame_bytes(f) for f in frames]

    def run(self, dt: str, fid: int, offs: list[int], shapes: list[list[int]], numels: list[int],
            itemsize: int) -> list[RawValue]:
        return self.each(dt, [fid] * len(shapes), offs, shapes, numels, itemsize)

    def each(self, dt: str, fids: list[int], offs: list[int], shapes: list[list[int]], numels: list[int],
             itemsize: int) -> list[RawValue]:
        raw = self.raw
        return [RawValue(dt, shape, raw[fid][off : off + numel * itemsize])
                for shape, fid, off, numel in zip(shapes, fids, offs, numels, strict=True)]


def _decode(
    columns: Sequence[Column], frames: Sequence[Frame], n: int, exact: bool, users: list[set[int]] | None,
    raw: bool,
) -> dict[str, list[Any]]:
    views = _Raw(frames) if raw else _Tensors(frames)
    lengths = [len(f) if raw else f.numel() for f in views.raw]
    out: dict[str, list[Any]] = {}
    # per frame: bytes its values may span (each padded to ALIGN) and the end of the last value
    budget = [0] * len(lengths) if exact else None
    ends = [-1] * len(lengths) if exact else None
    for col in columns:
        match col:
            case ObjectColumn(name=name, values=values):
                if len(values) != n:
                    raise WireFormatError(f"column {name!r} has {len(values)} values for {n} samples")
                out[name] = values
            case TensorColumn(name=name, dtype=dt, shapes=shapes, frames=fids, offsets=offs):
                itemsize = ITEMSIZES.get(dt, 0)
                if not itemsize or (not raw and dt not in torch_dtypes()):
                    raise WireFormatError(f"column {name!r}: unknown dtype {dt!r}")
                if not (len(shapes) == len(fids) == len(offs) == n):
                    raise WireFormatError(f"column {name!r}: shapes/frames/offsets must have {n} entries")
                if min(itertools.chain.from_iterable(shapes), default=0) < 0:
                    bad = next(s for s in shapes if s and min(s) < 0)
                    raise WireFormatError(f"column {name!r}: negative dimension in shape {bad}")
                numels = [math.prod(s) for s in shapes]
                starts = list(itertools.accumulate(numels, initial=offs[0] // itemsize if n else 0))
                fid = fids[0] if n else -1
                if (n and fids.count(fid) == n and 0 <= fid < len(lengths) and offs[0] >= 0
                        and offs[0] % itemsize == 0 and starts[-1] * itemsize <= lengths[fid]
                        and offs == [s * itemsize for s in starts[:-1]]):
                    # every value in one frame, back to back (how streamrl packs): checked as one
                    # span, cut into views by one split
                    if budget is not None and ends is not None:
                        budget[fid] += sum(m * itemsize + (-m * itemsize) % ALIGN for m in numels)
                        ends[fid] = max(ends[fid], starts[-1] * itemsize)
                    if users is not None:
                        users[fid].update(range(n))
                    out[name] = views.run(dt, fid, offs, shapes, numels, itemsize)
                else:  # any other layout, value by value: each one's frame and bounds checked
                    _check_each(name, lengths, fids, offs, numels, itemsize, budget, ends, users)
                    out[name] = views.each(dt, fids, offs, shapes, numels, itemsize)
    if budget is not None and ends is not None:
        for fid, (size, end) in enumerate(zip(budget, ends, strict=True)):
            length = lengths[fid]
            if end < 0:
                raise WireFormatError(f"tensor frame {fid} ({length} bytes) is referenced by no value: send "
                                      "only frames the header describes")
            if length > size:
                raise WireFormatError(
                    f"tensor frame {fid} is {length} bytes but its values need at most {size} (their bytes, "
                    f"each padded to {ALIGN}): frames must be as long as the header describes"
                )
    return out


def _check_each(name: str, lengths: list[int], fids: list[int], offs: list[int], numels: list[int], itemsize: int,
                budget: list[int] | None, ends: list[int] | None, users: list[set[int]] | None) -> None:
    for k, (fid, off, numel) in enumerate(zip(fids, offs, numels, strict=True)):
        nbytes = numel * itemsize
        if not 0 <= fid < len(lengths):
            raise WireFormatError(f"column {name!r}: frame {fid} missing ({len(lengths)} frames)")
        if off < 0 or off % itemsize or off + nbytes > lengths[fid]:
            raise WireFormatError(
                f"column {name!r}: bytes [{off}, {off + nbytes}) fall outside frame {fid} "
                f"of {lengths[fid]} bytes or are misaligned"
            )
        if budget is not None and ends is not None:
            budget[fid] += nbytes + (-nbytes) % ALIGN
            ends[fid] = max(ends[fid], off + nbytes)
        if users is not None:
            users[fid].add(k)
