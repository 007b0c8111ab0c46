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
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from streamrl.dock.errors import WireFormatError
from streamrl.dock.protocol import Column, ObjectColumn, TensorColumn

ZERO_COPY_BYTES = 64 * 1024  # below this a tensor is packed: a frame costs more than a copy
ALIGN = 16  # byte alignment of each column's values inside a pack frame (covers every torch dtype)
# a column's small values are joined by one torch.cat below this many elements, where torch runs a
# cat on the calling thread (at::internal::GRAIN_SIZE); above, part by part with numpy, which never
# wakes torch's thread pool
SERIAL_CAT_ELEMENTS = 32768

_DTYPES: dict[str, torch.dtype] = {
    str(dt).removeprefix("torch."): dt
    for dt in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16,
        torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
        torch.complex64, torch.complex128,
    )
}
for _name in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64"):
    if hasattr(torch, _name):
        _DTYPES[_name] = getattr(torch, _name)

Frame = Any  # a buffer-protocol object on send (memoryview/bytes), a zmq.Frame or bytes on receive


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype | None:
    """The dtype a wire name (:func:`dtype_name`) stands for; None for a name the codec does not carry."""
    return _DTYPES.get(name)


def _as_bytes_view(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's bytes (0-d included)."""
    return t.reshape(-1).view(torch.uint8)


def encode_columns(columns: Mapping[str, Sequence[Any]], n: int) -> tuple[list[Column], list[Frame]]:
    """Encode ``columns`` (name -> one value per sample, ``n`` samples) into header columns + frames."""
    header: list[Column] = []
    frames: list[Frame] = []
    pack_parts: list[np.ndarray] = []
    pack_size = 0
    pack_frame: int | None = None  # index of the pack frame, assigned when the first small value comes
    for name, values in columns.items():
        if len(values) != n:
            raise ValueError(f"column {name!r} has {len(values)} values for {n} samples")
        if n and all(isinstance(v, torch.Tensor) for v in values):
            dtype = values[0].dtype
            if any(v.dtype != dtype for v in values):
                found = sorted({dtype_name(v.dtype) for v in values})
                raise ValueError(f"column {name!r} mixes dtypes {found}: cast them to one dtype")
            if dtype_name(dtype) not in _DTYPES:
                raise ValueError(f"column {name!r} has unsupported dtype {dtype}")
            shapes, frame_ids, offsets = [], [], []
            small: list[torch.Tensor] = []  # this column's packed values, flat, back to back
            run = 0  # bytes of them so far
            leading_empty: list[int] = []  # positions of empty values met before the run's first bytes
            start = -1  # where this column's run starts in the pack: aligned (rule 3), at its first bytes
            for v in values:
                if v.device.type != "cpu":
                    v = v.cpu()  # device tensors are staged through host memory
                if not v.is_contiguous():
                    v = v.contiguous()  # rule 2: the contiguous copy is what stays alive
                shapes.append(list(v.shape))
                nbytes = v.nbytes
                if nbytes >= ZERO_COPY_BYTES:
                    # rule 1: own frame, zero-copy; the memoryview pins the tensor's storage
                    frame_ids.append(len(frames))
                    offsets.append(0)
                    frames.append(memoryview(_as_bytes_view(v).numpy()))
                else:
                    if pack_frame is None:
                        pack_frame = len(frames)
                        frames.append(b"")  # placeholder, filled once the pack is complete
                    frame_ids.append(pack_frame)
                    if nbytes:
                        if start < 0:
                            start = pack_size + (-pack_size) % ALIGN
                            for k in leading_empty:  # keep the run unbroken for the receiver's one split
                                offsets[k] = start
                        offsets.append(start + run)
                        small.append(v if v.dim() == 1 else v.reshape(-1))
                        run += nbytes
                    elif start < 0:  # an empty value before the run: placed at its start once known,
                        leading_empty.append(len(offsets))  # else at the pack's end (within the frame)
                        offsets.append(pack_size - pack_size % v.element_size())
                    else:
                        offsets.append(start + run)
            if small:
                if start > pack_size:
                    pack_parts.append(np.zeros(start - pack_size, np.uint8))
                # values of one dtype need no padding between them: one copy for the whole column,
                # torch.cat where it is small enough to stay on this thread (see the pack below)
                if run // dtype.itemsize < SERIAL_CAT_ELEMENTS:
                    pack_parts.append(_as_bytes_view(torch.cat(small) if len(small) > 1 else small[0]).numpy())
                else:
                    pack_parts.extend(_as_bytes_view(v).numpy() for v in small)
                pack_size = start + run
            header.append(TensorColumn(name, dtype_name(dtype), shapes, frame_ids, offsets))
        elif any(isinstance(v, torch.Tensor) for v in values):
            raise ValueError(f"column {name!r} mixes tensors and other values: use one kind per column")
        else:
            header.append(ObjectColumn(name, list(values)))
    if pack_frame is not None:
        # numpy, not torch.cat: torch copies 32-64 KiB parts with its thread pool, which costs
        # milliseconds of wake-up on a busy machine; this is a plain single-threaded memcpy
        packed = np.concatenate(pack_parts) if pack_parts else np.zeros(0, np.uint8)
        frames[pack_frame] = memoryview(packed)
    return header, frames


def _frame_tensor(frame: Frame) -> torch.Tensor:
    buf = frame.buffer if hasattr(frame, "buffer") else frame
    if len(buf) == 0:
        return torch.zeros(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        # zmq frames may be read-only; the tensor is a view we only read (rule 4)
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=torch.uint8)


def decode_columns(
    columns: Sequence[Column], frames: Sequence[Frame], n: int, *, exact: bool = False
) -> dict[str, list[Any]]:
    """Rebuild column values from header columns and tensor frames; checks every size and bound.

    ``exact`` (for a whole message's columns: a put, a fetched reply) also refuses frames the
    header does not account for: a frame no value references, or one longer than its values
    plus the alignment padding (``ALIGN - 1`` bytes per value at most). Without it, a peer could
    make a receiver hold far more memory than the header declares (values are views of frames).
    """
    return _decode(columns, frames, n, exact, None)


def decode_put(
    columns: Sequence[Column], frames: Sequence[Frame], n: int
) -> tuple[dict[str, list[Any]], list[tuple[int, set[int]]]]:
    """:func:`decode_columns` with ``exact``, plus per frame ``(bytes, positions of the samples
    whose values view it)``: what a store needs to count the memory it really holds."""
    users: list[set[int]] = [set() for _ in frames]
    values = _decode(columns, frames, n, True, users)
    return values, [(_frame_len(f), u) for f, u in zip(frames, users, strict=True)]


def _frame_len(frame: Frame) -> int:
    return len(frame.buffer if hasattr(frame, "buffer") else frame)


def _aligned_frame(raw: list[torch.Tensor], aligned: dict[tuple[int, int], torch.Tensor], fid: int,
                   itemsize: int) -> torch.Tensor:
    """Frame ``fid`` as bytes whose address suits ``itemsize``: rule 5 copies a misaligned frame
    once, and later values of that frame reuse the copy."""
    buf = raw[fid]
    if buf.data_ptr() % itemsize == 0:
        return buf
    key = (fid, itemsize)
    if key not in aligned:
        aligned[key] = buf.clone()
    return aligned[key]


def _view(raw: list[torch.Tensor], aligned: dict[tuple[int, int], torch.Tensor], fid: int, off: int,
          shape: list[int], numel: int, dtype: torch.dtype, itemsize: int) -> torch.Tensor:
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    buf = _aligned_frame(raw, aligned, fid, itemsize)
    return buf[off : off + numel * itemsize].view(dtype).reshape(shape)


def _split_run(raw: list[torch.Tensor], aligned: dict[tuple[int, int], torch.Tensor], fid: int, off: int,
               shapes: list[list[int]], numels: list[int], dtype: torch.dtype, itemsize: int) -> list[torch.Tensor]:
    """A column whose values lie back to back in one frame: one typed view, one split into views."""
    total = sum(numels)
    if total == 0:
        return [torch.empty(shape, dtype=dtype) for shape in shapes]
    buf = _aligned_frame(raw, aligned, fid, itemsize)
    parts = buf[off : off + total * itemsize].view(dtype).split(numels)
    return [part if len(shape) == 1 else part.reshape(shape) for part, shape in zip(parts, shapes, strict=True)]


def _values(name: str, raw: list[torch.Tensor], aligned: dict[tuple[int, int], torch.Tensor],
            shapes: list[list[int]], fids: list[int], offs: list[int], numels: list[int], dtype: torch.dtype,
            itemsize: int, budget: list[int] | None, ends: list[int] | None,
            users: list[set[int]] | None) -> list[torch.Tensor]:
    """A column in any other layout, value by value: each one's frame and bounds checked."""
    for k, (fid, off, numel) in enumerate(zip(fids, offs, numels, strict=True)):
        nbytes = numel * itemsize
        if not 0 <= fid < len(raw):
            raise WireFormatError(f"column {name!r}: frame {fid} missing ({len(raw)} frames)")
        if off < 0 or off % itemsize or off + nbytes > raw[fid].numel():
            raise WireFormatError(
                f"column {name!r}: bytes [{off}, {off + nbytes}) fall outside frame {fid} "
                f"of {raw[fid].numel()} bytes or are misaligned"
            )
        if budget is not None and ends is not None:
            budget[fid] += nbytes + (-nbytes) % ALIGN
            ends[fid] = max(ends[fid], off + nbytes)
        if users is not None:
            users[fid].add(k)
    return [_view(raw, aligned, fid, off, shape, numel, dtype, itemsize)
            for shape, fid, off, numel in zip(shapes, fids, offs, numels, strict=True)]


def _decode(
    columns: Sequence[Column], frames: Sequence[Frame], n: int, exact: bool, users: list[set[int]] | None
) -> dict[str, list[Any]]:
    raw = [_frame_tensor(f) for f in frames]
    aligned: dict[tuple[int, int], torch.Tensor] = {}
    out: dict[str, list[Any]] = {}
    # per frame: bytes its values may span (each padded to ALIGN) and the end of the last value
    budget = [0] * len(raw) if exact else None
    ends = [-1] * len(raw) if exact else None
    for col in columns:
        match col:
            case ObjectColumn(name=name, values=values):
                if len(values) != n:
                    raise WireFormatError(f"column {name!r} has {len(values)} values for {n} samples")
                out[name] = values
            case TensorColumn(name=name, dtype=dt, shapes=shapes, frames=fids, offsets=offs):
                dtype = _DTYPES.get(dt)
                if dtype is None:
                    raise WireFormatError(f"column {name!r}: unknown dtype {dt!r}")
                if not (len(shapes) == len(fids) == len(offs) == n):
                    raise WireFormatError(f"column {name!r}: shapes/frames/offsets must have {n} entries")
                itemsize = dtype.itemsize
                if min(itertools.chain.from_iterable(shapes), default=0) < 0:
                    bad = next(s for s in shapes if s and min(s) < 0)
                    raise WireFormatError(f"column {name!r}: negative dimension in shape {bad}")
                numels = [math.prod(s) for s in shapes]
                starts = list(itertools.accumulate(numels, initial=offs[0] // itemsize if n else 0))
                fid = fids[0] if n else -1
                if (n and fids.count(fid) == n and 0 <= fid < len(raw) and offs[0] >= 0 and offs[0] % itemsize == 0
                        and starts[-1] * itemsize <= raw[fid].numel()
                        and offs == [s * itemsize for s in starts[:-1]]):
                    # every value in one frame, back to back (how streamrl packs): checked as one
                    # span, cut into views by one split
                    if budget is not None and ends is not None:
                        budget[fid] += sum(m * itemsize + (-m * itemsize) % ALIGN for m in numels)
                        ends[fid] = max(ends[fid], starts[-1] * itemsize)
                    if users is not None:
                        users[fid].update(range(n))
                    out[name] = _split_run(raw, aligned, fid, offs[0], shapes, numels, dtype, itemsize)
                else:
                    out[name] = _values(name, raw, aligned, shapes, fids, offs, numels, dtype, itemsize, budget, ends,
                                        users)
    if budget is not None and ends is not None:
        for fid, (size, end) in enumerate(zip(budget, ends, strict=True)):
            length = raw[fid].numel()
            if end < 0:
                raise WireFormatError(f"tensor frame {fid} ({length} bytes) is referenced by no value: send "
                                      "only frames the header describes")
            if length > size:
                raise WireFormatError(
                    f"tensor frame {fid} is {length} bytes but its values need at most {size} (their bytes, "
                    f"each padded to {ALIGN}): frames must be as long as the header describes"
                )
    return out
